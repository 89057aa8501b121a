"""Weighting: component values -> one total reward. Pure; checked against the components at start-up."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Mapping

from rewards.components import Measured

Component = Callable[[Measured], "float | None"]


@dataclass(frozen=True)
class Reward:
    total: float
    components: Mapping[str, float | None]  # every component's value, weighted or not; None = abstained
    valid: bool


def check_weights(weights: Mapping[str, float], components: Mapping[str, Component]) -> None:
    """Fail at start-up when weights and reward functions do not match, or a component has the wrong shape."""
    unknown = sorted(set(weights) - set(components))
    if unknown:
        raise ValueError(
            f"reward weights name unknown component(s) {unknown}; known components are {sorted(components)}"
        )
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward weight for {name!r} must be a finite number, got {weight!r}")
    if not any(weights.values()):
        raise ValueError("all reward weights are zero: nothing would be learned")
    for name, fn in components.items():
        try:
            inspect.signature(fn).bind(Measured(template="", valid=True))
        except TypeError as exc:
            raise TypeError(f"reward component {name!r} must accept one Measured argument: {exc}") from None


def weigh(m: Measured, weights: Mapping[str, float], components: Mapping[str, Component], invalid_penalty: float) -> Reward:
    """Weighted sum of the components that did not abstain (a None counts as missing, not as zero).

    An invalid candidate gets ``invalid_penalty`` and no component values.
    """
    if not m.valid:
        return Reward(invalid_penalty, {name: None for name in components}, False)
    values = {name: fn(m) for name, fn in components.items()}
    total = sum(weights[name] * value for name, value in values.items() if name in weights and value is not None)
    return Reward(float(total), values, True)
