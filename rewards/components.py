"""Reward components: plain functions from one candidate's measurements to a float, or None to abstain.

Every component has the signature ``component(m: Measured) -> float | None``. Measuring (running the
target model, the perturbations and the judge) happens elsewhere (``pipelines/scoring.py``); these
functions only turn measurements into comparable numbers, so they are pure and tested without a model.

How each enters the reward (the weights live in the task file):

* ``task_metric``: the reward metric on the dev split, rescaled so chance scores 0 and perfect scores 1.
  Under a calibrated decision it is the ROC-AUC of the label log-odds (the threshold is fitted later, so a
  candidate is scored without a calibration pass); under an answer decision it is the production metric of the
  parsed answers (an answer that breaks the contract is wrong). Below chance is negative.
* ``label_log_odds``: the ROC-AUC of the label log-odds, rescaled the same way: a smoother signal an answer
  task may weight a little to break ties (under a calibrated decision it repeats ``task_metric``).
* ``instruction_following``: the share of the target's greedy answers that keep the output contract.
* ``entity_consistency``: the share of inputs with entities whose decision stays the same when the entities
  are replaced by others of the same type (``rewards.entities``); a broken answer keeps nothing.
* ``readability``: how readable the instruction alone is, 0..1, from a frozen small LM and plain text checks
  (``rewards/readability.py``), not from the judge: the analyst who signs a template off reads it.
* ``threshold_shortfall``: minus the summed shortfall of the rates and readability under the promotion
  thresholds, plus how far the prompts' predicted latency passes its ceiling (0 when all clear them): the gate
  refuses such a candidate, so the tuner is told before it gets there.
* one per judge rubric (``coherence``, ``factual_support``, ...): the judge's mean P(yes), 0..1, over graded
  (input, response) pairs, or over the template's text for a template rubric.
* ``robustness``: ``1 - mean PDR`` over PromptBench's checklist and stresstest perturbations, clipped to 0..1.
* ``length``: ``-tokens / max_tokens``, from 0 (empty) to -1 (at the budget): a gentle push to shorter templates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeGuard


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
    rates: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # rate name -> (kept, out of)
    samples: tuple[Mapping, ...] = ()  # a few (input, answer, parsed, contract_kept) rows, for reviewers
    # per example, for paired tests between templates on the same examples (pipelines/choice.py): a classification
    # task's "gold" and "decided" labels (None: a broken answer), a generation task's "scores" on its metric
    outcomes: Mapping[str, Sequence] = field(default_factory=dict)
    readability: float | None = None  # of the instruction alone, 0..1 (rewards/readability.py); None: not read
    # the prompts' tokens over the seed's on the same inputs: the latency a request would have relative to the
    # seed's if time followed tokens (an upper estimate: a request's fixed cost only lowers the real ratio)
    prompt_ratio: float | None = None
    timing: Mapping[str, float] = field(default_factory=dict)

    def rate(self, name: str) -> float | None:
        kept, total = self.rates.get(name, (0, 0))
        return kept / total if total else None


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def task_metric(m: Measured) -> float | None:
    value = m.metrics.get(m.reward_metric)
    if not _finite(value):
        return None
    return (value - m.chance) / (1.0 - m.chance)


def label_log_odds(m: Measured) -> float | None:
    value = m.metrics.get("roc_auc")
    return (value - 0.5) / 0.5 if _finite(value) else None


def instruction_following(m: Measured) -> float | None:
    return m.rate("instruction_following")


def entity_consistency(m: Measured) -> float | None:
    return m.rate("entity_consistency")


RATES = ("instruction_following", "entity_consistency")


def readability(m: Measured) -> float | None:
    return m.readability


def threshold_shortfall(thresholds: Mapping[str, float], latency_ceiling: float | None = None
                        ) -> Callable[[Measured], float | None]:
    """Minus how far the rates and readability fall short of their promotion thresholds, summed (a rate measured
    on no input counts in full; one not measured at all, as a race's screening rung leaves the rates, is left out),
    and how far the predicted latency ratio (``Measured.prompt_ratio``) passes ``latency_ceiling``: the gate's
    latency bar, known before any request is timed, since a longer prompt is a slower request."""
    bars = {name: bar for name, bar in thresholds.items() if name in (*RATES, "readability")}

    def shortfall(m: Measured, name: str, bar: float) -> float:
        if name == "readability":
            return 0.0 if m.readability is None else max(0.0, bar - m.readability)
        return max(0.0, bar - (m.rate(name) or 0.0)) if name in m.rates else 0.0

    def component(m: Measured) -> float | None:
        over = 0.0
        if latency_ceiling is not None and m.prompt_ratio is not None:
            over = max(0.0, m.prompt_ratio - latency_ceiling)
        return -sum(shortfall(m, name, bar) for name, bar in bars.items()) - over

    component.__name__ = "threshold_shortfall"
    return component


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


def components_for(rubrics, thresholds: Mapping[str, float] | None = None, latency_ceiling: float | None = None
                   ) -> dict[str, Callable[[Measured], float | None]]:
    """All reward components of a task: the fixed ones plus one per judge rubric."""
    out: dict[str, Callable[[Measured], float | None]] = {
        "task_metric": task_metric,
        "label_log_odds": label_log_odds,
        "instruction_following": instruction_following,
        "entity_consistency": entity_consistency,
        "readability": readability,
        "threshold_shortfall": threshold_shortfall(thresholds or {}, latency_ceiling),
        "robustness": robustness,
        "length": length,
    }
    for rubric in rubrics:
        if rubric in RATES:
            raise ValueError(f"judge rubric {rubric!r}: {rubric} is now measured as a rate over the target's answers, "
                             f"not asked of the judge; remove it from judge.rubrics (it stays a reward component)")
        if rubric in out:
            raise ValueError(f"judge rubric {rubric!r} has the name of a built-in component; rename it")
        out[rubric] = judge_component(rubric)
    return out
