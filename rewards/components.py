"""Reward components: plain functions from one candidate's measurements to a float, or None to abstain.

Every component has the signature ``component(m: Measured) -> float | None``. Measuring (running the
target model, the perturbations and the judge) happens elsewhere (``pipelines/scoring.py``); these
functions only turn measurements into comparable numbers, so they are pure and tested without a model.

How each enters the reward (the weights live in the task file):

* ``task_metric``: the reward metric on the dev split, rescaled so chance scores 0 and perfect scores 1
  (ROC-AUC by default: it needs no decision threshold, so a candidate is scored without a calibration pass,
  and it notices a template that inverts the model's answers). Below chance is negative.
* ``instruction_following``, ``entity_consistency``, ``coherence``: the judge's P(yes) for each rubric, 0..1.
* ``robustness``: ``1 - mean PDR`` over PromptBench's checklist and stresstest perturbations, clipped to 0..1.
* ``length``: ``-tokens / max_tokens``, from 0 (empty) to -1 (at the budget): a gentle push to shorter templates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping


@dataclass(frozen=True)
class Measured:
    """What was measured for one candidate template on one split."""

    template: str
    valid: bool
    reasons: tuple[str, ...] = ()  # why it is invalid
    tokens: int | None = None
    max_tokens: int = 1
    metrics: Mapping[str, float] = field(default_factory=dict)  # accuracy, balanced_accuracy, macro_f1, roc_auc
    reward_metric: str = "roc_auc"
    chance: float = 0.5  # the reward metric's value for a template that carries no information
    pdr: Mapping[str, float] = field(default_factory=dict)  # attack -> Performance Drop Rate
    judge: Mapping[str, float | None] = field(default_factory=dict)  # rubric -> P(yes), None on judge failure
    timing: Mapping[str, float] = field(default_factory=dict)


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def task_metric(m: Measured) -> float | None:
    value = m.metrics.get(m.reward_metric)
    if not _finite(value):
        return None
    return (value - m.chance) / (1.0 - m.chance)


def robustness(m: Measured) -> float | None:
    drops = [d for d in m.pdr.values() if _finite(d)]
    if not drops:
        return None
    return min(1.0, max(0.0, 1.0 - sum(drops) / len(drops)))


def length(m: Measured) -> float | None:
    if m.tokens is None:
        return None
    return -min(1.0, m.tokens / max(1, m.max_tokens))


def judge_component(rubric: str) -> Callable[[Measured], float | None]:
    """The component for one judge rubric: its P(yes), or None when the judge failed on it."""

    def component(m: Measured) -> float | None:
        value = m.judge.get(rubric)
        return value if _finite(value) else None

    component.__name__ = rubric
    return component


def components_for(rubrics) -> dict[str, Callable[[Measured], float | None]]:
    """All reward components of a task: the fixed ones plus one per judge rubric."""
    out: dict[str, Callable[[Measured], float | None]] = {
        "task_metric": task_metric,
        "robustness": robustness,
        "length": length,
    }
    for rubric in rubrics:
        if rubric in out:
            raise ValueError(f"judge rubric {rubric!r} has the name of a built-in component; rename it")
        out[rubric] = judge_component(rubric)
    return out
