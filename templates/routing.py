"""Sticky A/B routing between a task's ``production`` and ``canary`` templates.

A caller key (a user or account id) hashes, together with the task, into one of 10,000 buckets;
the canary takes the buckets below ``share * 10,000``. The hash is blake2b, not Python's ``hash``,
which is salted per process: every process and every restart must send a key the same way.
Because the cut is "bucket below a threshold", raising the share only adds keys to the canary;
no key flips back and forth while a ramp advances. The store persists the state.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

BUCKETS = 10_000
DEFAULT_RAMP = (0.05, 0.20, 1.0)
MAX_RAMP_STEPS = 20  # an operator advances each step by hand: more steps than this are a mistake, not a plan


def bucket(task: str, key: str) -> int:
    """The caller's bucket in ``range(BUCKETS)`` for this task; the same in every process."""
    digest = hashlib.blake2b(f"{task}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def takes_canary(task: str, key: str, share: float) -> bool:
    """Whether the caller ``key`` is routed to the canary when it gets ``share`` of the traffic."""
    # round(): 0.29 * 10_000 is 2899.9999999999995 in floating point.
    return bucket(task, key) < round(share * BUCKETS)


@dataclass(frozen=True)
class Canary:
    """A canary version, the share of callers it gets now, and the steps the share ramps through."""

    version_id: int
    share: float
    ramp: tuple[float, ...] = DEFAULT_RAMP

    def __post_init__(self) -> None:
        object.__setattr__(self, "ramp", tuple(float(step) for step in self.ramp))
        if not (isinstance(self.share, (int, float)) and 0 <= self.share <= 1):
            raise ValueError(f"canary share {str(self.share)[:20]} must be a fraction between 0 and 1, e.g. 0.05")
        steps = self.ramp
        if len(steps) > MAX_RAMP_STEPS:
            raise ValueError(f"canary ramp has {len(steps)} steps, more than {MAX_RAMP_STEPS}; give fewer, "
                             "e.g. [0.05, 0.2, 1.0]")
        if not steps or any(not math.isfinite(s) or not 0 < s <= 1 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"canary ramp {list(steps)} must be increasing fractions in (0, 1], e.g. [0.05, 0.2, 1.0]")

    def advance(self) -> "Canary":
        """The next step of the ramp above the current share."""
        later = [step for step in self.ramp if step > self.share]
        if not later:
            raise ValueError(
                f"the canary ramp is complete at {self.share:.0%}; promote version {self.version_id} to end it"
            )
        return Canary(self.version_id, later[0], self.ramp)
