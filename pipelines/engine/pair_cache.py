"""The (template, example) result cache of the label scorers, in-process and over HTTP alike."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class PairCache:
    """Label log-probs by (template text, example text); the least recently used pair leaves first."""

    def __init__(self, max_pairs: int = 200_000):
        self.max_pairs = max_pairs
        self._rows: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()

    def lookup(self, template_text: str, texts, out: np.ndarray) -> tuple[dict[str, list[int]], int]:
        """Fill ``out[i]`` for every cached pair; return the uncached texts (each with its indices) and the hits."""
        todo: dict[str, list[int]] = {}
        hits = 0
        for i, text in enumerate(texts):
            row = self._rows.get((template_text, text))
            if row is None:
                todo.setdefault(text, []).append(i)
            else:
                self._rows.move_to_end((template_text, text))
                out[i] = row
                hits += 1
        return todo, hits

    def put(self, template_text: str, text: str, row: np.ndarray) -> None:
        self._rows[(template_text, text)] = row
        if len(self._rows) > self.max_pairs:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)
