"""The target's greedy answers, as an application receives them, and their cache.

Both answer paths (``LabelScorer.answer`` in-process, ``EndpointLabelScorer.answer`` over HTTP) return
``Answer``s, and both cache them by (template text, input text, token limit) in ``AnswerCache``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    """One greedy answer: its text, and whether it stopped at the token limit rather than at the model's end of
    sequence or as soon as the contract's parse was settled (``OutputContract.complete``)."""

    text: str
    truncated: bool
    tokens: int = 0  # new tokens generated (an endpoint's own count, where it gives one)


class AnswerCache:
    """Answers by (template text, input text, token limit, early stop); the least recently used leaves first."""

    def __init__(self, max_pairs: int = 50_000):
        self.max_pairs = max_pairs
        self._answers: OrderedDict[tuple, Answer] = OrderedDict()

    def lookup(self, key: tuple, texts) -> tuple[list[Answer | None], dict[str, list[int]]]:
        """The cached answers (None where missing) and the uncached texts, each with its indices."""
        out: list[Answer | None] = [None] * len(texts)
        todo: dict[str, list[int]] = {}
        for i, text in enumerate(texts):
            found = self._answers.get((*key, text))
            if found is None:
                todo.setdefault(text, []).append(i)
            else:
                self._answers.move_to_end((*key, text))
                out[i] = found
        return out, todo

    def put(self, key: tuple, text: str, answer: Answer) -> None:
        self._answers[(*key, text)] = answer
        if len(self._answers) > self.max_pairs:
            self._answers.popitem(last=False)

    def clear(self) -> None:
        self._answers.clear()
