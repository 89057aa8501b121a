"""DSPy's COPRO and MIPROv2 on a generation task (e.g. callback): the bench's DSPy rows where an example carries a
reference answer instead of a label. Needs the optional extra: ``bash scripts/setup.sh --bench``.

The optimizers run as shipped, through the same adapter as on a classification task (``scripts/bench/peers/dspy.py``:
the target sees exactly the project's prompt, its answer is read by the task's output contract, contract-breaking
output is data, target calls are counted and capped, settings are sized to the budget). Only two things differ:

* the examples: the first ``n`` of a split in split order (there are no labels to balance), each with its
  ``reference``;
* the metric, per example: the task's production figure of the parsed answer against the reference
  (``rewards.generation_metrics.example_scores``: field exact match or token F1; 0 for an answer that broke the
  contract), as the project's scorer computes it over a split.

Why a module of its own and not a branch of ``scripts/bench/peers/dspy.py``: it was written when every ledger
record's fingerprint hashed all of ``pipelines/``, so that a change there would not void the classification
rows. Under the fingerprint rule of ``bench.ledger`` (each method's own code), it can fold into that module; the
fold waits for a session with the bench extra installed, which its tests need.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import dspy

from pipelines.config import TaskConfig
from pipelines.data import Splits
from bench.peers.dspy import (
    ANSWER, METHODS, UNPARSED, BudgetExceeded, CallLedger, LocalLM, ProposerAdapter, RoleAdapter, TargetAdapter,
    _key, _program, best_measured, copro_settings, miprov2_settings,
)
from pipelines.engine.models import LoadedLM
from pipelines.scoring import answer_tokens
from rewards.generation_metrics import example_scores
from templates.contract import Parsed

FIGURES = {"field_exact_match": 0, "token_f1": 1}  # example_scores' (exact, F1)


def examples_of(task: TaskConfig, examples, n: int) -> list:
    """The first ``n`` examples as DSPy examples: the template's inputs, and ``reference``."""
    rows = []
    for example in list(examples)[:n]:
        values = example.inputs(task.input_variables[0])
        rows.append(dspy.Example(**{name: values[name] for name in task.input_variables},
                                 reference=example.reference).with_inputs(*task.input_variables))
    return rows


def example_metric(task: TaskConfig, answer, reference) -> float:
    """The task's production figure of one answer (the answer field: a parsed value, or ``UNPARSED``)."""
    if task.scoring.metric == "contract_rate":
        return float(answer != UNPARSED)
    if answer == UNPARSED or answer is None:
        return 0.0
    return example_scores(Parsed(True, answer), reference)[FIGURES[task.scoring.metric]]


def optimize(task: TaskConfig, splits: Splits, lm: LoadedLM, method: str, budget_calls: int, seed: int, *,
             proposer: LoadedLM | None = None) -> dict:
    """``bench.peers.dspy.optimize`` for a generation task: DSPy's ``method`` as shipped, instruction only and
    zero demos, with at most ``budget_calls`` target calls. Train examples (and for MIPROv2 dev examples as its
    valset) only; never the test split. Returns ``{"instruction", "target_calls", "note"}``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if not task.is_generation:
        raise ValueError("a classification task runs through bench.peers.dspy.optimize")
    import torch

    ledger = CallLedger(budget=budget_calls)
    target = LocalLM(lm, role="target", ledger=ledger, max_tokens=answer_tokens(task), temperature=0.0,
                     chat_template=task.template.chat_template)
    prompt_model = LocalLM(proposer or lm, role="proposer", ledger=ledger,
                           max_tokens=task.template.max_instruction_tokens)
    adapter = RoleAdapter(TargetAdapter(task, lm.tokenizer, ledger), ProposerAdapter())
    seed_instruction = task.template.seed_instruction
    if method == "copro":
        sizes = copro_settings(budget_calls, len(splits.train))
    else:
        sizes = miprov2_settings(budget_calls, len(splits.train), len(splits.dev))
    if sizes is None:
        return {"instruction": seed_instruction, "target_calls": 0,
                "note": f"not run: a budget of {budget_calls} target calls is too small for {method}"}
    if method == "copro":
        trainset = evalset = examples_of(task, splits.train, sizes["examples"])
    else:
        trainset = examples_of(task, splits.train, sizes["train"])
        evalset = examples_of(task, splits.dev, sizes["val"])

    def metric(example, prediction, trace=None) -> float:
        score = example_metric(task, getattr(prediction, ANSWER, None), example.reference)
        if ledger.instruction is not None:
            ledger.scores.setdefault(ledger.instruction, {})[_key(task, example)] = score
        return score

    torch.manual_seed(seed)  # the proposer's sampling
    started = time.perf_counter()
    keys = {_key(task, e) for e in evalset}
    settings = ", ".join(f"{k}={v}" for k, v in sizes.items())
    dspy_log = logging.getLogger("dspy")
    level = dspy_log.level
    dspy_log.setLevel(max(level, logging.WARNING))
    try:  # DSPy's progress bars and prompt histories go to stdout: dropped (the bench's table owns stdout)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
                dspy.context(lm=target, adapter=adapter, num_threads=1):
            if method == "copro":
                optimizer = dspy.COPRO(prompt_model=prompt_model, metric=metric, breadth=sizes["breadth"],
                                       depth=sizes["depth"], init_temperature=1.4)
                best = optimizer.compile(_program(task), trainset=trainset,
                                         eval_kwargs={"num_threads": 1, "display_progress": False})
            else:
                optimizer = dspy.MIPROv2(metric=metric, prompt_model=prompt_model, task_model=target,
                                         max_bootstrapped_demos=0, max_labeled_demos=0, auto=None,
                                         num_candidates=sizes["num_candidates"], num_threads=1, seed=seed)
                best = optimizer.compile(_program(task), trainset=trainset, valset=evalset,
                                         num_trials=sizes["num_trials"], minibatch=False)
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
