"""The target model as a classifier: label scores for (template, example) pairs.

A pair is scored by the target's next-token logits for the first token of each label's verbalizer
(pooled over its capitalisations: "yes", "Yes", " yes", ...) after the rendered prompt (inside the
model's chat template). The scores returned are log-probabilities
normalised over the task's labels, so "P(yes) vs P(no)" is ``scores[:, yes] - scores[:, no]``.

``score_naive`` is the reference: one unbatched forward pass per pair over the whole prompt, logits at
every position over the whole vocabulary. ``LabelScorer.score`` computes the same numbers with less work:

* the part of the prompt that is the same for every example of a template (chat header, system prompt,
  instruction) is run once and its key/value cache reused for every example;
* each batch runs only the example-specific suffixes, sorted by length so little is padding;
* hidden states become logits only at each row's last position and only for the label tokens;
* results are cached by (template, example), so a template seen again costs nothing.

Equivalence: the shared prefix is cut on a token boundary of the full prompt's own tokenization (checked
for every example; an example whose tokens differ there is scored without sharing), so both paths feed the
model identical token ids. In float32 they agree to about 1e-4. In bfloat16, padding changes the shape of the
matrix products and so their rounding, and the naive path's logits are themselves rounded to bfloat16 (this
path projects onto the label rows in float32): scores differ by up to about 0.3 in log-odds (see the tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from pipelines.models import LoadedLM
from pipelines.pair_cache import PairCache
from templates.template import Template

_SENTINEL = "\u2063TUNE_PROMPTS_INPUT\u2063"


@dataclass
class ScorerStats:
    pairs_scored: int = 0  # computed by a forward pass
    pairs_cached: int = 0  # answered from the cache
    tokens_forward: int = 0  # tokens run through the model (prefixes once, suffixes per pair, padding included)
    prefix_fallbacks: int = 0  # examples whose tokenization did not share the template's prefix
    seconds: float = 0.0
    forward_s: list[float] = field(default_factory=list)  # per-batch wall time, for latency figures

    def as_dict(self) -> dict:
        return {
            "pairs_scored": self.pairs_scored,
            "pairs_cached": self.pairs_cached,
            "tokens_forward": self.tokens_forward,
            "prefix_fallbacks": self.prefix_fallbacks,
            "seconds": round(self.seconds, 4),
        }


def label_token_ids(tokenizer, verbalizers: list[str]) -> list[list[int]]:
    """For each verbalizer, the first tokens of the ways the model may start writing it: ``yes``, ``Yes``,
    ``YES``, with and without a leading space, where the whole form is one token (a first piece such as
    "Y" would also start unrelated words). Small chat models mostly answer "Yes"/"No" with a capital;
    counting only the lowercase token throws most of their signal away."""
    ids: list[list[int]] = []
    for word in verbalizers:
        variants = []
        for form in dict.fromkeys((word, word.capitalize(), word.upper(), word.lower())):
            for spaced in (form, " " + form):
                tokens = tokenizer.encode(spaced, add_special_tokens=False)
                if len(tokens) == 1 and tokens[0] not in variants:
                    variants.append(tokens[0])
        if not variants:  # no single-token form: fall back to the first token of the word as given
            tokens = tokenizer.encode(word, add_special_tokens=False)
            if not tokens:
                raise ValueError(f"verbalizer {word!r} encodes to no tokens")
            variants = [tokens[0]]
        ids.append(variants)
    flat = [t for variants in ids for t in variants]
    if len(set(flat)) != len(flat):
        raise ValueError(f"verbalizers {verbalizers} start with the same token; pick words that differ at the start")
    return ids


def label_logprobs(logits: torch.Tensor, label_ids: list[list[int]]) -> np.ndarray:
    """Log-probs over the labels from next-token logits: each label's variants pooled (log-sum-exp),
    then normalised over the labels. ``logits`` is (..., vocab) or already restricted to the flat ids."""
    logits = logits.float()
    pooled = torch.stack([torch.logsumexp(logits[..., ids], dim=-1) for ids in label_ids], dim=-1)
    return torch.log_softmax(pooled, dim=-1).numpy()


def prompt_frame(tokenizer, template: Template, chat_template: bool) -> tuple[str, str]:
    """The full prompt text before and after the template's input value."""
    (variable,) = template.variables
    # The template's constraints are for callers' values; the sentinel is ours, so render the bare text.
    text = Template(template.text, template.variables).render({variable: _SENTINEL})
    if chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    before, sentinel, after = text.partition(_SENTINEL)
    if not sentinel:
        raise ValueError("the chat template dropped the input; cannot score this template")
    return before, after


@torch.inference_mode()
def score_naive(lm: LoadedLM, template: Template, texts: list[str], verbalizers: list[str], chat_template: bool = True):
    """Reference scorer: one forward pass per pair over the whole prompt, full-vocabulary logits."""
    label_ids = label_token_ids(lm.tokenizer, verbalizers)
    before, after = prompt_frame(lm.tokenizer, template, chat_template)
    rows = []
    for text in texts:
        ids = lm.tokenizer(before + text + after, return_tensors="pt", add_special_tokens=False).input_ids
        logits = lm.model(input_ids=ids).logits[0, -1]
        rows.append(label_logprobs(logits, label_ids))
    return np.stack(rows) if rows else np.zeros((0, len(verbalizers)), dtype=np.float32)


class LabelScorer:
    """Fast label scoring for one target model and one label set. Not thread-safe; one per actor."""

    def __init__(
        self,
        lm: LoadedLM,
        verbalizers: list[str],
        *,
        chat_template: bool = True,
        batch_size: int = 16,
        cache_pairs: int = 200_000,
    ):
        self.lm = lm
        self.verbalizers = list(verbalizers)
        self.label_ids = label_token_ids(lm.tokenizer, self.verbalizers)
        self.chat_template = chat_template
        self.batch_size = batch_size
        self._cache = PairCache(cache_pairs)
        self.stats = ScorerStats()
        model = lm.model
        self._body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        # Only the label rows of the output layer are ever needed; kept in float32 so that the log-odds are
        # not rounded to bfloat16's steps (0.125 at typical logit sizes), which would tie many examples.
        flat = [t for ids in self.label_ids for t in ids]
        self._label_head = model.get_output_embeddings().weight[flat].detach().float()
        # label_ids re-indexed into the rows of _label_head
        self._head_index, start = [], 0
        for ids in self.label_ids:
            self._head_index.append(list(range(start, start + len(ids))))
            start += len(ids)
        self._pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0

    # --- public API ------------------------------------------------------------------------
    def score(self, template: Template, texts: list[str]) -> np.ndarray:
        """Label log-probs (normalised over the labels), shape (len(texts), n_labels)."""
        started = time.perf_counter()
        out = np.zeros((len(texts), len(self.label_ids)), dtype=np.float32)
        todo, hits = self._cache.lookup(template.text, texts, out)
        self.stats.pairs_cached += hits
        if todo:
            unique = list(todo)
            scored = self._score_uncached(template, unique)
            for text, row in zip(unique, scored):
                out[todo[text]] = row
                self._cache.put(template.text, text, row)
        self.stats.seconds += time.perf_counter() - started
        return out

    def clear_cache(self) -> None:
        self._cache.clear()

    # --- internals -------------------------------------------------------------------------

    @torch.inference_mode()
    def _score_uncached(self, template: Template, texts: list[str]) -> np.ndarray:
        tok = self.lm.tokenizer
        before, after = prompt_frame(tok, template, self.chat_template)
        # Cut the shared prefix one token early: the last token of `before` may merge with the input's
        # first characters in the full prompt's tokenization.
        prefix_ids = tok(before, add_special_tokens=False).input_ids[:-1]
        full = tok([before + t + after for t in texts], add_special_tokens=False).input_ids
        n_prefix = len(prefix_ids)
        shared, fallback = [], []
        for i, ids in enumerate(full):
            (shared if n_prefix and ids[:n_prefix] == prefix_ids and len(ids) > n_prefix else fallback).append(i)
        out = np.zeros((len(texts), len(self.label_ids)), dtype=np.float32)
        if shared:
            prefix = torch.tensor([prefix_ids])
            kv = self._body(input_ids=prefix, use_cache=True).past_key_values
            prefix_kv = [(layer.keys, layer.values) for layer in kv.layers]
            self.stats.tokens_forward += n_prefix
            suffixes = {i: full[i][n_prefix:] for i in shared}
            out_shared = self._run_batches(suffixes, prefix_kv, n_prefix)
            for i, row in out_shared.items():
                out[i] = row
        if fallback:
            self.stats.prefix_fallbacks += len(fallback)
            for i, row in self._run_batches({i: full[i] for i in fallback}, None, 0).items():
                out[i] = row
        self.stats.pairs_scored += len(texts)
        return out

    def _run_batches(self, suffixes: dict[int, list[int]], prefix_kv, n_prefix: int) -> dict[int, np.ndarray]:
        order = sorted(suffixes, key=lambda i: len(suffixes[i]))  # similar lengths together: little padding
        results: dict[int, np.ndarray] = {}
        for start in range(0, len(order), self.batch_size):
            t0 = time.perf_counter()
            rows = order[start : start + self.batch_size]
            width = max(len(suffixes[i]) for i in rows)
            ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), n_prefix + width), dtype=torch.long)
            mask[:, :n_prefix] = 1
            last = torch.zeros(len(rows), dtype=torch.long)
            for r, i in enumerate(rows):  # right padding: real tokens keep their positions
                seq = suffixes[i]
                ids[r, : len(seq)] = torch.tensor(seq)
                mask[r, n_prefix : n_prefix + len(seq)] = 1
                last[r] = len(seq) - 1
            kwargs = {}
            if prefix_kv is not None:
                kwargs["past_key_values"] = DynamicCache(
                    ddp_cache_data=[(k.expand(len(rows), -1, -1, -1), v.expand(len(rows), -1, -1, -1)) for k, v in prefix_kv],
                    config=self.lm.model.config,
                )
            positions = torch.arange(n_prefix, n_prefix + width).unsqueeze(0).expand(len(rows), -1)
            hidden = self._body(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=prefix_kv is not None, **kwargs
            ).last_hidden_state
            picked = hidden[torch.arange(len(rows)), last]  # (rows, d): each row's last real position
            scores = label_logprobs(picked.float() @ self._label_head.T, self._head_index)
            for r, i in enumerate(rows):
                results[i] = scores[r]
            self.stats.tokens_forward += len(rows) * width
            self.stats.forward_s.append(time.perf_counter() - t0)
        return results
