"""The layout of a packed batch: the example suffixes of one template laid end to end in one row.

Both forward paths of ``pipelines.engine.target.LabelScorer`` read it: transformers' own forward pass with the packed
attention function, and the written-out Llama pass of ``pipelines.engine.packed_llama``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


def padded_rows(n: int) -> int:
    """``n`` rounded up to one of a few row counts: to a multiple of 16 up to 64 rows, then of an eighth of the
    power of two below ``n`` (at most 12.5% more rows, eight sizes per doubling).

    oneDNN builds a bfloat16 matrix product's kernel for each new row count and keeps it: measured on 2 AVX-512
    cores, a (M, 576) x (576, 1536) product took 7.6 ms at a row count it had not seen against 0.47 ms at one it
    had. Scoring requests as they come (the gateway, a drift check) meets a new row count on nearly every batch,
    and the model's 30 layers paid that for every product; with row counts from this short list, a replica's
    kernels are all built after its first few batches. The tuning loop's scoring gains nothing from it (12 new
    templates on 60 dev examples: 22.4-22.9 s unpadded, 22.8-23.5 s padded, three pairs, same machine), so only
    serving scorers pad (``LabelScorer.pad_rows``)."""
    if n <= 64:
        return -(-n // 16) * 16
    step = 1 << (n.bit_length() - 4)  # an eighth of the power of two at or below n
    return -(-n // step) * step


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
    n_pad: int = 0  # rows after the sequences that belong to none (``build``'s ``pad``): zeros, never attended to

    @classmethod
    def build(cls, seqs: list[list[int]], n_prefix: int, slack: float = 1.25, head: Sequence[int] = (),
              pad: bool = False) -> "Packing":
        """``seqs`` sorted by length, following a shared prefix of ``n_prefix`` tokens already computed; a
        bucket closes when a sequence is ``slack`` times its first one.

        ``head``: more of the shared prefix, not computed yet. Its tokens lead the row and form the first
        bucket (they attend to the ``n_prefix`` tokens and causally to themselves), and every sequence
        attends to them as part of its prefix: a bucket's mask is (L_b, visible prefix + L_b).

        ``pad``: the row is filled out to ``padded_rows`` tokens with rows that no sequence attends to (the written-out
        pass only: transformers' pass reads ``scatter``, which has no place for them)."""
        n_head = len(head)
        lengths = [len(s) for s in seqs]
        starts = n_head + np.cumsum([0] + lengths[:-1], dtype=np.int64)[: len(seqs)]
        n_real = n_head + int(sum(lengths))
        n = padded_rows(n_real) if pad else n_real
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
        within = np.concatenate([np.arange(n_head), *(n_head + np.arange(length) for length in lengths),
                                 np.zeros(n - n_real, dtype=np.int64)])
        return cls(
            ids=torch.tensor([[*head, *(t for s in seqs for t in s), *[0] * (n - n_real)]]),
            positions=torch.from_numpy(n_prefix + within).unsqueeze(0),
            last=torch.from_numpy(starts + np.array(lengths, dtype=np.int64) - 1),
            buckets=buckets,
            scatter=torch.from_numpy(scatter),
            n_head=n_head,
            n_pad=n - n_real,
        )
