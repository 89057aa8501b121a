"""What a tuning run will cost, before it starts, and the budget that stops it.

``estimate`` runs the run's own scoring code (``CandidateScorer.measure`` and ``evaluate``, with their caches,
entity swaps, PromptBench perturbations, judge items and latency probes) against ``CountingModel``s: stand-ins
that answer instantly and count what a real model would have been asked. So the estimate follows the code:
a change to what scoring asks is priced without touching this file. What it cannot know in advance:

* which candidates the policy writes. It prices distinct, valid ones as long as the policy may write (the
  most tokens); an invalid candidate costs nothing and a repeated one is answered from the cache, so a run
  makes at most the estimated calls, and about as many when its candidates are valid and distinct;
* how long the answers are. Completion tokens are priced at the task's limit (``answer.max_new_tokens``);
  real answers stop earlier, so token figures are an upper bound.

Local models and servers differ in one place: a local answer reads the label log-probs in the same pass (one
call) on the packed Llama path in every dtype, and on transformers' path in float32; a server returns either an
answer or log-probs, and a local bfloat16 model off the packed path scores the labels in a pass of its own
(``LabelScorer._greedy``): two calls. ``CountingModel(served=..., labels_with_answers=...)`` follows, with
``pipelines.engine.target.answers_give_label_rows`` read from the model's configuration.

``Budget`` caps the target's calls and the target's and the judge's tokens (what servers bill). Before each
step the loop asks ``Plan.affords``: the calls spent so far, plus one more step, plus the selection and the
held-out test that end every run, must fit. A run that cannot afford the seed and the final test does not
start; a run that can stops after the last step it can pay for, and still tests and records its best.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from pipelines.config import Endpoint, ModelSource, RunOptions, TaskConfig
from pipelines.data import Splits
from pipelines.engine.answers import Answer
from pipelines.engine.usage import ROLES, Usage
from templates.template import Template

PHASES = ("seed", "steps", "select", "test")


class BudgetError(ValueError):
    """The budget cannot pay for the smallest run; the message says how much it needs."""


@dataclass(frozen=True)
class Budget:
    max_target_calls: int | None = None  # calls to the target model (see pipelines/engine/usage.py)
    max_tokens: int | None = None  # prompt and completion tokens of the target and the judge together

    def over(self, spent: dict[str, Usage]) -> str | None:
        """Why ``spent`` is over this budget (None when it is within)."""
        target, judge = spent.get("target", Usage()), spent.get("judge", Usage())
        if self.max_target_calls is not None and target.calls > self.max_target_calls:
            return f"{target.calls} target calls > --max-target-calls {self.max_target_calls}"
        if self.max_tokens is not None and target.tokens + judge.tokens > self.max_tokens:
            return f"{target.tokens + judge.tokens} target and judge tokens > --max-tokens {self.max_tokens}"
        return None

    def __bool__(self) -> bool:
        return self.max_target_calls is not None or self.max_tokens is not None


@dataclass
class Plan:
    """The estimated cost of a run, per phase and role: ``steps`` is one step's cost (each step costs the same)."""

    steps: int
    phases: dict[str, dict[str, Usage]] = field(default_factory=dict)
    work: dict[str, int] = field(default_factory=dict)  # phase -> tokens a local target and judge compute
    chosen_test: dict[str, Usage] = field(default_factory=dict)  # the chosen candidate's part of the test phase

    def total(self, steps: int | None = None, *, chosen: bool = True) -> dict[str, Usage]:
        """The run's cost after ``steps`` steps; without ``chosen``, less the chosen candidate's test (a run whose
        choice kept the seed tests the seed alone)."""
        steps = self.steps if steps is None else steps
        out = {role: Usage() for role in ROLES}
        if not chosen:
            for role, usage in self.chosen_test.items():
                out[role] = out[role] - usage
        for phase, per_role in self.phases.items():
            times = steps if phase == "steps" else 1
            for role, usage in per_role.items():
                out[role] = out[role] + Usage(usage.calls * times, usage.prompt_tokens * times,
                                              usage.completion_tokens * times)
        return out

    def ending(self) -> dict[str, Usage]:
        """What the run still spends after its last step: the choice on the whole dev split, and the test."""
        out = {role: Usage() for role in ROLES}
        for phase in ("select", "test"):
            for role, usage in self.phases.get(phase, {}).items():
                out[role] = out[role] + usage
        return out

    def affords(self, budget: Budget, spent: dict[str, Usage], more_steps: int) -> str | None:
        """None when ``spent`` plus ``more_steps`` steps plus the ending fits ``budget``; else why not."""
        after = dict(spent)
        step = {role: Usage(u.calls * more_steps, u.prompt_tokens * more_steps, u.completion_tokens * more_steps)
                for role, u in self.phases.get("steps", {}).items()}
        for part in (self.ending(), step):
            for role, usage in part.items():
                after[role] = after.get(role, Usage()) + usage
        return budget.over(after)

    def affordable_steps(self, budget: Budget) -> int | None:
        """The most of the plan's steps that ``budget`` pays for after the seed, with the ending (a bisection:
        a step never costs less than nothing); None when it cannot pay for the seed and the ending."""
        seed = self.phases.get("seed", {})
        if self.affords(budget, seed, 0):
            return None
        low, high = 0, self.steps  # low is affordable
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if not self.affords(budget, seed, middle) else (low, middle - 1)
        return low

    def rows(self) -> list[dict]:
        """One row per phase and role, and the totals, for a table."""
        rows = []
        for phase in PHASES:
            times = self.steps if phase == "steps" else 1
            for role in ROLES:
                usage = self.phases.get(phase, {}).get(role, Usage())
                if usage.calls:
                    label = f"{self.steps} step{'s' if self.steps != 1 else ''}" if phase == "steps" else phase
                    rows.append({"phase": label, "role": role,
                                 "calls": usage.calls * times, "prompt_tokens": usage.prompt_tokens * times,
                                 "completion_tokens (at most)": usage.completion_tokens * times})
        for role, usage in self.total().items():
            rows.append({"phase": "total", "role": role, "calls": usage.calls, "prompt_tokens": usage.prompt_tokens,
                         "completion_tokens (at most)": usage.completion_tokens})
        return rows

    def as_dict(self) -> dict:
        return {"steps": self.steps, "work_tokens": dict(self.work),
                "phases": {p: {r: u.as_dict() for r, u in per.items()} for p, per in self.phases.items()},
                "total": {r: u.as_dict() for r, u in self.total().items()}}


class CountingModel:
    """A stand-in for a label scorer (a ``pipelines.engine.scorer.Scorer``) that answers at once and counts what the real model would be asked,
    with the real scorers' caches: (template, input) for log-probs, (template, input, limit) for answers.
    ``served``: a server or a local model; ``labels_with_answers``: an answer's pass also gives the label
    log-probs (a local float32 model; default: when not served)."""

    def __init__(self, verbalizers: Sequence[str], tokenizer, *, chat_template: bool, served: bool,
                 labels_with_answers: bool | None = None):
        self.verbalizers = list(verbalizers)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.served = served
        self.labels_with_answers = not served if labels_with_answers is None else labels_with_answers
        # tokens a local model computes: the template's prefix once per call, each new pair's own tokens (its
        # input and what follows it), each answer's new tokens; what a local run's time follows
        self.work = 0
        self.usage = Usage()
        self._scored: set[tuple[str, str]] = set()
        self._answered: set[tuple] = set()
        self._frames: dict[str, tuple[int, int]] = {}

    def _prompt_tokens(self, template, text: str) -> int:
        before, after = self._frame(template)
        return before + after + len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _frame(self, template) -> tuple[int, int]:
        if template.text not in self._frames:
            from pipelines.engine.target import prompt_frame

            before, after = prompt_frame(self.tokenizer, template, self.chat_template)
            count = lambda s: len(self.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
            self._frames[template.text] = (count(before), count(after))
        return self._frames[template.text]

    def _worked(self, template, prompt_tokens: list[int], new_tokens: int = 0) -> None:
        if prompt_tokens:
            prefix = self._frame(template)[0]
            self.work += prefix + sum(n - prefix for n in prompt_tokens) + new_tokens

    def _row(self, text: str) -> np.ndarray:
        """Made-up but fixed log-probs (the scoring code's arithmetic needs numbers, not these ones)."""
        value = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32
        raw = np.log(np.array([value + 0.1] + [1.1 - value] * (len(self.verbalizers) - 1)))
        return (raw - np.logaddexp.reduce(raw)).astype(np.float32)

    def score(self, template: Template, texts: Sequence[str]) -> np.ndarray:
        ran = []
        for text in dict.fromkeys(texts):
            if (template.text, text) not in self._scored:
                self._scored.add((template.text, text))
                ran.append(self._prompt_tokens(template, text))
                self.usage.add(1, ran[-1], 1 if self.served else 0)
        self._worked(template, ran)
        return np.stack([self._row(text) for text in texts]) if texts else np.zeros((0, len(self.verbalizers)))

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int,
               complete: Callable[[str], bool] | None = None) -> list[Answer]:
        key = (template.text, max_new_tokens) if self.served else (template.text, max_new_tokens, complete is not None)
        ran = []
        for text in dict.fromkeys(texts):
            if (*key, text) not in self._answered:
                self._answered.add((*key, text))
                ran.append(self._prompt_tokens(template, text))
                self.usage.add(1, ran[-1], max_new_tokens)
                if self.labels_with_answers:  # the answer's first pass read the labels too
                    self._scored.add((template.text, text))
        self._worked(template, ran, len(ran) * max_new_tokens)
        # an answer of its own per template: the judge grades (input, answer) pairs, and a repeated pair is free
        word = f"{self.verbalizers[0]} {hashlib.sha256(template.text.encode()).hexdigest()[:8]}"
        return [Answer(word, False, max_new_tokens) for _ in texts]

    def request_latency_ms(self, template: Template, texts: Sequence[str], n: int = 12) -> dict[str, float]:
        for text in list(texts)[:n]:
            self.usage.add(1, self._prompt_tokens(template, text), 1 if self.served else 0)
            self.work += self._prompt_tokens(template, text)  # one request at a time, the whole prompt
        return {"p50": 0.0, "p95": 0.0, "error_rate": 0.0}


def synthetic_instructions(task: TaskConfig, tokenizer, n: int, offset: int = 0) -> list[str]:
    """``n`` distinct instructions as long as the policy may write (``max_instruction_tokens``), each a valid
    candidate: what the estimate prices a step's candidates as."""
    words = "Check the message for prizes, urgent payment requests, unknown links and premium numbers".split()
    out = []
    for i in range(offset, offset + n):
        text = f"Rule {i}:"
        for word in words * 8:
            longer = f"{text} {word}"
            if len(tokenizer(longer, add_special_tokens=False).input_ids) > task.template.max_instruction_tokens:
                break
            text = longer
        out.append(text)
    return out


def scoring_tokenizer(source: ModelSource):
    """The tokenizer that prices a model's prompts: its own for a local model; the embedded model's for a server
    (which owns its tokenizer; the scorer counts template tokens with the same one)."""
    from pipelines.engine.models import load_tokenizer

    return load_tokenizer(None if isinstance(source, Endpoint) else source)


def counting_models(task: TaskConfig, tokenizer, target: ModelSource, judge: ModelSource | None):
    """The stand-ins for the run's target and judge, served or local as the run's are; ``tokenizer`` is the
    target's (a separate judge's own is loaded here)."""
    from pipelines.scoring import scorer_words
    from rewards.judge import JUDGE_VERBALIZERS

    from pipelines.engine.models import default_dtype, load_config
    from pipelines.engine.target import answers_give_label_rows

    served = isinstance(target, Endpoint)
    labels_with_answers = not isinstance(target, Endpoint) and answers_give_label_rows(load_config(target),
                                                                                       default_dtype())
    target_model = CountingModel(scorer_words(task), tokenizer, chat_template=task.template.chat_template, served=served,
                                 labels_with_answers=labels_with_answers)
    judge_served = isinstance(judge, Endpoint) if judge is not None else served
    judge_tokenizer = tokenizer if judge is None or judge == target else scoring_tokenizer(judge)
    judge_model = CountingModel(list(JUDGE_VERBALIZERS), judge_tokenizer, chat_template=True, served=judge_served)
    return target_model, judge_model


def estimate(task: TaskConfig, options: RunOptions, splits: Splits, tokenizer) -> Plan:
    """The calls and tokens ``tune(task, options)`` will ask of its models, phase by phase (see the module doc)."""
    from pipelines.racing import race_candidates
    from pipelines.scoring import CandidateScorer

    target, judge = counting_models(task, tokenizer, options.target, options.judge)
    scorer = CandidateScorer(task, splits, target, judge, tokenizer, reward_examples=options.dev_examples)
    k = task.generation.candidates_per_step
    plan = Plan(steps=options.steps)

    def priced(run, phase: str) -> dict[str, Usage]:
        before, worked = scorer.spent(), target.work + judge.work
        run()
        plan.work[phase] = target.work + judge.work - worked
        return scorer.spent_since(before)

    seed = task.seed_template().text
    screens_sample = task.scoring.racing.screens_sample
    plan.phases["seed"] = priced(lambda: scorer.measure([seed], screen=screens_sample), "seed")
    step = priced(lambda: race_candidates(task, scorer, [task.compose(t) for t in synthetic_instructions(task, tokenizer, k)]),
                  "steps")
    step["policy"] = Usage(k, k * _longest_meta_prompt(task, tokenizer), k * task.template.max_instruction_tokens)
    plan.phases["steps"] = step
    # the choice: the seed and the shortlist evaluated on the whole dev split as the test will be (latency too),
    # priced on a fresh scorer: the steps read train examples, and a finalist may be evaluated on a worker whose
    # cache never saw it (a race's second rung is balanced across the workers), so it may pay again for its
    # calibration and robustness samples (an upper bound); the seed's runs on the worker that has seen nothing
    shortlist_size = min(options.finalists or task.selection.shortlist, options.steps * k)
    shortlist = [task.compose(t) for t in synthetic_instructions(task, tokenizer, shortlist_size, offset=k)]
    fresh = counting_models(task, tokenizer, options.target, options.judge)
    chooser = CandidateScorer(task, splits, *fresh, tokenizer, reward_examples=options.dev_examples)
    on_dev = {text: chooser.evaluate(text, "dev", latency=True) for text in [seed] + shortlist}
    plan.phases["select"] = chooser.spent()
    plan.work["select"] = sum(model.work for model in fresh)
    finalists = shortlist[:1]  # at most one candidate is tested

    # the test: the pool tests templates side by side (ScoringPool._assign), each with its production decision
    # and robustness taken from its dev evaluation (the loop passes them); the chosen candidate may go to a worker
    # whose cache has never seen it, so it is priced on a fresh scorer
    seed_test = priced(lambda: scorer.evaluate(seed, "test", latency=True, fitted=on_dev[seed]), "test")
    fresh = counting_models(task, tokenizer, options.target, options.judge)
    tester = CandidateScorer(task, splits, *fresh, tokenizer, reward_examples=options.dev_examples)
    for text in finalists:
        tester.evaluate(text, "test", latency=True, fitted=on_dev[text])
    plan.chosen_test = tester.spent()
    plan.phases["test"] = {role: seed_test.get(role, Usage()) + usage for role, usage in tester.spent().items()}
    plan.work["test"] += sum(model.work for model in fresh)
    return plan


def _longest_meta_prompt(task: TaskConfig, tokenizer) -> int:
    """Tokens of the longest prompt the policy can read: the longest instruction it may write, and the two
    weaknesses whose words are longest (the meta-prompt names the two weakest components)."""
    from itertools import combinations

    from pipelines.generation import meta_prompt

    (instruction,) = synthetic_instructions(task, tokenizer, 1)
    weighted = [name for name, weight in task.reward.weights.items() if weight > 0]
    longest = 0
    for pair in combinations(weighted, min(2, len(weighted))) if weighted else [()]:
        scores = {name: (-1.0 if name in pair else 1.0) for name in weighted}  # the pair loses most
        scores.update({name: (1.0 if name in pair else 0.0) for name in ("length", "threshold_shortfall") if name in scores})
        prompt = meta_prompt(task, instruction, scores)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        longest = max(longest, len(ids))
    return longest


def check_affordable(plan: Plan, budget: Budget) -> None:
    """Raise ``BudgetError`` when the budget cannot pay for the seed and the run's ending (zero steps)."""
    if not budget:
        return
    smallest = {role: plan.phases.get("seed", {}).get(role, Usage()) + plan.ending().get(role, Usage()) for role in ROLES}
    why = budget.over(smallest)
    if why:
        need_calls = smallest["target"].calls
        need_tokens = smallest["target"].tokens + smallest["judge"].tokens
        raise BudgetError(
            f"the budget cannot pay for measuring the seed and the final test ({why}): those take about "
            f"{need_calls} target calls and {need_tokens} tokens; raise the budget, or lower --dev-examples "
            "or the task's test split"
        )


# --- wall time of a local run --------------------------------------------------------------------------------
# A local run's time follows the tokens its models compute (``CountingModel.work``: a template's prefix once per
# call, each pair's own tokens, each answer's new tokens), not the calls: the default risk run's phases (steps,
# selection, test) each ran at the same rate of computed tokens per second, and so does a task of 1,000-character
# inputs, whose pairs are 5 times as long (docs/endpoints.md, "The cost model"). Measured on 2 quiet cores (AVX-512 BF16,
# bfloat16): the policy (sampling and the PPO update on the driver's 2 threads) took 0.86 s per candidate since the
# group's prompt runs once (dfa6a60: 10.3 s sampling and 10.3 s updating 24; it was 2.7 s) while one scoring worker,
# timed by ``calibrate``, computed REFERENCE_TOKENS_PER_S; start-up (imports, Ray, models) about 20 s.
REFERENCE_TOKENS_PER_S = 1180.0  # one worker, the machine above (risk; 970 on 1,000-character inputs)
REFERENCE_POLICY_S = 0.86  # per candidate and step, the machine above (the last step, which defers its update, less)
REFERENCE_SAMPLING_S = 0.43  # of which sampling: all a step's policy does with ppo.update none (best-of-N)
STARTUP_S = 20.0


@dataclass(frozen=True)
class Timing:
    """How fast this machine runs a local run: the tokens one scoring worker computes per second
    (``calibrate``), the workers that run side by side, and the policy's seconds per candidate (scaled from the
    reference machine by the scoring rate)."""

    tokens_per_s: float
    workers: int
    policy_s_per_candidate: float

    @classmethod
    def scaled(cls, tokens_per_s: float, workers: int, update: str = "ppo") -> "Timing":
        """``update``: the task's ppo.update; with none the policy only samples."""
        reference = REFERENCE_SAMPLING_S if update == "none" else REFERENCE_POLICY_S
        return cls(tokens_per_s, workers, reference * REFERENCE_TOKENS_PER_S / tokens_per_s)


def local_seconds(plan: Plan, timing: Timing, candidates: int) -> dict[str, float]:
    """The run's wall time per phase: a phase's computed tokens (``plan.work``) at the pool's rate (the seed's at
    one worker's: nothing else runs then), each step's policy at its rate per candidate, and the start-up."""
    pool = timing.tokens_per_s * timing.workers
    work = plan.work
    out = {"startup": STARTUP_S, "seed": work.get("seed", 0) / timing.tokens_per_s,
           "steps": plan.steps * (work.get("steps", 0) / pool + candidates * timing.policy_s_per_candidate),
           "select": work.get("select", 0) / pool, "test": work.get("test", 0) / pool}
    out["total"] = sum(out.values())
    return out


def calibrate(task: TaskConfig, splits: Splits, target: ModelSource, examples: int = 24) -> float:
    """Tokens one scoring worker computes per second on this machine: the seed measured on ``examples`` dev
    examples by the run's own scorer with one thread, as a Ray worker runs it (a few seconds, after loading),
    its work counted by the same stand-ins that price the run."""
    import time

    import torch

    from pipelines.scoring import CandidateScorer, build_scorer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scorer = build_scorer(task, splits, target, reward_examples=examples)
        seed = task.seed_template()
        scorer.label_logprobs(seed, list(splits.train)[:2])  # warm-up: the first pass sets up kernels
        started = time.perf_counter()
        scorer.measure([seed.text])
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    tokenizer = scorer.tokenizer
    models = counting_models(task, tokenizer, target, None)
    CandidateScorer(task, splits, *models, tokenizer, reward_examples=examples).measure([seed.text])
    return sum(model.work for model in models) / seconds
