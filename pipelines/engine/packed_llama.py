"""The Llama decoder's forward pass over a packed row, written out for label scoring.

``pipelines.engine.target.LabelScorer`` packs the example suffixes of a batch end to end and runs them through the
target model. For Llama-architecture models (the embedded SmolLM2 among them) this module runs that forward
pass with the model's own weights and modules for the numerics (embeddings, rotary tables, norms), in the
same order of operations as transformers' ``LlamaDecoderLayer`` -- the tests check that the two paths give
equal hidden states -- but with less work around the matrix products, which is where a CPU forward pass of a
small model loses its time:

* q, k and v come from one matrix product into one buffer whose first rows hold the shared prefix's keys
  and values and whose last row is zero (the padding row), rotary embeddings are applied in place;
* each attention bucket reads its queries, keys and values from that buffer with one gather each (no
  concatenation of the prefix per bucket), with the query heads that share a key/value head stacked along
  the sequence axis (grouped-query attention as a longer query, not repeated keys);
* the results are written straight back to the packed row's order;
* the last layer computes attention and MLP for each sequence's last token only (the only hidden state
  label scoring reads); keys and values still come from every token;
* every matrix product runs in parts of a fixed row count and attention keys are padded to a multiple of 32
  (``by_rows``, ``aligned_width``), so a text's result is the same bits alone or in any batch.

The same pass starts greedy answers (``greedy``): it keeps every layer's keys and values, its last hidden states
give each answer's first token (and the label log-probs ``score`` reads), and each further token is one pass of
the running answers over the same weights, attending to the kept rows. So the prompt runs once for both the
label log-probs and the answer.

Any model this does not cover (``unsupported_reason``) is scored by transformers' own forward pass with
packed attention routed through its ``AttentionInterface`` (``pipelines.engine.target``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pipelines.engine.packing import Packing


def decoder_of(model):
    """The decoder stack of a causal LM (``model.model`` for Llama), or None."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


def config_unsupported_reason(config) -> str | None:
    """None if a model of this configuration (a transformers ``PretrainedConfig``) is one ``PackedLlama`` is
    written for; otherwise why not. What can be told before loading the weights (``unsupported_reason`` checks the
    loaded model)."""
    if getattr(config, "model_type", None) != "llama":
        return f"model type {getattr(config, 'model_type', None)!r} is not llama"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "projections with bias"
    return None


def unsupported_reason(model) -> str | None:
    """None if ``PackedLlama`` can run ``model``; otherwise why not."""
    if next(model.parameters()).device.type != "cpu":
        return "written for CPU; on an accelerator transformers' own kernels serve"
    reason = config_unsupported_reason(model.config)
    if reason is not None:
        return reason
    body = decoder_of(model)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if body is None or not all(hasattr(body, name) for name in needed):
        return "decoder without embed_tokens/rotary_emb/norm/layers"
    for layer in body.layers:  # adapters (LoRA) or quantized layers would be skipped by reading .weight
        projections = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        if any(type(p) is not torch.nn.Linear for p in projections):
            return "projections that are not plain torch.nn.Linear (adapters or quantized layers)"
    return None


class PackedLlama:
    """A packed-row forward pass for one frozen Llama model (the target or the judge: its weights are read
    once). Holds copies of the layers' weights: q/k/v fused, the others in oneDNN's blocked layout."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"PackedLlama cannot run this model: {reason}")
        config = model.config
        self.body = decoder_of(model)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.lm_head = model.get_output_embeddings()  # the full vocabulary, for greedy answers' next tokens
        self.layers = []
        for layer in self.body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "qkv": _Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                "o": _Linear(attn.o_proj.weight), "gate": _Linear(mlp.gate_proj.weight),
                "up": _Linear(mlp.up_proj.weight), "down": _Linear(mlp.down_proj.weight), "scaling": attn.scaling,
                "norm1": (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                "norm2": (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            })

    @torch.inference_mode()
    def forward(self, packing: Packing, prefix_rows: list[torch.Tensor] | None, keep: list | None = None):
        """One pass over the packed row after the known ``prefix_rows``: the final-normed hidden state at
        each sequence's last token (sequences, hidden), None if the row is only a head; and per layer the
        head's buffer rows (``Packing.build``'s ``head``: the rest of the prefix, run in the same matrix
        products as the sequences instead of a pass of its own; empty without a head). ``keep``: a list that
        gets each layer's key/value rows (known prefix, row, zero row), for ``greedy``."""
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        G = H // KV
        ids = packing.ids[0]
        N = len(ids)
        P = 0 if prefix_rows is None else len(prefix_rows[0])
        n_head = packing.n_head
        h = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(h, packing.positions)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # (N, 1, D)
        half = D // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # the sign of rotate_half, moved onto sin
        # Index tensors for the gathers, once per forward pass. Buffer rows: [known prefix | row tokens (the
        # head's first) | zero row]; buffer columns: [q heads | k heads | v heads]. A bucket attends to the
        # first `visible` buffer rows (the known prefix, and the head unless it is the head) and to itself.
        # Queries are read a key/value group at a time, the group's heads side by side, so a bucket's queries
        # are (S, KV, L * G, D): row l * G + g. Rows are gathered with index_select (several times faster
        # than advanced indexing here).
        plan = []
        for gather, mask in packing.buckets:
            S, L = gather.shape
            visible = mask.shape[1] - L
            rows = gather + P  # padding (N) -> P + N, the zero row
            extra = aligned_width(visible + L) - visible - L  # more zero-row keys, masked: see aligned_width
            kv_rows = torch.cat([torch.arange(visible).expand(S, visible), rows,
                                 torch.full((S, extra), P + N)], 1)  # (S, aligned visible + L)
            lengths = (gather != N).sum(1)
            mask = torch.cat([mask, mask.new_zeros(L, extra)], 1)
            bias = torch.zeros(mask.shape, dtype=h.dtype).masked_fill_(~mask, float("-inf"))  # SDPA's own conversion, once
            plan.append((rows, kv_rows, bias.repeat_interleave(G, 0), lengths))
        last = packing.last
        head_rows: list[torch.Tensor] = []
        buffer = h.new_zeros(P + N + 1, (H + 2 * KV) * D)
        for index, w in enumerate(self.layers):
            final = index == len(self.layers) - 1
            x = _rms_norm(h, *w["norm1"])
            if P:
                buffer[:P, H * D:] = prefix_rows[index]
            by_rows(w["qkv"], x, TOKEN_ROWS, out=buffer[P:P + N])
            _rotary_(buffer[P:P + N, : (H + KV) * D].view(N, H + KV, D), cos, sin)
            if n_head:
                head_rows.append(buffer[P:P + n_head, H * D:].clone())
            if keep is not None:
                keep.append(buffer[:, H * D:].clone())
            if final and not len(last):
                return None, head_rows
            q_part = buffer[:, : H * D]
            kv_part = buffer[:, H * D:]
            # The last layer: attention (and then the MLP) for each sequence's last token only.
            # row N: bucket padding
            attn = x.new_empty(len(last), KV, G, D) if final else x.new_empty(N + 1, H * D)
            done = 0
            for rows, kv_rows, mask, lengths in plan[1:] if final and n_head else plan:
                S, width = kv_rows.shape
                kv = kv_part.index_select(0, kv_rows.flatten()).view(S, width, 2, KV, D)
                kv = kv.permute(0, 2, 3, 1, 4)  # (S, 2, KV, width, D)
                if final:
                    q = q_part.index_select(0, rows[torch.arange(S), lengths - 1]).view(S, KV, G, D)
                    valid = (kv_rows != P + N).view(S, 1, 1, width)
                    out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=valid, scale=w["scaling"])
                    attn[done:done + S] = out
                    done += S
                else:
                    L = rows.shape[1]
                    q = q_part.index_select(0, rows.flatten()).view(S, L, KV, G * D).transpose(1, 2)
                    q = q.reshape(S, KV, L * G, D)
                    out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=mask, scale=w["scaling"])
                    out = out.view(S, KV, L, G * D).transpose(1, 2).reshape(S * L, H * D)
                    attn.index_copy_(0, (rows - P).flatten(), out)  # padding rows all land on row N
            if final:
                h, attn, part_rows = h[last], attn.view(len(last), H * D), SEQUENCE_ROWS
            else:
                attn, part_rows = attn[:N], TOKEN_ROWS
            h = h + by_rows(w["o"], attn, part_rows)
            x = _rms_norm(h, *w["norm2"])
            gate = by_rows(w["gate"], x, part_rows)
            F.silu(gate, inplace=True)
            h = h + by_rows(w["down"], gate.mul_(by_rows(w["up"], x, part_rows)), part_rows)
        return self.body.norm(h), head_rows

    @torch.inference_mode()
    def greedy(self, packing: Packing, kept: list[torch.Tensor], last_hidden: torch.Tensor, max_new_tokens: int,
               take: Callable[[int, int, int], bool]) -> int:
        """Greedy decoding of the packed row's sequences after ``forward(packing, ..., keep=kept)``, whose last
        hidden states (``last_hidden``) give each sequence's first new token. ``take(j, token, step)`` receives
        sequence j's token of that step and says whether its answer is finished (the end of sequence, a settled
        parse, the token limit); the others run one more pass together, each attending to its prompt's kept
        rows and its own new tokens. Tokens run, for the scorer's counts."""
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        G = H // KV
        S, N = len(packing.last), packing.ids.shape[1]
        zero = kept[0].shape[0] - 1  # the zero row, after the known prefix and the row
        visible = zero - N + packing.n_head  # the prefix rows every sequence attends to
        room = S * max(0, max_new_tokens - 1)  # rows for the new tokens (the last one is never run)
        kv = [torch.cat([rows, rows.new_zeros(room, rows.shape[1])]) for rows in kept]
        kept.clear()
        # each sequence's key/value rows: the prefix, then its own tokens (padded with the zero row)
        lengths = torch.diff(packing.last, prepend=torch.tensor([packing.n_head - 1])).tolist()
        own = torch.full((S, visible + max(lengths)), zero, dtype=torch.long)
        own[:, :visible] = torch.arange(visible)
        for j, (end, length) in enumerate(zip(packing.last.tolist(), lengths)):
            own[j, visible:visible + length] = zero - N + torch.arange(end - length + 1, end + 1)
        position = packing.positions[0, packing.last] + 1
        running = torch.arange(S)
        tokens = by_rows(self.lm_head, last_hidden, SEQUENCE_ROWS).argmax(-1)
        half, run = D // 2, 0
        for step in range(max_new_tokens):
            keep = [r for r, (j, token) in enumerate(zip(running.tolist(), tokens.tolist())) if not take(j, token, step)]
            if not keep or step == max_new_tokens - 1:
                break
            running, tokens = running[keep], tokens[keep]
            R = len(running)
            new_rows = zero + 1 + step * S + running
            index = torch.cat([own[running], zero + 1 + torch.arange(step + 1) * S + running[:, None]], 1)
            index = torch.cat([index, index.new_full((R, aligned_width(index.shape[1]) - index.shape[1]), zero)], 1)
            valid = (index != zero).view(R, 1, 1, -1)
            h = self.body.embed_tokens(tokens)
            cos, sin = self.body.rotary_emb(h, (position[running] + step).view(1, R))
            cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
            sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            for index_l, w in enumerate(self.layers):
                x = _rms_norm(h, *w["norm1"])
                qkv = by_rows(w["qkv"], x, SEQUENCE_ROWS)
                _rotary_(qkv[:, : (H + KV) * D].view(R, H + KV, D), cos, sin)
                kv[index_l][new_rows] = qkv[:, H * D:]
                rows = kv[index_l].index_select(0, index.flatten()).view(R, -1, 2, KV, D).permute(0, 2, 3, 1, 4)
                out = F.scaled_dot_product_attention(qkv[:, : H * D].reshape(R, KV, G, D), rows[:, 0], rows[:, 1],
                                                     attn_mask=valid, scale=w["scaling"])
                h = h + by_rows(w["o"], out.reshape(R, H * D), SEQUENCE_ROWS)
                x = _rms_norm(h, *w["norm2"])
                gate = by_rows(w["gate"], x, SEQUENCE_ROWS)
                F.silu(gate, inplace=True)
                h = h + by_rows(w["down"], gate.mul_(by_rows(w["up"], x, SEQUENCE_ROWS)), SEQUENCE_ROWS)
            tokens = by_rows(self.lm_head, self.body.norm(h), SEQUENCE_ROWS).argmax(-1)
            run += R
        return run


TOKEN_ROWS = 128  # the prompt pass's products, over every token of the packed row
SEQUENCE_ROWS = 16  # one row per sequence: the last layer's last tokens, the greedy steps, the label readout


def by_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``product(x)``, ``rows`` rows of ``x`` at a time, the last part filled out with zero rows (into ``out`` if
    given).

    So that a text's scores do not depend on the batch it runs in (the stored held-out figure is what an
    application scoring one text at a time gets). oneDNN picks a bfloat16 matrix product's blocking by its row
    count and thread count, and a row's result changes with it: on an Intel AMX machine the same row of the
    embedded model's products moved by up to 0.25 between row counts. Called with one fixed row count, each row
    came out bitwise the same whatever the other rows held, at 16 to 128 rows on one thread or two (at 256 rows
    the MLP's down projection split its sum differently on two threads). The price, measured there on one
    thread: a layer's five products over 1,024 rows took 9.7 ms in 128-row parts against 6.0 ms in one call,
    and a text scored alone runs at least 128 rows."""
    n = len(x)
    if not n:
        return product(x) if out is None else out
    for start in range(0, n, rows):
        part = x[start:start + rows]
        if len(part) < rows:
            part = torch.cat([part, part.new_zeros(rows - len(part), x.shape[1])])
        y = product(part)
        if out is None:
            out = y.new_empty(n, y.shape[1])
        out[start:start + rows] = y[: min(rows, n - start)]
    assert out is not None  # n > 0: the loop ran
    return out


ATTENTION_ALIGN = 32


def aligned_width(width: int) -> int:
    """``width`` keys rounded up to a multiple of ``ATTENTION_ALIGN``; the added keys are the zero row, masked.

    The other half of ``by_rows``: a bucket's attention reads keys as wide as its longest sequence, and torch's CPU
    attention in bfloat16 rounds by width (on an Intel AMX machine a sequence's output moved by up to 0.008 with
    the number of masked keys after it). At widths that are multiples of 32 the output was bitwise the same
    whatever the padding and the number of query rows (40 random sequences of 20-700 keys, 3 paddings each, with
    and without a causal mask; multiples of 16 were not enough). Costs at most 31 masked keys per bucket."""
    return -(-width // ATTENTION_ALIGN) * ATTENTION_ALIGN


class _Linear:
    """``F.linear(x, weight)``; for bfloat16 weights through oneDNN with the weight reordered once into its
    blocked layout (what torch's own call does on every call): the same results, a few percent faster."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().contiguous()
        self.packed = None
        if weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1024)
            except (AttributeError, RuntimeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32 (what F.rms_norm does inside for bfloat16 input, with the same
    results as upcasting first), rounded back, then scaled."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps).mul_(weight)


def _rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotary embedding in place: transformers' ``q * cos + rotate_half(q) * sin`` with the negation of
    rotate_half folded into ``signed_sin`` (the same products: (-a) * b == a * (-b) exactly)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos).add_(swapped.mul_(signed_sin))
