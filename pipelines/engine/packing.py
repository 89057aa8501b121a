"""The layout of a packed batch: the example suffixes of one template laid end to end in one row.

Both forward paths of ``pipelines.engine.target.LabelScorer`` read it: transformers' own forward pass with the packed
attention function, and the written-out Llama pass of ``pipelines.engine.packed_llama``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass
class Packing:
    """Sequences laid end to end in one row of ``ids`` (what the matrix products see: no padding), and,
    for attention, the same tokens regrouped per sequence into buckets of similar length (little padding)."""

    ids: torch.Tensor  # (1, N) all tokens
    positions: torch.Tensor  # (1, N) each token's position in its own prompt (after the prefix)
    last: torch.Tensor  # (S,) index in the row of each sequence's last token
    buckets: list[tuple[torch.Tensor, torch.Tensor]]  # per bucket: (S_b, L_b) row index of each
    #   (sequence, position), N (a zero row) for padding; and the (L_b, visible + L_b) mask: all of the
    #   visible prefix (the computed prefix, and the head for the sequences' buckets), then causal within
    scatter: torch.Tensor  # (N,) index of each row token in the buckets' outputs, flattened and concatenated
    n_head: int = 0  # the row's first tokens: the rest of the shared prefix, run in this pass (see ``build``)

    @classmethod
    def build(cls, seqs: list[list[int]], n_prefix: int, slack: float = 1.25, head: Sequence[int] = ()) -> "Packing":
        """``seqs`` sorted by length, following a shared prefix of ``n_prefix`` tokens already computed; a
        bucket closes when a sequence is ``slack`` times its first one.

        ``head``: more of the shared prefix, not computed yet. Its tokens lead the row and form the first
        bucket (they attend to the ``n_prefix`` tokens and causally to themselves), and every sequence
        attends to them as part of its prefix: a bucket's mask is (L_b, visible prefix + L_b)."""
        n_head = len(head)
        lengths = [len(s) for s in seqs]
        starts = n_head + np.cumsum([0] + lengths[:-1], dtype=np.int64)[: len(seqs)]
        n = n_head + int(sum(lengths))
        scatter = np.zeros(n, dtype=np.int64)
        buckets, flat_offset = [], 0

        def bucket(gather: np.ndarray, visible: int):
            width = gather.shape[1]
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = torch.cat([torch.ones(width, visible, dtype=torch.bool), causal], dim=1)
            buckets.append((torch.from_numpy(gather), mask))

        if n_head:
            bucket(np.arange(n_head, dtype=np.int64).reshape(1, n_head), n_prefix)
            scatter[:n_head] = np.arange(n_head)
            flat_offset = n_head
        first = 0
        for j in range(1, len(seqs) + 1):
            if j < len(seqs) and lengths[j] <= slack * lengths[first]:
                continue
            width = max(lengths[first:j])
            gather = np.full((j - first, width), n, dtype=np.int64)
            for r, k in enumerate(range(first, j)):
                gather[r, : lengths[k]] = starts[k] + np.arange(lengths[k])
                scatter[starts[k] : starts[k] + lengths[k]] = flat_offset + r * width + np.arange(lengths[k])
            bucket(gather, n_prefix + n_head)
            flat_offset += (j - first) * width
            first = j
        # positions: the head's continue the prefix; each sequence's continue the head's
        within = np.concatenate([np.arange(n_head), *(n_head + np.arange(length) for length in lengths)])
        return cls(
            ids=torch.tensor([[*head, *(t for s in seqs for t in s)]]),
            positions=torch.from_numpy(n_prefix + within).unsqueeze(0),
            last=torch.from_numpy(starts + np.array(lengths, dtype=np.int64) - 1),
            buckets=buckets,
            scatter=torch.from_numpy(scatter),
            n_head=n_head,
        )
