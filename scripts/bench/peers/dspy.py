"""DSPy's COPRO, MIPROv2 and GEPA as peers of this project's tuning methods: instruction only, zero demos, at a budget
of target calls (``scripts/bench/tuning.py``'s DSPy rows). Needs the optional extra: ``pip install -e .[bench]``.

Why an adapter. DSPy optimizes a *program*: a ``dspy.Predict`` whose signature holds an instruction, run through
a ``dspy.Adapter`` (which turns the signature and inputs into chat messages, and the completion back into output
fields) on a ``dspy.BaseLM``. Run as shipped, its ChatAdapter writes its own prompt ("Your input fields are ...
[[ ## text ## ]] ...") and wants ``[[ ## answer ## ]]`` markers back, so DSPy would tune an instruction for a
prompt this project never sends, and SmolLM2-135M answers in neither format (ChatAdapter then raises, and retries
through JSONAdapter). Here the optimizers run unmodified; only the two ends are this project's:

* ``LocalLM``: a ``dspy.BaseLM`` over an in-process model (``pipelines.engine.models.LoadedLM``): the messages go
  through the tokenizer's chat template and are generated greedily (temperature 0 or unset) or sampled (the
  given temperature, ``n`` completions), each ending at the chat's end of turn. DSPy's cache is off for it (and
  DSPy does not cache a legacy ``forward`` LM anyway), so every evaluation is a real call and is counted.
* ``TargetAdapter`` (the target's side): the prompt is exactly what this project sends the target
  (``pipelines.engine.target.prompt_frame``): the task's skeleton with the signature's instruction in it, the
  input put in, and the user turn of the chat template (the template's default system turn included); the
  completion is read by the task's output contract (``pipelines.scoring.output_contract``). An answer that breaks
  the contract is data: the answer field is ``UNPARSED``, never an exception. With a model that has weights the
  answer is the project's scorer's (``LabelScorer.answer``), as the project's methods get it. An instruction that
  makes the template invalid (a brace, over the token budget) is not sent: its answers are ``UNPARSED`` at no
  call, as the project's scorer gives an invalid candidate its penalty without asking the target. The optimizer's
  output-field prefix (COPRO tunes one) has no place in the skeleton and is ignored.
* ``ProposerAdapter`` (COPRO's and MIPROv2's ``prompt_model``, GEPA's ``reflection_lm``: the same small model,
  untrained, as the project's best-of-N policy): DSPy's own ChatAdapter prompt, but a completion without the
  field markers is not an error: the raw completion text becomes the first output field and the others get
  their defaults ('' for text). GEPA's reflection reads each example's outcome as text: the answer, the label
  and whether they match (``label_outcome``), the "per-example outcome as feedback" its paper describes.
* ``RoleAdapter``: DSPy reads one global adapter, so it routes each call by the LM's ``role``.

What is counted. ``target_calls``: completions the target generated (one per completion; an ``n``-completion
request counts ``n``), for the search and the choice; the benchmark's final test on the held-out split is not
part of it, as for the other methods. The proposer's completions are counted apart (``note``), as the other
methods' policy samples are not target calls. A ``CallLedger`` shared by an LM and its copies (DSPy copies the
prompt model per proposal) holds the counts. The budget is kept two ways: the settings are sized so the run's
most calls fit in it (the formulas are in ``copro_settings``, ``miprov2_settings`` and ``gepa_settings``), and
a call that would pass it raises ``BudgetExceeded`` before it runs; then ``optimize`` keeps the best instruction
that was measured on every evaluation example (DSPy gives back no result from a run cut short) and says so in ``note``.

The module is long because the three optimizers share the two ends and the call ledger above, and each needs its
settings sized to the budget; one file keeps what a peer row is given, and how it is counted, in one place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import dspy
from dspy.adapters.base import Adapter
from dspy.adapters.chat_adapter import ChatAdapter
from dspy.utils.exceptions import AdapterParseError

from pipelines.config import TaskConfig
from pipelines.data import Example, Splits
from pipelines.engine.models import LoadedLM
from pipelines.scoring import answer_tokens, label_scorer, output_contract, scorer_words
from templates.template import Template, validate_candidate

ANSWER = "answer"  # the signature's output field
UNPARSED = "<unparsed>"  # the answer field's value when the completion breaks the contract (or was not asked for)
METHODS = ("copro", "miprov2", "gepa")


class BudgetExceeded(BaseException):
    """A target call would pass the budget. A BaseException on purpose: DSPy's evaluation loop
    (``dspy.utils.parallelizer``) catches every ``Exception`` of an example, scores it as a failure and goes on,
    so an ``Exception`` could not stop the run; ``optimize`` catches this one."""

    def __init__(self, calls: int, asked: int, budget: int):
        super().__init__(f"{asked} more target call(s) after {calls} would pass the budget of {budget}")
        self.calls, self.asked, self.budget = calls, asked, budget


@dataclass
class CallLedger:
    """Calls by role, shared by an LM and its copies; the target's budget; what the target adapter last sent and
    the finish reasons of the last completions (DSPy's output processing keeps only their text)."""

    budget: int | None = None  # the target's; None: no cap
    calls: dict[str, int] = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    instruction: str | None = None  # the instruction of the target's current call
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # instruction -> example key -> metric

    def charge(self, role: str, n: int) -> None:
        """Count ``n`` completions of ``role``; raise ``BudgetExceeded`` (counting nothing) if the target's would
        pass the budget."""
        spent = self.calls.get(role, 0)
        if role == "target" and self.budget is not None and spent + n > self.budget:
            raise BudgetExceeded(spent, n, self.budget)
        self.calls[role] = spent + n


class LocalLM(dspy.BaseLM):
    """A ``dspy.BaseLM`` over an in-process causal LM (legacy ``forward`` interface, which DSPy 3.4 supports and
    warns is deprecated). ``role``: "target" or "proposer" (the adapters and the ledger read it)."""

    def __init__(self, loaded: LoadedLM, *, role: str, ledger: CallLedger | None = None, max_tokens: int = 64,
                 temperature: float | None = None, chat_template: bool = True):
        super().__init__(model=f"local/{loaded.name}", model_type="chat", temperature=temperature,
                         max_tokens=max_tokens, cache=False, num_retries=0)
        self.loaded, self.role, self.chat_template = loaded, role, chat_template
        self.ledger = ledger if ledger is not None else CallLedger()

    def prompt_text(self, messages: list[dict]) -> str:
        """The text the model reads: the messages in the tokenizer's chat template, or (a task with
        ``chat_template: false``) their contents as they are."""
        if not self.chat_template:
            return "".join(str(m.get("content") or "") for m in messages)
        return self.loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def forward(self, prompt=None, messages=None, **kwargs):
        """An OpenAI-style chat completion (what ``BaseLM._process_completion`` reads): choices with message content
        and finish_reason ("stop": end of sequence, "length": the token limit), usage, model."""
        options = {**self.kwargs, **{k: v for k, v in kwargs.items() if v is not None}}
        messages = messages or [{"role": "user", "content": prompt}]
        n = int(options.get("n") or 1)
        temperature = options.get("temperature") or 0.0
        max_new = int(options.get("max_tokens") or 64)
        self.ledger.charge(self.role, n)
        texts, finishes, prompt_tokens, completion_tokens = self._generate(self.prompt_text(messages), n,
                                                                           float(temperature), max_new)
        self.ledger.finish_reasons = finishes
        return {
            "object": "chat.completion", "model": self.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                        for i, (text, finish) in enumerate(zip(texts, finishes))],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _generate(self, text: str, n: int, temperature: float, max_new: int):
        import torch

        tok, model = self.loaded.tokenizer, self.loaded.model
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit and ids.shape[1] + max_new > limit:  # keep the end of an over-long prompt (DSPy's proposer prompts)
            ids = ids[:, -(limit - max_new):]
        sample = temperature > 0
        # The chat's end of turn (<|im_end|> for SmolLM2, named by the generation config) ends a completion, as the
        # tokenizer's own end of sequence does (the GGUF-loaded tokenizer's differs). Reading only the latter let
        # a one-word answer run on into the next turn: finish "length", and the contract refused it as cut off.
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stops = [eos] if isinstance(eos, int) else list(eos or [])
        stops += [tok.eos_token_id] if tok.eos_token_id is not None and tok.eos_token_id not in stops else []
        options: dict[str, Any] = dict(max_new_tokens=max_new, do_sample=sample, eos_token_id=stops,
                                       pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stops[0])
        if sample:
            options.update(temperature=temperature, top_p=1.0, top_k=0, num_return_sequences=n)
        else:
            options.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        texts, finishes, new_tokens = [], [], 0
        for row in out[:, ids.shape[1]:].tolist():
            end = next((i for i, token in enumerate(row) if token in stops), None)
            stopped = end is not None
            row = row[:end] if stopped else row
            new_tokens += len(row) + stopped
            texts.append(tok.decode(row, skip_special_tokens=True))
            finishes.append("stop" if stopped else "length")
        if not sample:  # greedy: n identical completions, generated once, counted n times (DSPy asked for n)
            texts, finishes, new_tokens = texts * n, finishes * n, new_tokens * n
        return texts, finishes, int(ids.shape[1]) * (n if sample else 1), new_tokens


class TargetAdapter(Adapter):
    """Formats a Predict call as this project prompts the target, and reads the answer with the task's contract.

    ``scorer``: the project's in-process label scorer of the target (``pipelines.scoring.label_scorer``). With it
    the target's greedy answer comes from ``scorer.answer``, the call the project's own methods make: the same
    prompt, the same packed forward pass and stopping rule, so in bfloat16 the same near-tied answers, and about
    2.3 times faster a call than ``generate`` here. Without it (a scripted model in the tests) the LM answers."""

    def __init__(self, task: TaskConfig, tokenizer, ledger: CallLedger, scorer=None):
        super().__init__()
        self.task, self.tokenizer, self.ledger, self.scorer = task, tokenizer, ledger, scorer
        self.contract = output_contract(task)
        self._valid: dict[str, Template | None] = {}

    def template(self, instruction: str) -> Template | None:
        """The bare template for ``instruction`` (None: the composed template is invalid, as the scorer judges)."""
        if instruction not in self._valid:
            found = validate_candidate(self.task.compose(instruction), self.task.input_variables,
                                       self.task.template.max_tokens,
                                       lambda t: len(self.tokenizer(t, add_special_tokens=False).input_ids))
            self._valid[instruction] = found.template if found.ok else None
        return self._valid[instruction]

    def format(self, signature, demos, inputs):
        if demos:
            raise ValueError("the target adapter is for zero-demo programs (instruction only)")
        template = self.template(signature.instructions)
        if template is None:
            raise ValueError("the instruction makes the template invalid; such a call is never sent")
        values = {name: str(inputs[name]) for name in self.task.input_variables}
        return [{"role": "user", "content": template.render(values)}]

    def __call__(self, lm, lm_kwargs, signature, demos, inputs):
        self.ledger.instruction = signature.instructions
        template = self.template(signature.instructions)
        if template is None:
            return [{ANSWER: UNPARSED}]  # no call: the scorer's fixed penalty, in DSPy's terms a wrong answer
        if self.scorer is not None:
            if demos:
                raise ValueError("the target adapter is for zero-demo programs (instruction only)")
            n = int({**lm.kwargs, **lm_kwargs}.get("n") or 1)
            self.ledger.charge("target", n)  # greedy: n equal answers, counted n times, as LocalLM counts them
            frame, span = template.input_frame()
            values = {name: str(inputs[name]) for name in self.task.input_variables}
            text = values[self.task.input_variables[0]] if frame is template else span.render(values)
            (found,) = self.scorer.answer(frame, [text], answer_tokens(self.task), self.contract.complete)
            return [self.parse_answer(found.text, truncated=found.truncated)] * n
        self.ledger.finish_reasons = []
        return super().__call__(lm, lm_kwargs, signature, demos, inputs)

    def _call_postprocess(self, processed_signature, original_signature, outputs, lm, lm_kwargs):
        finishes = self.ledger.finish_reasons
        values = []
        for i, output in enumerate(outputs):
            text = output.get("text") if isinstance(output, dict) else output
            truncated = i < len(finishes) and finishes[i] == "length" and not self.contract.complete(text or "")
            values.append(self.parse_answer(text, truncated=truncated))
        return values

    def parse_answer(self, text: str | None, *, truncated: bool = False) -> dict:
        """The answer field for one completion: the parsed value, or ``UNPARSED``. Never raises."""
        parsed = self.contract.parse(text, truncated=truncated)
        return {ANSWER: parsed.value if parsed.ok else UNPARSED}

    def parse(self, signature, completion):
        return self.parse_answer(completion)


class ProposerAdapter(ChatAdapter):
    """DSPy's ChatAdapter for the prompt model, without its failure modes: a completion without the field markers
    gives the raw text as the first output field and defaults for the others; an empty one gives defaults."""

    def __init__(self):
        super().__init__(use_json_adapter_fallback=False)

    def parse(self, signature, completion):
        try:
            return super().parse(signature, completion)
        except AdapterParseError as exc:
            partial = exc.parsed_result if isinstance(exc.parsed_result, dict) else {}
        names = list(signature.output_fields)
        fields = {name: partial.get(name, "" if signature.output_fields[name].annotation is str else None)
                  for name in names}
        if names[0] not in partial:
            fields[names[0]] = (completion or "").strip()
        return fields

    def _call_postprocess(self, processed_signature, original_signature, outputs, lm, lm_kwargs):
        texts = [output.get("text") if isinstance(output, dict) else output for output in outputs]
        return [self.parse(processed_signature, text or "") for text in texts]


class RoleAdapter(Adapter):
    """DSPy's one adapter setting, routed by the LM's role: the target's calls to ``target``, the rest to
    ``proposer``."""

    def __init__(self, target: TargetAdapter, proposer: ProposerAdapter):
        super().__init__()
        self.target, self.proposer = target, proposer

    def _for(self, lm) -> Adapter:
        return self.target if getattr(lm, "role", None) == "target" else self.proposer

    def __call__(self, lm, lm_kwargs, signature, demos, inputs):
        return self._for(lm)(lm, lm_kwargs, signature, demos, inputs)

    async def acall(self, lm, lm_kwargs, signature, demos, inputs):
        return self._for(lm)(lm, lm_kwargs, signature, demos, inputs)


# --- settings sized to a budget -------------------------------------------------------------------------------

def copro_settings(budget: int, n_train: int) -> dict | None:
    """COPRO's breadth, depth and number of train examples for at most ``budget`` target calls (None: too small).

    COPRO measures every candidate on the whole trainset, one target call per example, and asks the prompt model
    for breadth-1 candidates (plus the seed instruction) at depth 1 and breadth at each later depth, each one
    measured: at most breadth * depth * examples target calls (fewer when a candidate is invalid and not sent).
    Depth up to COPRO's default 3 and breadth up to its default 10, at first on 20 examples (the default racing slice);
    what the budget leaves then buys more examples."""
    if budget < 2 or n_train < 1:
        return None
    examples = min(n_train, 20)
    depth = max(1, min(3, budget // (2 * examples)))
    breadth = min(10, budget // (depth * examples))
    if breadth < 2:  # COPRO needs breadth >= 2: fewer examples
        breadth, examples = 2, max(1, budget // (2 * depth))
    examples = min(n_train, budget // (breadth * depth))
    return {"breadth": breadth, "depth": depth, "examples": examples,
            "max_calls": breadth * depth * examples}


def _trials_for(candidates: int) -> int:
    """MIPROv2's own suggestion for zero-shot, one predictor (``_set_num_trials_from_num_candidates``)."""
    return int(max(2 * math.log2(candidates), 1.5 * candidates))


def miprov2_settings(budget: int, n_train: int, n_dev: int) -> dict | None:
    """MIPROv2's num_candidates, num_trials and set sizes for at most ``budget`` target calls (None: too small).

    With max_bootstrapped_demos=0 and max_labeled_demos=0 MIPROv2 still bootstraps num_candidates-1 demo sets on
    the trainset to show its proposer (each runs the target on train examples until it has 1-3 correct ones: at
    most train calls each), then measures the seed program on the whole valset, then num_trials programs on the
    whole valset (no minibatches): at most (N-1) * train + (trials+1) * val target calls. The most candidates
    (up to 10) whose trials still get a valset of min(dev, 10) examples; the valset then as large as fits."""
    if n_train < 1 or n_dev < 1:
        return None
    chosen = None
    for candidates in range(10, 1, -1):
        trials = _trials_for(candidates)
        val = min(n_dev, max([v for v in range(1, n_dev + 1)
                              if (trials + 1) * v + (candidates - 1) * min(n_train, v) <= budget], default=0))
        if val >= 1:
            chosen = (candidates, trials, val)
            if val >= min(n_dev, 10):
                break
    if chosen is None:
        return None
    candidates, trials, val = chosen
    train = min(n_train, val)
    return {"num_candidates": candidates, "num_trials": trials, "val": val, "train": train,
            "max_calls": (candidates - 1) * train + (trials + 1) * val}


def gepa_settings(budget: int, n_train: int, n_dev: int) -> dict | None:
    """GEPA's valset, trainset, minibatch and metric-call budget for at most ``budget`` target calls (None: too
    small).

    GEPA measures the seed on the whole valset. Then each iteration runs the current candidate on a minibatch of
    train examples (``reflection_minibatch_size``, its default 3), reflects on their feedback, runs the proposal
    on the same minibatch and, if it did better there, on the whole valset. It checks its budget
    (``max_metric_calls``) only between iterations, so that budget leaves room for one more iteration. The
    valset: a twentieth of the budget, at least 10 and at most 35 examples of dev (above 35 DSPy warns that a
    smaller valset leaves more of the budget to explore)."""
    minibatch = 3
    val = min(n_dev, 35, max(10, budget // 20))
    room = val + 2 * minibatch  # one iteration past the last check
    if n_train < minibatch or n_dev < 1 or budget < val + room + 2 * minibatch:
        return None
    return {"val": val, "train": min(n_train, 200), "minibatch": minibatch, "max_metric_calls": budget - room,
            "max_calls": budget}


# --- the run ----------------------------------------------------------------------------------------------------

def _balanced(examples, n: int) -> list[Example]:
    """``n`` examples, labels taken in turn (split order within a label)."""
    by_label: dict[str, list] = {}
    for example in examples:
        by_label.setdefault(example.label, []).append(example)
    out, queues = [], [list(v) for v in by_label.values()]
    while len(out) < n and any(queues):
        for queue in queues:
            if queue and len(out) < n:
                out.append(queue.pop(0))
    return out


def _dspy_examples(task: TaskConfig, examples) -> list:
    variables = task.input_variables
    rows = []
    for example in examples:
        values = example.values if example.values is not None else {variables[0]: example.text}
        rows.append(dspy.Example(**{name: values[name] for name in variables}, label=example.label)
                    .with_inputs(*variables))
    return rows


def _program(task: TaskConfig):
    fields = {name: (str, dspy.InputField()) for name in task.input_variables}
    fields[ANSWER] = (str, dspy.OutputField())
    return dspy.Predict(dspy.Signature(fields, task.template.seed_instruction))


def _key(task: TaskConfig, example) -> str:
    return "\x1f".join(str(example[name]) for name in task.input_variables)


def best_measured(ledger: CallLedger, keys: set[str], fallback: str) -> tuple[str, float | None]:
    """The instruction with the best mean metric among those measured on every one of ``keys``."""
    complete = {text: sum(scores[k] for k in keys) / len(keys)
                for text, scores in ledger.scores.items() if keys and keys <= scores.keys()}
    if not complete:
        return fallback, None
    best = max(complete, key=lambda text: complete[text])
    return best, complete[best]


def optimize(task: TaskConfig, splits: Splits, lm: LoadedLM, method: str, budget_calls: int, seed: int, *,
             proposer: LoadedLM | None = None) -> dict:
    """Run DSPy's ``method`` (one of ``METHODS``) as shipped, instruction only and zero demos, with at most
    ``budget_calls`` calls to the target ``lm``. ``proposer``: the prompt model (default: ``lm``).

    Returns ``{"instruction", "target_calls", "note"}``; the instruction goes into the task's skeleton
    (``task.compose``). Train examples (and for MIPROv2 and GEPA dev examples as the valset) only; never the test
    split. The metric is the task's production figure per example: the answer parsed by the contract equals the
    label; GEPA also reads the outcome as text (``label_outcome``)."""
    if task.is_generation:
        raise ValueError("the DSPy peer runs classification tasks (a label per example) only")
    return run(task, splits, lm, method, budget_calls, seed, proposer=proposer,
               examples=lambda split, n: _dspy_examples(task, _balanced(split, n)),
               outcome=lambda example, answer: label_outcome(task, example.label, answer))


def label_outcome(task: TaskConfig, label: str, answer) -> tuple[float, str]:
    """One classification example's score (1: the parsed answer is the label) and what GEPA's reflection reads."""
    if answer == UNPARSED or answer is None:
        return 0.0, (f"The answer broke the output contract: no label could be read from it. It must be one of "
                     f"{', '.join(task.labels)}; the correct one here is {label!r}.")
    if answer == label:
        return 1.0, f"Correct: the answer {answer!r} is the right label."
    return 0.0, f"Wrong: the answer was {answer!r}; the correct label is {label!r}."


def settings_for(method: str, budget: int, n_train: int, n_dev: int) -> dict | None:
    """``method``'s settings sized to ``budget`` target calls (None: the budget is too small for it)."""
    if method == "copro":
        return copro_settings(budget, n_train)
    if method == "miprov2":
        return miprov2_settings(budget, n_train, n_dev)
    return gepa_settings(budget, n_train, n_dev)


def run(task: TaskConfig, splits: Splits, lm: LoadedLM, method: str, budget_calls: int, seed: int, *,
        proposer: LoadedLM | None, examples: Callable[[Any, int], list],
        outcome: Callable[[Any, Any], tuple[float, str]]) -> dict:
    """The run both kinds of task share (``optimize`` here, and ``bench.peers.dspy_generation``): ``examples``
    (a split's examples, n) -> n DSPy examples; ``outcome`` (a DSPy example, the answer field) -> (score, the
    feedback text GEPA reflects on)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    import torch

    ledger = CallLedger(budget=budget_calls)
    target = LocalLM(lm, role="target", ledger=ledger, max_tokens=answer_tokens(task), temperature=0.0,
                     chat_template=task.template.chat_template)
    prompt_model = LocalLM(proposer or lm, role="proposer", ledger=ledger,
                           max_tokens=task.template.max_instruction_tokens)
    # a model with weights answers through the project's own scorer; a scripted one (the tests) through LocalLM
    scorer = (label_scorer(lm, scorer_words(task), chat_template=task.template.chat_template)
              if lm.model is not None else None)
    adapter = RoleAdapter(TargetAdapter(task, lm.tokenizer, ledger, scorer), ProposerAdapter())
    seed_instruction = task.template.seed_instruction

    sizes = settings_for(method, budget_calls, len(splits.train), len(splits.dev))
    if sizes is None:
        return {"instruction": seed_instruction, "target_calls": 0,
                "note": f"not run: a budget of {budget_calls} target calls is too small for {method}"}
    if method == "copro":
        trainset = evalset = examples(splits.train, sizes["examples"])
    else:
        trainset = examples(splits.train, sizes["train"])
        evalset = examples(splits.dev, sizes["val"])

    def metric(example, prediction, trace=None, pred_name=None, pred_trace=None):
        score, feedback = outcome(example, getattr(prediction, ANSWER, None))
        if ledger.instruction is not None:
            ledger.scores.setdefault(ledger.instruction, {})[_key(task, example)] = score
        return dspy.Prediction(score=score, feedback=feedback) if method == "gepa" else score

    torch.manual_seed(seed)  # the proposer's sampling
    started = time.perf_counter()
    keys = {_key(task, e) for e in evalset}
    settings = ", ".join(f"{k}={v}" for k, v in sizes.items())
    dspy_log = logging.getLogger("dspy")
    level = dspy_log.level
    dspy_log.setLevel(max(level, logging.WARNING))  # its INFO lines are per trial and per candidate
    try:
        # DSPy prints progress bars and prompt histories (COPRO: one per candidate) to stdout: dropped; the
        # benchmark's table owns stdout.
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
                dspy.context(lm=target, adapter=adapter, num_threads=1):
            if method == "copro":
                optimizer = dspy.COPRO(prompt_model=prompt_model, metric=metric, breadth=sizes["breadth"],
                                       depth=sizes["depth"], init_temperature=1.4)
                best = optimizer.compile(_program(task), trainset=trainset,
                                         eval_kwargs={"num_threads": 1, "display_progress": False})
            elif method == "miprov2":
                optimizer = dspy.MIPROv2(metric=metric, prompt_model=prompt_model, task_model=target,
                                         max_bootstrapped_demos=0, max_labeled_demos=0, auto=None,
                                         num_candidates=sizes["num_candidates"], num_threads=1, seed=seed)
                best = optimizer.compile(_program(task), trainset=trainset, valset=evalset,
                                         num_trials=sizes["num_trials"], minibatch=False)
            else:  # GEPA reflects with the same small model, sampling as the project's policy does
                reflection = LocalLM(proposer or lm, role="proposer", ledger=ledger,
                                     max_tokens=task.template.max_instruction_tokens,
                                     temperature=task.generation.temperature)
                optimizer = dspy.GEPA(metric=metric, max_metric_calls=sizes["max_metric_calls"],
                                      reflection_lm=reflection, reflection_minibatch_size=sizes["minibatch"],
                                      num_threads=1, seed=seed)
                best = optimizer.compile(_program(task), trainset=trainset, valset=evalset)
        instruction = best.predictors()[0].signature.instructions
        how = "finished"
    except BudgetExceeded as exc:
        instruction, score = best_measured(ledger, keys, seed_instruction)
        how = (f"cut short ({exc}); kept the best instruction measured on all {len(keys)} evaluation examples"
               + (f" (score {score:.3f})" if score is not None else ": none, the seed"))
    finally:
        dspy_log.setLevel(level)
    calls = ledger.calls.get("target", 0)
    return {"instruction": instruction, "target_calls": calls,
            "note": f"{method} {how}; {settings}; {calls} target calls, "
                    f"{ledger.calls.get('proposer', 0)} proposer completions, {time.perf_counter() - started:.0f} s"}
