"""DSPy's COPRO, MIPROv2 and GEPA on a generation task (e.g. callback): the bench's DSPy rows where an example carries a
reference answer instead of a label. Needs the optional extra: ``bash scripts/setup.sh --bench``.

The optimizers run as shipped, through the same adapter as on a classification task (``scripts/bench/peers/dspy.py``:
the target sees exactly the project's prompt, its answer is read by the task's output contract, contract-breaking
output is data, target calls are counted and capped, settings are sized to the budget). Only two things differ:

* the examples: the first ``n`` of a split in split order (there are no labels to balance), each with its
  ``reference``;
* the metric, per example: the task's production figure of the parsed answer against the reference
  (``rewards.generation_metrics.example_scores``: field exact match or token F1; 0 for an answer that broke the
  contract), as the project's scorer computes it over a split; GEPA reads it with the reference as feedback.

The run itself is ``bench.peers.dspy.run``, shared with classification tasks; this module holds only those two.
"""

from __future__ import annotations

import dspy

from pipelines.config import TaskConfig
from pipelines.data import Splits
from bench.peers.dspy import UNPARSED, run
from pipelines.engine.models import LoadedLM
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
    zero demos, with at most ``budget_calls`` target calls. Train examples (and for MIPROv2 and GEPA dev examples
    as the valset) only; never the test split. Returns ``{"instruction", "target_calls", "note"}``."""
    if not task.is_generation:
        raise ValueError("a classification task runs through bench.peers.dspy.optimize")
    return run(task, splits, lm, method, budget_calls, seed, proposer=proposer,
               examples=lambda split, n: examples_of(task, split, n),
               outcome=lambda example, answer: reference_outcome(task, answer, example.reference))


def reference_outcome(task: TaskConfig, answer, reference) -> tuple[float, str]:
    """One example's figure (``example_metric``) and what GEPA's reflection reads: the figure and the reference."""
    score = example_metric(task, answer, reference)
    if answer == UNPARSED or answer is None:
        return score, ("The answer broke the output contract: nothing usable could be read. "
                       f"The reference: {reference!r}.")
    return score, f"{task.scoring.metric} {score:.2f}: the answer was {answer!r}; the reference is {reference!r}."
