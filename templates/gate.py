"""The promotion gate: a pure function from measurements to a decision and its reasons.

``decide`` runs every check and reports each one, passed or failed, so a refused candidate
shows all of its problems at once and a promoted one shows what it cleared. Each check can
refuse on its own. A figure that is missing or NaN fails its check: ``not (value >= bar)``
is used instead of ``value < bar`` so that NaN never slips through a comparison.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Sequence


@dataclass(frozen=True)
class PromotionConfig:
    """Bars a candidate template must clear before it can become ``production``. No defaults here: a task's
    bars come from its task file (``pipelines.config.PromotionSettings`` holds the defaults)."""

    thresholds: Mapping[str, float]  # minimum held-out score per reward component
    metric: str  # the held-out metric compared with the incumbent's
    min_improvement: float  # the candidate must beat the incumbent's held-out metric by at least this much
    max_template_tokens: int
    max_latency_p95_increase: float  # fraction: 0.2 allows a p95 up to 1.2x the incumbent's
    max_render_us: float  # p99 of one render, in microseconds
    max_error_rate: float  # fraction of requests that failed

    def __post_init__(self) -> None:
        for name, minimum in self.thresholds.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"promotion thresholds: component name {name!r} must be a non-empty string")
            if isinstance(minimum, bool) or not isinstance(minimum, (int, float)) or not math.isfinite(minimum):
                raise ValueError(f"promotion thresholds: {name} minimum {minimum!r} must be a finite number, e.g. 0.8")
        # A read-only copy: a frozen config must not change because the caller's dict did.
        object.__setattr__(self, "thresholds", MappingProxyType(dict(self.thresholds)))
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError("promotion metric must name the held-out metric, e.g. 'balanced_accuracy'")
        if not (self.min_improvement >= 0):
            raise ValueError(
                f"promotion min_improvement={self.min_improvement} must be >= 0; use 0 to accept any non-regression"
            )
        if isinstance(self.max_template_tokens, bool) or not isinstance(self.max_template_tokens, int) or (
            self.max_template_tokens < 1
        ):
            raise ValueError(f"promotion max_template_tokens={self.max_template_tokens!r} must be a positive integer")
        if not (self.max_latency_p95_increase >= 0):
            raise ValueError(
                f"promotion max_latency_p95_increase={self.max_latency_p95_increase} is a fraction and must be >= 0,"
                " e.g. 0.2 for +20%"
            )
        if not (self.max_render_us > 0):
            raise ValueError(f"promotion max_render_us={self.max_render_us} must be > 0 microseconds, e.g. 80")
        if not (0 <= self.max_error_rate <= 1):
            raise ValueError(f"promotion max_error_rate={self.max_error_rate} is a fraction between 0 and 1, e.g. 0.02")


@dataclass(frozen=True)
class Measurements:
    """What was measured for one template (the candidate or the incumbent)."""

    components: Mapping[str, float]  # reward component -> mean score
    heldout_metric: float  # the config's ``metric`` on the held-out split
    template_tokens: int
    latency_p95_ms: float  # over successful calls only: a fast failure would flatter it, a timeout swamp it
    error_rate: float  # errored calls / all calls; errored calls are gated here, not in the p95
    render_us_p99: float


@dataclass(frozen=True)
class Decision:
    promote: bool
    reasons: tuple[str, ...]  # one line per check, each starting with "pass:" or "fail:"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def decide(candidate: Measurements, incumbent: Measurements | None, config: PromotionConfig) -> Decision:
    """Whether ``candidate`` may replace ``incumbent`` (None when the task has no production template yet)."""
    checks: list[tuple[bool, str]] = []

    for name, minimum in config.thresholds.items():
        value = candidate.components.get(name)
        value = math.nan if value is None else value  # an abstaining or missing component fails its bar
        ok = value >= minimum
        checks.append((ok, f"{name} {value:.4g} {'>=' if ok else '<'} {minimum:.4g}"))

    if incumbent is None:
        checks.append((True, f"{config.metric}: no incumbent, nothing to improve on"))
    else:
        gain = candidate.heldout_metric - incumbent.heldout_metric
        ok = gain >= config.min_improvement
        checks.append((
            ok,
            f"{config.metric} {candidate.heldout_metric:.4g} vs incumbent {incumbent.heldout_metric:.4g}: "
            f"gain {gain:+.4g} {'>=' if ok else '<'} required {config.min_improvement:.4g}",
        ))

    ok = candidate.template_tokens <= config.max_template_tokens
    checks.append((ok, f"template_tokens {candidate.template_tokens} {'<=' if ok else '>'} {config.max_template_tokens}"))

    # Shaped like the held-out check above (no incumbent passes), with its own rule: a ceiling, not a gain.
    if incumbent is None:
        checks.append((True, f"latency_p95_ms {candidate.latency_p95_ms:.4g}: no incumbent to compare with"))
    else:
        limit_ms = incumbent.latency_p95_ms * (1 + config.max_latency_p95_increase)
        ok = candidate.latency_p95_ms <= limit_ms
        checks.append((
            ok,
            f"latency_p95_ms {candidate.latency_p95_ms:.4g} {'<=' if ok else '>'} {limit_ms:.4g} "
            f"(incumbent {incumbent.latency_p95_ms:.4g} +{config.max_latency_p95_increase:.0%})",
        ))

    ok = candidate.render_us_p99 <= config.max_render_us
    checks.append((ok, f"render_us_p99 {candidate.render_us_p99:.4g} {'<=' if ok else '>'} {config.max_render_us:.4g}"))

    ok = candidate.error_rate <= config.max_error_rate
    checks.append((ok, f"error_rate {candidate.error_rate:.4g} {'<=' if ok else '>'} {config.max_error_rate:.4g}"))

    return Decision(
        promote=all(ok for ok, _ in checks),
        reasons=tuple(f"{'pass' if ok else 'fail'}: {text}" for ok, text in checks),
    )
