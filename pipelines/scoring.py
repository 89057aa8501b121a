"""Scoring candidate templates: validity, the target model's metric, robustness, the judge, length, latency.

``build_scorer`` is the one way a ``CandidateScorer`` is made: by the Ray scoring workers
(``pipelines/ray_scoring.py``), the OpenRLHF reward file (``rewards/openrlhf_reward.py``) and the CLI
(``eval``, ``check``). It loads or reaches the target and judge models (local models, or OpenAI-compatible
endpoints) and binds the task's reward components once.

Every candidate is measured on the target's *responses*, as production would receive them:

* the greedy answers (``OutputContract``: ``instruction_following`` is the share that keep the contract);
* the decision of the task (``scoring.decision``: the label log-probs with a fitted threshold or per-label
  offsets, or the parsed answer), and whether it survives swapping the input's entities (``entity_consistency``);
* the judge's grades of a few (input, response) pairs, and of the template's text for template rubrics;
* the reward metric and PromptBench robustness (label log-odds ROC-AUC on a dev sample, one-vs-rest for more
  than two labels).

A generation task (``output:`` in the task file) has no labels: its decision is the parsed answer, its metrics
compare it with each example's reference (``rewards.generation_metrics``), entity consistency asks that every
value it gives is in its input, and robustness compares the reward metric of the answers.

Two modes:
* ``measure`` (the tuning loop): the dev sample; under a calibrated decision the rates use a threshold fitted
  on the same dev log-odds (no calibration pass), and the reward metric is their ROC-AUC; under an answer
  decision the reward metric is the production metric of the parsed answers.
* ``evaluate`` (``tune-prompts eval``, final tables, the promotion gate): any split, the production decision
  (``fit_decision``: a threshold fitted on train examples, argmax, or the parsed answer), every metric and rate,
  per-request latency and render time. ``TemplateReader.predict`` applies the same decision at serving time.

The module is long because ``CandidateScorer`` is one measurement: every figure a template gets on a split,
under one decision, counted against one usage meter; its pieces are methods in the order ``measure`` calls them.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipelines.config import Endpoint, ModelSource, TaskConfig
from pipelines.data import Example, Splits
from pipelines.engine.models import LoadedLM, load_causal_lm, load_tokenizer
from pipelines.engine.scorer import Scorer
from pipelines.engine.usage import Metered, Usage, sum_usage
from rewards import generation_metrics as gm
from rewards import promptbench_metrics as pbm
from rewards.components import Measured
from rewards.entities import swap_entities
from rewards.judge import JUDGE_VERBALIZERS, RESPONSE_FRAME, Judge, response_item
from rewards.weighting import Reward, weigh
from templates.contract import OutputContract, Parsed
from templates.decision import DecisionRule
from templates.template import Template, validate_candidate


@dataclass(frozen=True)
class Scored:
    """One candidate measured on the dev split, and its reward."""

    measured: Measured
    reward: Reward
    usage: dict[str, Usage] = field(default_factory=dict)  # role -> what measuring it asked of that model
    screen: Reward | None = None  # a race's finisher: its reward on the screening rung, which every sample has

    @property
    def target_calls(self) -> int:
        """Calls the target answered for this candidate (pipelines/engine/usage.py); cached pairs are free."""
        return self.usage["target"].calls if "target" in self.usage else 0


@dataclass
class Evaluation:
    """Everything ``evaluate`` measured for one template on one split."""

    measured: Measured
    reward: Reward
    split: str
    n_examples: int
    decision: DecisionRule | None  # the production decision the metrics were computed with (None: invalid)
    latency: Latency | None = None  # measured for valid templates unless asked not to
    usage: dict[str, Usage] = field(default_factory=dict)  # role -> calls and tokens, latency probes included

    def as_record(self) -> dict[str, Any]:
        """This evaluation as a JSON-ready record: the one form every report reads it in (eval's report.json, which
        adds the task and the reward's weights; a run's final table, which is also W&B's leaderboard; the choice's
        table) and the store's records are made from (``pipelines.promotion.record``)."""
        m, lat = self.measured, self.latency
        return {
            "template": m.template,
            "split": self.split,
            "examples": self.n_examples,
            "valid": m.valid,
            "invalid_reasons": list(m.reasons),
            "reward": {"total": self.reward.total, "components": dict(self.reward.components)},
            "metrics": dict(m.metrics),
            "decision": self.decision.to_dict() if self.decision else None,
            "decision_threshold": self.decision.threshold if self.decision else None,
            "pdr": dict(m.pdr),
            "judge": dict(m.judge),
            "rates": {name: {"kept": kept, "of": total, "rate": kept / total if total else None}
                      for name, (kept, total) in m.rates.items()},
            "samples": [dict(sample) for sample in m.samples],
            "template_tokens": m.tokens,
            "latency_ms": {"p50": lat.p50_ms, "p95": lat.p95_ms} if lat else {},
            "request_error_rate": lat.error_rate if lat else None,
            "render_us_p99": lat.render_us_p99 if lat else None,
            "timing_s": {k: round(v, 3) for k, v in m.timing.items()},
        }


@dataclass(frozen=True)
class Latency:
    """What a service sees of one template: requests one at a time, no cache (failed ones are left out of the
    percentiles and counted in ``error_rate``), and the time to render it."""

    p50_ms: float
    p95_ms: float
    error_rate: float
    render_us_p99: float
    # each request's time in order (NaN: failed); templates timed together answered the same inputs in the same
    # order, so request i of one pairs with request i of the other (the choice's latency bound, pipelines/choice.py)
    samples_ms: tuple[float, ...] = ()


def _reward_chance(task: TaskConfig) -> float:
    if task.is_generation:
        return 0.0  # an answer that matches nothing
    return 0.5 if task.scoring.reward_metric == "roc_auc" else 1.0 / len(task.labels)


def scorer_words(task: TaskConfig) -> list[str]:
    """The words the target's scorer reads log-probs for: the labels' answer words; a generation task's target is
    only asked for answers, so its scorer reads the judge's yes/no (and shares the judge's scorer and cache)."""
    return task.verbalizers if not task.is_generation else list(JUDGE_VERBALIZERS)


def output_contract(task: TaskConfig) -> OutputContract:
    """The contract the target's answers are held to: the task's own (generation) or its label words."""
    return task.output.output_contract() if task.is_generation else task_contract(task)


def answer_tokens(task: TaskConfig) -> int:
    return task.output.max_new_tokens if task.is_generation else task.scoring.answer.max_new_tokens


def task_contract(task: TaskConfig) -> OutputContract:
    """The output contract of a classification task's answers: one of the label words, by the task's rule."""
    return OutputContract("labels", labels=tuple(task.labels), words=tuple(task.verbalizers),
                          rule=task.scoring.answer.rule)


@dataclass
class Responses:
    """One template's outputs on some examples: the label log-probs, and (when asked for) the greedy answers and
    their parses under the contract."""

    logprobs: np.ndarray
    answers: list | None = None  # pipelines.engine.answers.Answer
    parsed: list[Parsed] | None = None

    def kept(self) -> tuple[int, int]:
        """(answers that keep the contract, answers)."""
        return sum(p.ok for p in self.parsed), len(self.parsed)


def build_scorer(task: TaskConfig, splits: Splits, target: ModelSource | LoadedLM,
                 judge: ModelSource | LoadedLM | None = None, *, reward_examples: int | None = None,
                 bad_responses: str = "raise") -> "CandidateScorer":
    """A ``CandidateScorer`` for ``task``: the one place that turns model sources into label scorers.

    ``target`` and ``judge``: a model id or folder (or ``EMBEDDED``), loaded here; a model already loaded; or an
    ``Endpoint``, checked with ``GET /models`` before anything is scored. ``judge=None`` means the target model
    judges; when its answer words are the judge's (yes/no), both share one scorer and its pair cache.
    ``reward_examples``: how many dev examples (the first ones) ``measure`` scores; None: all of them.
    ``bad_responses``: what a served model's response that breaks the API's contract does: ``"raise"`` (eval,
    check: the command stops, exit 2) or ``"count"`` (the tuning loop: it counts as an answer naming no label).
    """
    target_model = load_source(target)
    batch = task.scoring.batch_size
    target_scorer = label_scorer(target_model, scorer_words(task), chat_template=task.template.chat_template,
                                 batch_size=batch, bad_responses=bad_responses)
    judge_model = target_model if judge is None or judge == target else load_source(judge)
    if judge_model is target_model and scorer_words(task) == list(JUDGE_VERBALIZERS):
        judge_scorer = target_scorer
    else:
        judge_scorer = label_scorer(judge_model, list(JUDGE_VERBALIZERS), chat_template=True, batch_size=batch,
                                    bad_responses=bad_responses)
    # A server owns an endpoint's model: template tokens are counted with the embedded model's tokenizer.
    tokenizer = target_model.tokenizer if isinstance(target_model, LoadedLM) else load_tokenizer()
    return CandidateScorer(task, splits, target_scorer, judge_scorer, tokenizer, reward_examples=reward_examples,
                           reader=reader_for(task, target_model))


def reader_for(task: TaskConfig, target: LoadedLM | Endpoint):
    """The instruction's readability (``rewards.readability``), read by the embedded model its floor was calibrated
    with: the target itself when it is that model, else a copy of its own."""
    from pipelines.engine.models import EMBEDDED
    from rewards.readability import ReadabilityScorer

    lm = target if isinstance(target, LoadedLM) and target.name == EMBEDDED else load_causal_lm(EMBEDDED)
    scorer = ReadabilityScorer(lm)
    return lambda instructions: scorer.score(instructions, task.description)


def load_source(source: ModelSource | LoadedLM) -> LoadedLM | Endpoint:
    """A model name loaded (once: share the result between scorers), an endpoint or a loaded model as it is."""
    return load_causal_lm(source) if isinstance(source, str) else source


def check_endpoint(source: Endpoint) -> list[str]:
    """``check_served_model`` for a served target or judge: its server answers ``GET /models`` and serves its
    model, within the endpoint's own timeout. The served model ids."""
    from pipelines.engine.endpoints import check_served_model

    return check_served_model(source.url, source.model, api_key_env=source.api_key_env,
                              timeout_s=min(source.timeout_s, source.deadline_s))


def label_scorer(source: ModelSource | LoadedLM, verbalizers: Sequence[str], *, chat_template: bool, batch_size: int = 64,
                 bad_responses: str = "raise") -> Scorer:
    """A label scorer answering with ``verbalizers``: in-process for a model (loaded here if it is a name), or
    through an OpenAI-compatible server for an ``Endpoint`` (checked with ``GET /models`` first; ``bad_responses``
    as ``build_scorer`` takes it)."""
    from pipelines.engine.endpoints import make_label_scorer

    model = load_source(source)
    if isinstance(model, Endpoint):
        check_endpoint(model)  # the server answers and serves the model, before any work starts
        return make_label_scorer(model.url, verbalizers, model=model.model, chat_template=chat_template,
                                 api_key_env=model.api_key_env, max_concurrency=model.max_concurrency,
                                 timeout_s=model.timeout_s, max_retries=model.max_retries,
                                 top_logprobs=model.top_logprobs, deadline_s=model.deadline_s,
                                 max_retry_after_s=model.max_retry_after_s,
                                 breaker_failures=model.breaker_failures, bad_responses=bad_responses)
    return make_label_scorer(model, list(verbalizers), chat_template=chat_template, batch_size=batch_size)


def stratified_order(examples: Sequence[Example]) -> list[Example]:
    """``examples`` reordered so that each label's examples are spread evenly (the i-th of a label's n sits at
    (i + 0.5) / n of the way): any prefix holds every label in about its share. Within a label the order is kept."""
    seen: dict[str, int] = {}
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.label] = counts.get(e.label, 0) + 1
    keyed = []
    for j, e in enumerate(examples):
        i = seen.get(e.label, 0)
        seen[e.label] = i + 1
        keyed.append(((i + 0.5) / counts[e.label], j, e))
    return [e for _, _, e in sorted(keyed, key=lambda k: k[:2])]


def _shown(value):
    """A parsed value as a reviewer's table shows it: JSON text for objects and lists."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else value


class CandidateScorer:
    def __init__(self, task: TaskConfig, splits: Splits, target: Scorer, judge: Scorer, tokenizer, *,
                 reward_examples: int | None = None, reader=None):
        """``target`` and ``judge``: label scorers (``pipelines.engine.scorer.Scorer``); the target answers with the
        task's verbalizers in label order, the judge with ``JUDGE_VERBALIZERS``. ``build_scorer`` makes them. ``reader``: instructions -> readability
        (``reader_for``); None: readability is not read (the budget's counting stand-ins)."""
        for scorer, words, role in ((target, scorer_words(task), "target"), (judge, list(JUDGE_VERBALIZERS), "judge")):
            if list(getattr(scorer, "verbalizers", ())) != words:
                raise ValueError(f"the {role} scorer answers {list(getattr(scorer, 'verbalizers', ()))}; it must answer {words}")
        self.components = task.components()  # the weights were checked against them at task load
        self.task = task
        self.splits = splits
        self.labels = list(task.labels)
        # Each role counts its own calls, also when the target judges with the same scorer (and cache).
        self.target = Metered(target)
        self.judge_scorer = Metered(judge)
        # A judge server that stops answering ends the run like the target's would (resumably), not as missing grades
        from pipelines.engine.endpoints import EndpointError

        self.judge = Judge(task.judge.rubrics, self.judge_scorer.score, task.judge.max_errors, frame=RESPONSE_FRAME,
                           fatal=(EndpointError,))
        self.template_judge = Judge(task.judge.template_rubrics, self.judge_scorer.score, task.judge.max_errors,
                                    fatal=(EndpointError,))
        self.reader = reader
        self.contract = output_contract(task)
        self.max_new_tokens = answer_tokens(task)
        self.tokenizer = tokenizer
        cfg = task.scoring
        # The search sample (``dev`` below, from the split ``scoring.search_split`` names) in an order whose every
        # prefix holds the labels in their proportions: a race's first rung reads a prefix (pipelines/racing.py),
        # and so does robustness (inside the first rung: cached).
        # Cost follows tokens: the sample stops at ``scoring.dev_tokens`` input tokens (at least ``min_dev_examples``),
        # so a task of long inputs reads fewer of them per reward; the selection sample at twice that.
        dev = list(splits.train if cfg.search_split == "train" else splits.dev)
        sample = stratified_order(dev[:reward_examples] if reward_examples else dev)
        self.dev = sample[: self._within_tokens(sample, cfg.dev_tokens, cfg.min_dev_examples)]
        taken = {id(e) for e in self.dev}
        rest = [e for e in dev if id(e) not in taken]
        selection = self.dev + stratified_order(rest)
        self.selection = selection[: self._within_tokens(selection, cfg.dev_tokens and 2 * cfg.dev_tokens, len(self.dev))]
        self.sample_size = len(self.dev)  # dev examples in a step's reward
        # A race's first rung (pipelines/racing.py): the first examples of the sample, sized in tokens too; no
        # racing (0, or a slice not smaller than the sample) stays so.
        racing = cfg.racing
        rung = self.dev[: racing.first_examples]
        self.first_rung = racing.first_examples if racing.first_examples >= len(self.dev) else \
            self._within_tokens(rung, racing.first_tokens, min(12, len(rung)))
        # The auxiliary measurements cost what their inputs hold, so they are sized in tokens too: the robustness
        # sample (each PromptBench variant scores it again; never past the first rung, whose scores are cached)
        # and the inputs whose entities are swapped (``entity_consistency``).
        robust = self.dev[: min(cfg.robustness_examples, self.first_rung or cfg.robustness_examples)]
        self.robust_sample = robust[: self._within_tokens(robust, cfg.robustness_tokens, min(10, len(robust)))]
        self.calibration = list(splits.train)[: cfg.calibration_examples]
        self._seed_prompt: float | None = None  # the seed template's mean prompt tokens (prompt_ratio)

    # --- pieces --------------------------------------------------------------------------------
    def _within_tokens(self, examples: Sequence[Example], budget: int | None, floor: int) -> int:
        """How many of ``examples`` (from the first) fit in ``budget`` input tokens; at least ``floor``."""
        if budget is None:
            return len(examples)
        total = 0
        for n, e in enumerate(examples):
            total += self.count_tokens(e.text)
            if total > budget:
                return max(n, min(floor, len(examples)))
        return len(examples)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def readability(self, texts: Sequence[str]) -> list[float | None]:
        """The readability of each template's instruction (its whole text, placeholders out, when it was not built
        from the task's skeleton); None for each without a reader."""
        if self.reader is None or not texts:
            return [None] * len(texts)
        from pipelines.generation import instruction_of

        instructions = [instruction_of(self.task, t) or " ".join(t.replace("{", " ").replace("}", " ").split())
                        for t in texts]
        return [float(r) for r in self.reader(instructions)]

    def prompt_ratio(self, template: Template) -> float:
        """``Measured.prompt_ratio``: the mean tokens of the template's prompts over the seed template's, on the dev
        sample. A request's time grows with its prompt, so this predicts the latency bar before anything is timed
        (a request's fixed cost makes the real ratio smaller: an upper estimate). The chat template's frame counts
        where the target is a local model; a server's is unknown and left out, which only raises the ratio."""
        if self._seed_prompt is None:
            self._seed_prompt = self._prompt_tokens(self.task.seed_template())
        return self._prompt_tokens(template) / max(1.0, self._seed_prompt)

    def _prompt_tokens(self, template: Template) -> float:
        frame, texts = self._inputs(template, self.dev)
        lm, chat = getattr(self.target, "lm", None), getattr(self.target, "chat_template", None)
        if lm is not None and chat is not None:
            from pipelines.engine.target import prompt_frame

            before, after = prompt_frame(lm.tokenizer, frame, chat)
            fixed = self.count_tokens(before) + self.count_tokens(after)
        else:
            fixed = self.count_tokens(frame.text)
        return fixed + sum(map(self.count_tokens, texts)) / max(1, len(texts))

    def validate(self, text: str):
        return validate_candidate(text, self.task.input_variables, self.task.template.max_tokens, self.count_tokens)

    def label_logprobs(self, template: Template, examples: Sequence[Example]) -> np.ndarray:
        """The label log-probs per example (one column per label, normalised over the labels), in float64 as
        ``DecisionRule.decide`` reads them at serving time: both paths compare the same numbers."""
        return np.asarray(self.target.score(*self._inputs(template, examples)), dtype=np.float64)

    @staticmethod
    def _inputs(template: Template, examples: Sequence[Example]) -> tuple[Template, list[str]]:
        """What the scorers get: the template and each example's text; with several inputs, the template's frame
        and each example's values rendered into its span (``Template.input_frame``; the values were checked
        against the constraints when the data was read; an entity-swapped variant is a span already)."""
        frame, span = template.input_frame()
        if frame is template:
            return template, [e.text for e in examples]
        bare = Template(span.text, span.variables)
        return frame, [e.text if e.values is None else bare.render(e.values) for e in examples]

    def _reward_metric(self, logprobs: np.ndarray, examples: Sequence[Example]) -> float:
        """ROC-AUC of the label log-odds (macro one-vs-rest over three or more labels)."""
        return pbm.roc_auc_ovr(logprobs, [e.label for e in examples], self.labels)

    def responses(self, template: Template, examples: Sequence[Example], *, answers: bool = True) -> Responses:
        """The target's label log-probs for ``examples`` and, with ``answers``, its greedy answers and their
        parses (the answers' first pass computes the log-probs too, so asking for both costs one pass more)."""
        template, texts = self._inputs(template, examples)
        if not answers:
            return Responses(self.target.score(template, texts))
        got = self.target.answer(template, texts, self.max_new_tokens, self.contract.complete)
        parsed = [self.contract.parse(a.text, truncated=a.truncated) for a in got]
        if self.task.is_generation:  # no labels to read log-probs for
            return Responses(None, got, parsed)
        return Responses(self.target.score(template, texts), got, parsed)

    def production_metrics(self, examples: Sequence[Example], out: Responses, decided) -> dict[str, float]:
        """The task's metrics of what an application receives: labels against gold (and the label log-probs'
        ROC-AUC), or a generation task's parsed answers against the references."""
        if self.task.is_generation:
            return gm.generation_metrics(out.parsed, [e.reference for e in examples])
        return pbm.classification_metrics(decided, [e.label for e in examples], self.labels, out.logprobs)

    def decide(self, rule: DecisionRule, responses: Responses) -> list[str | None]:
        """What an application receives for each example under ``rule`` (None: the answer broke the contract)."""
        if rule.kind == "answer":
            return [p.value if p.ok else None for p in responses.parsed]
        return [rule.decide(row) for row in responses.logprobs]

    def consistency(self, template: Template, examples: Sequence[Example], rule: DecisionRule, out: Responses,
                    decided: Sequence) -> tuple[int, int]:
        """(kept, of) for ``entity_consistency``: a classification task's decision survives swapped entities; a
        generation task's answer gives only values found in its input (``rewards.generation_metrics.supported``)."""
        if self.task.is_generation:
            schema = self.contract.schema
            return sum(gm.supported(p, e.text, schema) for p, e in zip(out.parsed, examples)), len(examples)
        return self.entity_consistency(template, examples, rule, decided)

    def entity_consistency(self, template: Template, examples: Sequence[Example], rule: DecisionRule,
                           decided: Sequence[str | None]) -> tuple[int, int]:
        """(kept, inputs checked): the decision on an input whose entities (phone numbers, amounts, URLs, dates,
        numbers) were swapped for others of the same type equals the original decision. The inputs checked are the
        first with entities whose original texts together fit ``scoring.entity_tokens`` (a sample of a long split;
        ``of`` says how many). An input whose answer broke the contract keeps nothing."""
        swapped = [(i, swap_entities(e.text, self.task.split.seed)) for i, e in enumerate(examples)]
        swapped = [(i, text) for i, text in swapped if text is not None]
        # the first of them within ``scoring.entity_tokens`` of input (at least 24): each is scored again
        swapped = swapped[: self._within_tokens([examples[i] for i, _ in swapped], self.task.scoring.entity_tokens, 24)]
        if not swapped:
            return 0, 0
        variants = [Example(text, examples[i].label) for i, text in swapped]
        again = self.decide(rule, self.responses(template, variants, answers=rule.kind == "answer"))
        return sum(decided[i] is not None and decided[i] == label for (i, _), label in zip(swapped, again)), len(swapped)

    def judge_responses(self, examples: Sequence[Example], responses: Responses) -> dict[str, float | None]:
        """The judge's mean P(yes) per response rubric over the first ``scoring.judge_examples`` (input, answer)
        pairs (None where it failed on every pair)."""
        if not self.task.judge.rubrics:
            return {}
        k = self.task.scoring.judge_examples
        items = [response_item(self.task.description, e.text, a.text) for e, a in zip(examples[:k], responses.answers[:k])]
        graded = self.judge(items)
        out = {}
        for rubric in self.task.judge.rubrics:
            values = [row[rubric] for row in graded if row.get(rubric) is not None]
            out[rubric] = float(np.mean(values)) if values else None
        return out

    def samples(self, examples: Sequence[Example], responses: Responses, decided, n: int = 4) -> tuple[dict, ...]:
        """A few rows a reviewer reads: the input, what the model said, what the contract made of it."""
        return tuple(
            {"input": e.text[:300], "answer": a.text, "parsed": _shown(p.value) if p.ok else p.reason,
             "contract_kept": p.ok, "decision": _shown(d), "label": _shown(e.reference) if self.task.is_generation else e.label}
            for e, a, p, d in list(zip(examples, responses.answers, responses.parsed, decided))[:n]
        )

    def outcomes(self, examples: Sequence[Example], responses: Responses, decided) -> dict[str, list]:
        """Per example, what the gate's metric is made of: gold and decided labels (classification; with the label
        log-probs when the metric is ROC-AUC), or each answer's score on the metric (generation)."""
        metric = self.task.scoring.metric
        if self.task.is_generation:
            if metric == "contract_rate":
                return {"scores": [float(p.ok) for p in responses.parsed]}
            column = 0 if metric == "field_exact_match" else 1
            return {"scores": [gm.example_scores(p, e.reference)[column] for p, e in zip(responses.parsed, examples)]}
        out = {"gold": [e.label for e in examples], "decided": list(decided)}
        if metric == "roc_auc":
            out["logprobs"] = np.asarray(responses.logprobs).tolist()
        return out

    def _sample_metric(self, template: Template, sample: Sequence[Example]) -> float:
        """What robustness compares: the ROC-AUC of the label log-odds, or a generation task's reward metric."""
        if self.task.is_generation:
            out = self.responses(template, sample)
            return gm.generation_metrics(out.parsed, [e.reference for e in sample])[self.task.scoring.reward_metric]
        return self._reward_metric(self.label_logprobs(template, sample), sample)

    def robustness_pdr(self, template: Template) -> dict[str, float]:
        """PDR per PromptBench attack on a dev sample, one perturbed variant per attack chosen by the
        template's hash (PromptBench's attacks search all variants for the worst; that costs 53x more)."""
        sample = self.robust_sample
        clean_metric = self._sample_metric(template, sample)  # cached after measure()
        out = {}
        seed = int(hashlib.sha256(template.text.encode()).hexdigest()[:8], 16)
        for attack in self.task.scoring.robustness_attacks:
            variants = pbm.perturb(template.text, attack)
            if not variants:
                continue
            variant = variants[seed % len(variants)]
            check = self.validate(variant)
            # A perturbation that breaks the template (e.g. text inserted into a trailing placeholder)
            # loses everything the template had: the metric falls to chance.
            metric = self._sample_metric(check.template, sample) if check.ok else 0.0 if self.task.is_generation else 0.5
            out[attack] = pbm.performance_drop_rate(clean_metric, metric)
        return out

    # --- the tuning loop's entry point --------------------------------------------------------------
    def measure(self, texts: Sequence[str], *, whole_dev: bool = False, examples: int | None = None,
                screen: bool = False) -> list[Scored]:
        """Measure and weigh candidate template texts on the dev sample (its first ``examples`` only, when given:
        the first rung of a race, ``pipelines/racing.py``), or on the selection sample with ``whole_dev`` (the
        whole dev split unless its inputs pass twice ``scoring.dev_tokens``; invalid ones are marked, not raised).
        Robustness always uses the same small dev sample. ``screen``: only the target's label log-probs and greedy
        answers (the reward metric and instruction following) and the instruction's readability; no entity swaps,
        perturbations or judge, whose components abstain (a race's screening rung)."""
        cfg = self.task
        dev = self.selection if whole_dev else self.dev[:examples] if examples else self.dev
        results: list[Scored | None] = [None] * len(texts)
        valid: list[tuple[int, Template, int]] = []
        for i, text in enumerate(texts):
            check = self.validate(text)
            if not check.ok:
                m = Measured(template=text, valid=False, reasons=check.reasons, tokens=check.tokens,
                             max_tokens=cfg.template.max_tokens, reward_metric=cfg.scoring.reward_metric)
                results[i] = Scored(m, self.reward(m))
            else:
                valid.append((i, check.template, check.tokens))
        t0 = time.perf_counter()
        spent = self.spent()
        template_judged = self.template_judge([t.text for _, t, _ in valid]) if valid and not screen else [{}] * len(valid)
        readability = dict(zip((i for i, _, _ in valid), self.readability([t.text for _, t, _ in valid])))
        judge_s = (time.perf_counter() - t0) / max(1, len(valid))
        for (i, template, tokens), judged in zip(valid, template_judged):
            if i != valid[0][0]:  # the first valid candidate carries the template judge's batch
                spent = self.spent()
            t0 = time.perf_counter()
            if screen and cfg.scoring.reward_metric == "roc_auc":  # label log-probs alone give the reward metric
                out = self.responses(template, dev, answers=False)
                metrics = {"roc_auc": self._reward_metric(out.logprobs, dev)}
                rates = {}
                if examples is None and not whole_dev:  # a screen of the whole sample (a race's second rung, the
                    # seed): greedy answers on its first slice too, so that a template whose answers break the
                    # contract is known before the choice pays for it (its instruction_following, on that slice)
                    rates["instruction_following"] = self.responses(template, dev[: self.first_rung or len(dev)]).kept()
                m = Measured(template=template.text, valid=True, tokens=tokens, max_tokens=cfg.template.max_tokens,
                             metrics=metrics, reward_metric=cfg.scoring.reward_metric, chance=_reward_chance(cfg),
                             readability=readability.get(i), prompt_ratio=self.prompt_ratio(template), rates=rates,
                             timing={"target_s": time.perf_counter() - t0})
                results[i] = Scored(m, self.reward(m), self.spent_since(spent))
                continue
            out = self.responses(template, dev)
            if cfg.scoring.decision == "answer":
                rule = self.fit_decision(template)
                decided = self.decide(rule, out)
                metrics = self.production_metrics(dev, out, decided)
            else:  # the rates need a decision; in the loop the threshold is fitted on the same dev log-odds
                metrics = {"roc_auc": self._reward_metric(out.logprobs, dev)}
                rule = self._calibrated(out.logprobs, dev) if cfg.scoring.decision == "calibrated" else self.fit_decision(template)
                decided = self.decide(rule, out)
            t1 = time.perf_counter()
            rates = {"instruction_following": out.kept()}
            pdr = {}
            if not screen:
                rates["entity_consistency"] = self.consistency(template, dev, rule, out, decided)
                pdr = self.robustness_pdr(template)
            t2 = time.perf_counter()
            if not screen:
                judged = {**judged, **self.judge_responses(dev, out)}
            m = Measured(
                template=template.text, valid=True, tokens=tokens, max_tokens=cfg.template.max_tokens,
                metrics=metrics, reward_metric=cfg.scoring.reward_metric, chance=_reward_chance(cfg), pdr=pdr,
                judge=judged, rates=rates, readability=readability.get(i), prompt_ratio=self.prompt_ratio(template),
                samples=self.samples(dev, out, decided),
                timing={"target_s": t1 - t0, "robustness_s": t2 - t1, "judge_s": judge_s + time.perf_counter() - t2},
            )
            results[i] = Scored(m, self.reward(m), self.spent_since(spent))
        return results  # type: ignore[return-value]

    def spent(self) -> dict[str, Usage]:
        """What the target and the judge have answered so far (calls and tokens, per role)."""
        return {"target": self.target.usage.copy(), "judge": self.judge_scorer.usage.copy()}

    def spent_since(self, before: dict[str, Usage]) -> dict[str, Usage]:
        return {role: usage - before[role] for role, usage in self.spent().items()}

    def reward(self, m: Measured) -> Reward:
        return weigh(m, self.task.reward.weights, self.components, self.task.reward.invalid_penalty)

    # --- full evaluation ---------------------------------------------------------------------------
    def _calibrated(self, logprobs: np.ndarray, examples: Sequence[Example]) -> DecisionRule:
        """The calibrated rule fitted on ``examples``: a threshold on the positive label's log-odds for two
        labels, an offset per label for more (both maximise balanced accuracy)."""
        labels, words, gold = tuple(self.labels), tuple(self.task.verbalizers), [e.label for e in examples]
        logprobs = np.asarray(logprobs, dtype=np.float64)
        if len(labels) == 2:
            positive = self.task.positive_label
            odds = pbm.label_log_odds(logprobs, labels.index(positive))
            return DecisionRule("calibrated", labels, words, positive,
                                float(pbm.fit_threshold(odds, [g == positive for g in gold])))
        offsets = pbm.fit_offsets(logprobs, gold, labels)
        return DecisionRule("calibrated", labels, words, offsets=tuple(float(o) for o in offsets))

    def fit_decision(self, template: Template) -> DecisionRule:
        """The production decision for ``template``: the task's rule, with its threshold fitted on the train
        split when it has one (maximising balanced accuracy on ``scoring.calibration_examples`` examples)."""
        labels, words = tuple(self.labels), tuple(self.task.verbalizers)
        kind = self.task.scoring.decision
        if kind == "answer":
            return DecisionRule("answer", labels, words, contract=self.contract, max_new_tokens=self.max_new_tokens)
        if kind == "argmax":
            return DecisionRule("argmax", labels, words)
        return self._calibrated(self.label_logprobs(template, self.calibration), self.calibration)

    def render_us_p99(self, template: Template, examples: Sequence[Example], repeats: int = 2000) -> float:
        values = [e.inputs(self.task.input_variable) for e in examples[:50]]
        samples = []
        for i in range(repeats):
            v = values[i % len(values)]
            t0 = time.perf_counter_ns()
            template.render(v)
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return float(np.percentile(samples, 99))

    def evaluate(self, text: str, split: str = "dev", *, latency: bool = True, fitted: Evaluation | None = None
                 ) -> Evaluation:
        """Every component of one template on one split, under the production decision.

        ``fitted``: the same template's evaluation on another split, whose production decision (fitted on train)
        and robustness (PromptBench's perturbations of a fixed dev sample) are the same on every split: they
        are taken from it instead of measured again (the test of a template the choice evaluated on dev)."""
        cfg = self.task
        examples = list(self.splits[split])
        check = self.validate(text)
        if not check.ok:
            m = Measured(template=text, valid=False, reasons=check.reasons, tokens=check.tokens,
                         max_tokens=cfg.template.max_tokens, reward_metric=cfg.scoring.reward_metric)
            return Evaluation(m, self.reward(m), split, len(examples), None)
        template = check.template
        timing = {}
        spent = self.spent()
        t0 = time.perf_counter()
        if fitted is not None and fitted.measured.template != text:
            raise ValueError("fitted is another template's evaluation")
        reuse = fitted is not None and fitted.decision is not None
        decision = fitted.decision if reuse else self.fit_decision(template)
        timing["calibrate_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.responses(template, examples)
        decided = self.decide(decision, out)
        metrics = self.production_metrics(examples, out, decided)
        timing["target_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        consistency = self.consistency(template, examples, decision, out, decided)
        pdr = dict(fitted.measured.pdr) if reuse else self.robustness_pdr(template)
        timing["robustness_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        (judged,) = self.template_judge([template.text])
        judged = {**judged, **self.judge_responses(examples, out)}
        timing["judge_s"] = time.perf_counter() - t0
        (readability,) = self.readability([template.text])
        m = Measured(
            template=template.text, valid=True, tokens=check.tokens, max_tokens=cfg.template.max_tokens,
            readability=readability, prompt_ratio=self.prompt_ratio(template),
            metrics=metrics, reward_metric=cfg.scoring.reward_metric, chance=_reward_chance(cfg),
            pdr=pdr, judge=judged, rates={"instruction_following": out.kept(), "entity_consistency": consistency},
            samples=self.samples(examples, out, decided, n=10), timing=timing,  # the run report shows 10 of each
            outcomes=self.outcomes(examples, out, decided),
        )
        result = Evaluation(m, self.reward(m), split, len(examples), decision)
        if latency:
            result.latency = self.latency(template, split)
        result.usage = self.spent_since(spent)
        return result

    def latency(self, template: Template, split: str, n_requests: int = 12) -> Latency:
        """Time one valid template on a split (apart from ``evaluate``, so a pool can run it on one worker at
        a time, without other workers' compute inflating the figure)."""
        ((latency, _),) = self.latencies([template], split, n_requests)
        return latency

    def latencies(self, templates: Sequence[Template], split: str, n_requests: int = 12
                  ) -> list[tuple[Latency, dict[str, Usage]]]:
        """``latency`` of several templates with their requests interleaved, one of each in turn on the same
        inputs: a machine that slows down or speeds up while they are timed does so for all of them alike, so
        their ratio (the gate's latency bar) holds still. Each with the calls its own requests took."""
        examples = list(self.splits[split])
        inputs = [self._inputs(t, examples) for t in templates]
        times: list[list[float]] = [[] for _ in templates]
        paired: list[list[float]] = [[] for _ in templates]  # in request order, NaN where it failed
        failed = [0] * len(templates)
        usage: list[dict[str, Usage]] = [{} for _ in templates]
        for i in range(n_requests):
            for k, (frame, texts) in enumerate(inputs):
                if i >= len(texts):
                    continue
                before = self.spent()
                probe = self.target.request_latency_ms(frame, [texts[i]], 1)
                usage[k] = sum_usage(usage[k], self.spent_since(before))
                if probe["error_rate"] > 0 or not np.isfinite(probe["p50"]):
                    failed[k] += 1
                    paired[k].append(float("nan"))
                else:
                    times[k].append(probe["p50"])
                    paired[k].append(float(probe["p50"]))
        out = []
        for k, template in enumerate(templates):
            ok, nan = times[k], float("nan")  # every request failed: no latency, which fails the gate's bar too
            latency = Latency(float(np.percentile(ok, 50)) if ok else nan, float(np.percentile(ok, 95)) if ok else nan,
                              failed[k] / max(1, len(ok) + failed[k]), self.render_us_p99(template, examples),
                              tuple(paired[k]))
            out.append((latency, usage[k]))
        return out
