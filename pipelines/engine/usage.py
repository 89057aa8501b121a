"""What a run asks of its models: calls, prompt tokens and completion tokens, per role.

One **call** is one request a served model would bill: one prompt run through the target or the judge (a
label read, or a greedy answer), or one instruction sampled from the policy. The same unit counts on both
sides: ``EndpointLabelScorer`` counts the HTTP requests a server answered (and the token counts its ``usage``
reports); ``LabelScorer`` counts the prompts it ran (a cached pair is free on both). A local answer reads the
labels in the same pass, so it is one call; a server returns either log-probs or an answer, so there it is two.

``Metered`` wraps a label scorer for one role. The target and the judge may share one scorer (and its cache);
each role's ``Metered`` still counts only the calls made through it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import numpy as np

    from pipelines.engine.answers import Answer
    from pipelines.engine.scorer import Scorer
    from templates.template import Template

ROLES = ("target", "judge", "policy")


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, calls: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.calls += calls
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.calls + other.calls, self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.calls - other.calls, self.prompt_tokens - other.prompt_tokens,
                     self.completion_tokens - other.completion_tokens)

    def copy(self) -> Usage:
        return Usage(self.calls, self.prompt_tokens, self.completion_tokens)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Usage:
        data = data or {}
        return cls(int(data.get("calls", 0)), int(data.get("prompt_tokens", 0)), int(data.get("completion_tokens", 0)))


def sum_usage(*parts: dict) -> dict[str, Usage]:
    """Role -> Usage, added over ``parts`` (each role -> Usage, or its dict as kept in JSON)."""
    total: dict[str, Usage] = {}
    for part in parts:
        for role, usage in part.items():
            usage = usage if isinstance(usage, Usage) else Usage.from_dict(usage)
            total[role] = total.get(role, Usage()) + usage
    return total


class Metered:
    """A label scorer seen by one role (a ``pipelines.engine.scorer.Scorer`` around one): every call through it
    adds what the scorer spent to ``usage``.

    The scorer's own ``usage`` is cumulative; the difference around each call is this role's share. Calls
    through one scorer run one at a time per process (``score`` is not re-entrant), so the difference is exact.
    """

    def __init__(self, inner: Scorer):
        self.inner = inner
        self.usage = Usage()
        self._lock = threading.Lock()

    def _metered(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self.inner, "usage"):  # a scripted stand-in in a unit test: nothing to count
            return fn(*args, **kwargs)
        before = self.inner.usage.copy()
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.usage = self.usage + (self.inner.usage - before)

    @property
    def verbalizers(self) -> list[str]:
        return self.inner.verbalizers

    def score(self, template: Template, texts: Sequence[str]) -> np.ndarray:
        return self._metered(self.inner.score, template, texts)

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int,
               complete: Callable[[str], bool] | None = None) -> list[Answer]:
        return self._metered(self.inner.answer, template, texts, max_new_tokens, complete)

    def request_latency_ms(self, template: Template, texts: Sequence[str], n: int = 12) -> dict[str, float]:
        return self._metered(self.inner.request_latency_ms, template, texts, n)

    def __getattr__(self, name: str) -> Any:  # stats, base_url, ...: the scorer's own
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
