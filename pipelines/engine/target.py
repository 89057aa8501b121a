"""The target model as a classifier: label scores for (template, example) pairs.

A pair is scored by the target's next-token logits for the first token of each label's verbalizer
(pooled over its capitalisations: "yes", "Yes", " yes", ...) after the rendered prompt (inside the
model's chat template). The scores returned are log-probabilities
normalised over the task's labels, so "P(yes) vs P(no)" is ``scores[:, yes] - scores[:, no]``.

``score_naive`` is the reference: one unbatched forward pass per pair over the whole prompt, logits at
every position over the whole vocabulary. ``LabelScorer.score`` computes the same numbers with less work:

* the part of the prompt that is the same for every example of a template (chat header, system prompt,
  instruction) is run once (on the packed Llama path: once per scoring thread, ahead of its first batch's
  examples in the same matrix products) and its key/value cache reused for every example; a template that
  starts like a recent one starts from that one's cache;
* the example-specific suffixes of a batch are packed end to end into one row, so the matrix products
  carry no padding; attention regroups them per example (in buckets of similar length) so that each
  attends to the shared prefix and to itself only (``_packed_attention_forward``, routed through
  transformers' ``AttentionInterface`` for the duration of the forward pass);
* hidden states become logits only at each example's last position and only for the label tokens;
* for Llama-architecture models the forward pass over the packed row is ``pipelines.engine.packed_llama``
  (equal hidden states, less work around the matrix products, the last layer for the last tokens only);
* with more than one intra-op thread, the sequences are dealt to one thread per core, each running its own
  packed batches with one intra-op thread: a core is used better that way than by splitting each small
  operation (norms, attention per bucket) across cores;
* results are cached by (template, example), so a template seen again costs nothing.

``LabelScorer.answer`` generates the greedy answers an application would read. On the packed Llama path the
prompts run once, in the same packed batches as ``score``, whose label log-probs are cached for ``score`` on the
way (the same numbers in every dtype); the pass keeps its keys and values and each further token is one pass of
the running answers (``PackedLlama.greedy``). Other models decode with transformers' key/value cache: the shared
prefix once per template, the example suffixes in padded batches, one token's pass per new token (``_greedy``,
whose label log-probs are cached only in float32). An answer stops at the
model's end of sequence, as soon as the caller's ``complete`` says its parse cannot change (the first word of a
label answer), or at the token limit (``truncated``). ``scripts/bench/scoring.py`` compares it with
``model.generate`` per pair.

Equivalence: the shared prefix is cut on a token boundary of the full prompt's own tokenization (checked
for every example; an example whose tokens differ there is scored without sharing), so both paths feed the
model identical token ids. In float32 they agree to about 1e-4. In bfloat16, packing changes the shape of the
matrix products and so their rounding, and the naive path's logits are themselves rounded to bfloat16 (this
path projects onto the label rows in float32): scores differ by up to about 0.3 in log-odds (see the tests).

The module is long because the fast path (prefix sharing and reuse, packed rows, the per-thread split, and
transformers' packed-attention path for the models the written-out pass does not cover) must compute exactly
what ``score_naive`` does, and the two are easiest to keep equal when read side by side; the layout, the
written-out pass and the cache are modules of their own.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from pipelines.engine.answers import Answer, AnswerCache
from pipelines.engine.models import LoadedLM, ModelLoadError
from pipelines.engine.packed_llama import (SEQUENCE_ROWS, PackedLlama, by_rows, config_unsupported_reason, decoder_of,
                                           unsupported_reason)
from pipelines.engine.packing import Packing
from pipelines.engine.pair_cache import PairCache
from pipelines.engine.usage import Usage
from templates.template import Template

_SENTINEL = "\u2063TUNE_PROMPTS_INPUT\u2063"


@dataclass
class ScorerStats:
    pairs_scored: int = 0  # computed by a forward pass
    pairs_cached: int = 0  # answered from the cache
    tokens_forward: int = 0  # tokens run through the model: suffixes per pair, and prefix tokens not taken from
    #   earlier rows (on the packed path once per scoring thread)
    prefix_fallbacks: int = 0  # examples whose tokenization did not share the template's prefix
    prefix_tokens_reused: int = 0  # prefix tokens not run again: another template's prefix started the same way
    answers_generated: int = 0  # greedy answers computed (cached ones are free)
    answer_tokens: int = 0  # new tokens of those answers
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "pairs_scored": self.pairs_scored,
            "answers_generated": self.answers_generated,
            "answer_tokens": self.answer_tokens,
            "pairs_cached": self.pairs_cached,
            "tokens_forward": self.tokens_forward,
            "prefix_fallbacks": self.prefix_fallbacks,
            "prefix_tokens_reused": self.prefix_tokens_reused,
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
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template (a base "
                "model?): give an instruction-tuned model, or set template.chat_template: false in the task file "
                "(the judge always asks in a chat template: give it --judge-model with one)")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    before, sentinel, after = text.partition(_SENTINEL)
    if not sentinel:
        raise ValueError("the chat template dropped the input; cannot score this template")
    return before, after


def answers_give_label_rows(config, dtype: str, packed_llama: bool = True) -> bool:
    """Whether ``LabelScorer.answer``'s pass over a prompt also gives the label log-probs ``score`` would compute
    (cached, so a pair answered first is scored at no further call): on the packed Llama path in every dtype, on
    transformers' path in float32 only. ``config``: the model's (``pipelines.engine.models.load_config``), so the
    budget's stand-ins can tell before the model is loaded; a CPU model, as every local model here is."""
    return dtype == "float32" or (packed_llama and config_unsupported_reason(config) is None)


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
    """Fast label scoring for one target model and one label set (a ``pipelines.engine.scorer.Scorer``). Not
    thread-safe; one per actor."""

    def __init__(
        self,
        lm: LoadedLM,
        verbalizers: list[str],
        *,
        chat_template: bool = True,
        batch_size: int = 64,
        tokens_per_batch: int = 2048,
        cache_pairs: int = 200_000,
        packed_llama: bool = True,
    ):
        self.lm = lm
        self.verbalizers = list(verbalizers)
        self.label_ids = label_token_ids(lm.tokenizer, self.verbalizers)
        self.chat_template = chat_template
        self.batch_size = batch_size  # sequences per forward pass, at most
        self.tokens_per_batch = tokens_per_batch  # tokens per forward pass, at most (one longer sequence runs alone)
        self._cache = PairCache(cache_pairs)
        self.stats = ScorerStats()
        self.usage = Usage()  # calls and tokens, as a server would bill them (pipelines/engine/usage.py)
        model = lm.model
        self._body = decoder_of(model)
        # Only the label rows of the output layer are ever needed; kept in float32 so that the log-odds are
        # not rounded to bfloat16's steps (0.125 at typical logit sizes), which would tie many examples.
        flat = [t for ids in self.label_ids for t in ids]
        self._label_head = model.get_output_embeddings().weight[flat].detach().float()
        self._label_flat = flat
        # Greedy answers off the packed path run transformers' own forward pass; in float32 its label log-probs
        # equal the packed pass's to about 1e-5 and are cached for ``score``, in bfloat16 they would not be.
        self._rows_from_answers = next(model.parameters()).dtype == torch.float32
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self._eos = set(eos) | ({lm.tokenizer.eos_token_id} if lm.tokenizer.eos_token_id is not None else set())
        self._answers = AnswerCache()
        # label_ids re-indexed into the rows of _label_head
        self._head_index, start = [], 0
        for ids in self.label_ids:
            self._head_index.append(list(range(start, start + len(ids))))
            start += len(ids)
        self._n_layers = model.config.num_hidden_layers
        # The written-out forward pass where the architecture allows it (and unless asked not to).
        self._packed = _packed_llama(model) if packed_llama and unsupported_reason(model) is None else None
        # an answer's pass scored its pair's labels too (``answers_give_label_rows`` predicts this from the config)
        self.labels_with_answers = self._packed is not None or self._rows_from_answers
        self._prefixes: dict[tuple[int, ...], list[torch.Tensor]] = {}  # recent prefixes' rows (packed path)
        self._keep_prefixes = 8  # how many recent prefixes' rows are kept

    # --- public API ------------------------------------------------------------------------
    def score(self, template: Template, texts: Sequence[str]) -> np.ndarray:
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

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int,
               complete: Callable[[str], bool] | None = None) -> list[Answer]:
        """The greedy answer to each prompt, at most ``max_new_tokens`` new tokens; ``complete(text)`` True stops
        an answer early (its parse is settled). Same prompts as ``score``: the template inside the chat template."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        started = time.perf_counter()
        key = (template.text, max_new_tokens, complete is not None)
        out, todo = self._answers.lookup(key, texts)
        if todo:
            unique = list(todo)
            for text, found in zip(unique, self._answer_uncached(template, unique, max_new_tokens, complete)):
                self._answers.put(key, text, found)
                for i in todo[text]:
                    out[i] = found
        self.stats.seconds += time.perf_counter() - started
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def request_latency_ms(self, template: Template, texts: Sequence[str], n: int = 12) -> dict[str, float]:
        """What a service sees: one request at a time, the whole prompt, no cache. p50 and p95 in ms, and
        ``error_rate`` (always 0 here: an in-process forward pass either runs or raises)."""
        before, after = prompt_frame(self.lm.tokenizer, template, self.chat_template)
        samples = []
        for text in list(texts)[:n]:
            t0 = time.perf_counter()
            ids = self.lm.tokenizer(before + text + after, return_tensors="pt", add_special_tokens=False).input_ids
            self.lm.model(input_ids=ids, logits_to_keep=1)
            samples.append((time.perf_counter() - t0) * 1000)
            self.usage.add(1, ids.shape[1])
        return {"p50": float(np.percentile(samples, 50)), "p95": float(np.percentile(samples, 95)), "error_rate": 0.0}

    def clear_cache(self) -> None:
        """Forget scored pairs and computed prefixes."""
        self._cache.clear()
        self._answers.clear()
        self._prefixes.clear()

    # --- internals -------------------------------------------------------------------------

    def _split(self, template: Template, texts: list[str]):
        """Tokenize the prompts: the shared prefix's ids, and the example-specific ids of the prompts that start
        with it (by index) and of those that do not (whole prompts, by index)."""
        tok = self.lm.tokenizer
        before, after = prompt_frame(tok, template, self.chat_template)
        before_ids = tok(before, add_special_tokens=False).input_ids
        full = tok([before + t + after for t in texts], add_special_tokens=False).input_ids
        # The shared prefix is all of `before`'s tokens if every prompt's tokenization starts with them;
        # otherwise one token fewer (the last one may merge with the input's first characters).
        prefix_ids = before_ids
        if not all(ids[: len(before_ids)] == before_ids and len(ids) > len(before_ids) for ids in full):
            prefix_ids = before_ids[:-1]
        n_prefix = len(prefix_ids)
        shared, fallback = {}, {}
        for i, ids in enumerate(full):
            if n_prefix and ids[:n_prefix] == prefix_ids and len(ids) > n_prefix:
                shared[i] = ids[n_prefix:]
            else:
                fallback[i] = ids
        self.stats.prefix_fallbacks += len(fallback)
        return prefix_ids, shared, fallback

    @torch.inference_mode()
    def _score_uncached(self, template: Template, texts: list[str]) -> np.ndarray:
        prefix_ids, shared, fallback = self._split(template, texts)
        out = np.zeros((len(texts), len(self.label_ids)), dtype=np.float32)
        if shared:
            for i, row in self._run_batches(shared, self._prefix_state(prefix_ids), len(prefix_ids)).items():
                out[i] = row
        if fallback:
            for i, row in self._run_batches(fallback, None, 0).items():
                out[i] = row
        self.stats.pairs_scored += len(texts)
        self.usage.add(len(texts), _prompt_tokens(prefix_ids, shared, fallback))
        return out

    @torch.inference_mode()
    def _answer_uncached(self, template: Template, texts: list[str], max_new_tokens: int, complete) -> list[Answer]:
        prefix_ids, shared, fallback = self._split(template, texts)
        answers: dict[int, Answer] = {}
        for suffixes, prefix_ids_, prefix in ((shared, prefix_ids, True), (fallback, [], False)):
            if not suffixes:
                continue
            if self._packed is not None:  # the packed pass: label log-probs for ``score`` and the answers' start
                answering = _Answering(self.lm.tokenizer, self._eos, max_new_tokens, complete)
                state = self._prefix_state(prefix_ids_) if prefix else None
                for i, row in self._run_batches(suffixes, state, len(prefix_ids_), answering).items():
                    self._cache.put(template.text, texts[i], row)  # exactly what ``score`` computes
                answers.update(answering.answers)
            else:
                answers.update(self._greedy(template, texts, suffixes, prefix_ids_, max_new_tokens, complete))
        if self.labels_with_answers:
            self.stats.pairs_scored += len(texts)  # the prompt's pass scored the labels too
        self.stats.answers_generated += len(texts)
        self.stats.answer_tokens += sum(a.tokens for a in answers.values())
        self.usage.add(len(texts), _prompt_tokens(prefix_ids, shared, fallback), sum(a.tokens for a in answers.values()))
        return [answers[i] for i in range(len(texts))]

    def _greedy(self, template, texts, suffixes: dict[int, list[int]], prefix_ids: list[int], max_new_tokens: int,
                complete, batch_size: int = 32) -> dict[int, Answer]:
        """Greedy decoding of the sequences ``suffixes`` after ``prefix_ids`` with transformers' key/value cache
        (models the packed Llama pass does not cover): the prompt once, then one token's pass per new token.

        The shared prefix runs once and its cache is repeated for each batch; the suffixes, sorted by length, are
        padded between the prefix and their own tokens (masked out, positions counted from the prefix's end). The
        suffixes' pass gives the first token, and in float32 also the label log-probs, cached for ``score`` (they
        agree with the packed pass to about 1e-5; in bfloat16 the two paths round differently, so ``score`` runs
        its own pass). A finished sequence leaves its batch, so each step runs only the answers still being
        written. Batches of 32: on a CPU a decoding step reads every weight once, whatever the batch, so more rows
        per step cost little more than one."""
        tok, model = self.lm.tokenizer, self.lm.model
        pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self._eos))
        answering = _Answering(tok, self._eos, max_new_tokens, complete)
        n_prefix = len(prefix_ids)
        prefix_cache = None
        if prefix_ids:
            prefix_cache = model(input_ids=torch.tensor([prefix_ids]), use_cache=True, logits_to_keep=1).past_key_values
            self.stats.tokens_forward += n_prefix
        order = sorted(suffixes, key=lambda i: len(suffixes[i]))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            seqs = [suffixes[i] for i in chunk]
            width = max(map(len, seqs))
            ids = torch.tensor([[pad] * (width - len(seq)) + seq for seq in seqs])
            own = torch.tensor([[0] * (width - len(seq)) + [1] * len(seq) for seq in seqs])
            mask = torch.cat([own.new_ones(len(chunk), n_prefix), own], dim=1)
            positions = n_prefix + (own.cumsum(-1) - 1).clamp(min=0)
            cache = None
            if prefix_cache is not None:
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(len(chunk))
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            self.stats.tokens_forward += int(own.sum())
            if self._rows_from_answers:
                rows = label_logprobs(out.logits[:, -1, self._label_flat], self._head_index)
                for i, row in zip(chunk, rows):
                    self._cache.put(template.text, texts[i], row)  # what ``score`` would have computed
            cache, running = out.past_key_values, list(chunk)
            for step in range(max_new_tokens):
                tokens = out.logits[:, -1].argmax(-1).tolist()
                keep, next_tokens = [], []
                for r, (i, token) in enumerate(zip(running, tokens)):
                    if not answering.take(i, token, step):
                        keep.append(r)
                        next_tokens.append(token)
                if not keep:
                    break
                if len(keep) < len(running):  # finished rows leave the batch and its cache
                    cache.batch_select_indices(torch.tensor(keep))
                    mask, positions = mask[keep], positions[keep]
                    running = [running[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones(len(running), 1)], dim=1)
                positions = positions[:, -1:] + 1
                out = model(input_ids=torch.tensor(next_tokens)[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                self.stats.tokens_forward += len(running)
        return answering.answers

    def _label_readout(self, picked: torch.Tensor) -> np.ndarray:
        # a few rows at a time, like the pass before it: a row's log-probs whatever the batch (see by_rows)
        logits = by_rows(lambda rows: rows.float() @ self._label_head.T, picked, SEQUENCE_ROWS)
        return label_logprobs(logits, self._head_index)

    def _prefix_state(self, prefix_ids: list[int]):
        """The shared prefix in the form the forward path reads: for the packed Llama path a ``_PackedPrefix``
        (the rows known already, the tokens still to run), transformers' per-layer (keys, values) otherwise.

        On the packed path the rows of the last ``_keep_prefixes`` prefixes are kept, and a new prefix starts
        from the longest run of tokens it shares with one of them: candidate templates share the chat
        template's header and system prompt, often the first words of the instruction too. The rest is not run here:
        each scoring thread runs it at the head of its first packed batch (``Packing.build``'s ``head``), in
        the same matrix products as the examples, which costs less than a pass of its own over a few tokens."""
        if self._packed is not None:
            key = tuple(prefix_ids)
            best, known = 0, None
            for seen, rows in self._prefixes.items():
                shared = next((i for i, (a, b) in enumerate(zip(seen, key)) if a != b), min(len(seen), len(key)))
                if shared > best:
                    best, known = shared, [r[:shared] for r in rows]
            self.stats.prefix_tokens_reused += best
            if best == len(key):
                self._remember_prefix(key, known)  # moved to the most recent end, last to be dropped
            return _PackedPrefix(key, known, list(key[best:]))
        kv = self._body(input_ids=torch.tensor([prefix_ids]), use_cache=True).past_key_values
        self.stats.tokens_forward += len(prefix_ids)
        return [(layer.keys, layer.values) for layer in kv.layers]

    def _remember_prefix(self, key: tuple[int, ...], rows: list[torch.Tensor]) -> None:
        self._prefixes.pop(key, None)
        self._prefixes[key] = rows
        while len(self._prefixes) > self._keep_prefixes:
            self._prefixes.pop(next(iter(self._prefixes)))

    def _run_batches(self, suffixes: dict[int, list[int]], prefix, n_prefix: int, answering: "_Answering | None" = None
                     ) -> dict[int, np.ndarray]:
        """Run token sequences that follow a shared prefix (``prefix`` from ``_prefix_state``; None: no prefix),
        packed; the label log-probs at each sequence's last position, by index. With ``answering`` (packed Llama
        path only) each batch goes on to its greedy answers, collected there."""
        order = sorted(suffixes, key=lambda i: len(suffixes[i]))  # similar lengths together: tight attention buckets
        shards = self._shard_count(len(order))
        if shards == 1:
            done = [self._run_shard(order, suffixes, prefix, n_prefix, answering)]
        else:
            # Longest first, each to the part with the fewest tokens so far: the slowest thread sets the wall
            # time, and dealing a length-sorted list in turn would hand the same part the longest sequence of
            # every round. Every part gets short and long sequences, and stays sorted for tight buckets.
            parts, loads = [[] for _ in range(shards)], [0] * shards
            for i in reversed(order):
                k = loads.index(min(loads))
                parts[k].insert(0, i)
                loads[k] += len(suffixes[i])
            with _intra_op_threads(1), ThreadPoolExecutor(shards, thread_name_prefix="label-scorer") as pool:
                done = list(pool.map(lambda part: self._run_shard(part, suffixes, prefix, n_prefix, answering), parts))
        if isinstance(prefix, _PackedPrefix) and prefix.head:
            self._remember_prefix(prefix.key, done[0][2])  # every thread ran the head; the first one's rows are kept
        self.stats.tokens_forward += sum(tokens for _, tokens, _ in done)
        return {i: row for results, _, _ in done for i, row in results.items()}

    def _shard_count(self, sequences: int, per_shard: int = 8) -> int:
        """One part per intra-op thread, each of ``per_shard`` sequences at least; 1 without the packed Llama
        path (transformers' forward with ``_packed_attention`` is not thread-safe)."""
        if self._packed is None:
            return 1
        return max(1, min(torch.get_num_threads(), sequences // per_shard))

    @torch.inference_mode()  # thread-local: entered in each scoring thread
    def _run_shard(self, order: list[int], suffixes: dict[int, list[int]], prefix, n_prefix: int,
                   answering: "_Answering | None" = None):
        """Run the sequences ``order`` (sorted by length) in packed batches, each then answered greedily with
        ``answering``; (label log-probs by index, tokens run, the prefix's rows if this call ran its head)."""
        results: dict[int, np.ndarray] = {}
        start = tokens = 0
        head, rows_known = [], prefix
        if isinstance(prefix, _PackedPrefix):
            head, rows_known = prefix.head, prefix.known
        while start < len(order):
            rows, total = [], 0
            for i in order[start:]:  # as many sequences as fit the token budget (at least one)
                if rows and (len(rows) == self.batch_size or total + len(suffixes[i]) > self.tokens_per_batch):
                    break
                rows.append(i)
                total += len(suffixes[i])
            start += len(rows)
            packing = Packing.build([suffixes[i] for i in rows], n_prefix - len(head), head=head)
            if self._packed is not None:
                kept: list | None = [] if answering is not None else None
                picked, head_rows = self._packed.forward(packing, rows_known, keep=kept)  # (rows, d)
                if head:  # later batches read the whole prefix as known rows
                    rows_known = head_rows if rows_known is None else [
                        torch.cat([old, new]) for old, new in zip(rows_known, head_rows)]
                    tokens, head = tokens + len(head), []
                if answering is not None and kept is not None:
                    tokens += self._packed.greedy(packing, kept, picked, answering.max_new_tokens,
                                                  answering.taker(list(rows)))
            else:
                picked = self._hf_last_hidden(packing, prefix)
            scores = self._label_readout(picked)
            for r, i in enumerate(rows):
                results[i] = scores[r]
            tokens += total
        return results, tokens, rows_known

    def _hf_last_hidden(self, packing: Packing, prefix_kv) -> torch.Tensor:
        """transformers' own forward pass over the packed row, attention through ``_packed_attention``."""
        if packing.n_head:  # _packed_attention_forward reads the prefix from prefix_kv only
            raise ValueError("transformers' packed path takes a computed prefix, not a packing with a head")
        hf_pass = _HFPass(packing, prefix_kv)
        with _packed_attention(self.lm.model, hf_pass):
            hidden = self._body(input_ids=packing.ids, position_ids=packing.positions, use_cache=False).last_hidden_state
        if hf_pass.calls != self._n_layers:
            raise RuntimeError(
                f"{type(self.lm.model).__name__} did not route attention through transformers' "
                f"AttentionInterface ({hf_pass.calls} of {self._n_layers} layers); packed scoring needs it"
            )
        return hidden[0, packing.last]


class _Answering:
    """Greedy answers being written on the packed path: each index's new tokens, and its ``Answer`` once finished
    (both answer paths stop by these rules: ``PackedLlama.greedy`` and ``LabelScorer._greedy``)."""

    def __init__(self, tokenizer, eos: set[int], max_new_tokens: int, complete: Callable[[str], bool] | None):
        self.tokenizer, self.eos, self.max_new_tokens, self.complete = tokenizer, eos, max_new_tokens, complete
        self.new: dict[int, list[int]] = {}
        self.answers: dict[int, Answer] = {}

    def taker(self, rows: list[int]) -> Callable[[int, int, int], bool]:
        """``take`` for a packed batch whose j-th sequence is index ``rows[j]``."""
        return lambda j, token, step: self.take(rows[j], token, step)

    def take(self, i: int, token: int, step: int) -> bool:
        """Index i's token of this step; True when its answer is finished."""
        new = self.new.setdefault(i, [])
        if token in self.eos:
            self.answers[i] = Answer(self.tokenizer.decode(new, skip_special_tokens=True), False, len(new))
            return True
        new.append(token)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if self.complete is not None and self.complete(text):
            self.answers[i] = Answer(text, False, len(new))
        elif step == self.max_new_tokens - 1:
            self.answers[i] = Answer(text, True, len(new))
        else:
            return False
        return True


def _prompt_tokens(prefix_ids: list[int], shared: dict, fallback: dict) -> int:
    """The prompts' tokens as whole requests would carry them (the shared prefix once per prompt)."""
    return len(prefix_ids) * len(shared) + sum(map(len, shared.values())) + sum(map(len, fallback.values()))


def _packed_llama(model) -> PackedLlama:
    """One ``PackedLlama`` per model (its reordered weights are a copy), kept on the model itself."""
    packed = getattr(model, "_tune_prompts_packed_llama", None)
    if packed is None:
        packed = PackedLlama(model)
        model._tune_prompts_packed_llama = packed
    return packed


@contextmanager
def _intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block (it is per process), then restored."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


_PACKED = "tune_prompts_packed"


@dataclass
class _PackedPrefix:
    """A template's shared prefix on the packed Llama path: per layer the buffer rows of its first tokens,
    known from an earlier template (None: none), and the tokens still to run."""

    key: tuple[int, ...]
    known: list[torch.Tensor] | None
    head: list[int]


@dataclass
class _HFPass:
    """One forward pass of transformers' model over a packed row: the layout, the prefix's per-layer
    (keys, values) of shape (1, kv_heads, P, head_dim), and how many attention layers came through."""

    packing: Packing
    prefix_kv: list | None
    calls: int = 0


_ACTIVE: list[_HFPass] = []  # the forward pass in progress (a stack of at most one)


def _packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a packed row: query/key/value (1, heads, N, head_dim) are regrouped per sequence,
    each sequence attends to the shared prefix and causally to itself, and the result goes back to the row."""
    current = _ACTIVE[-1]
    current.calls += 1
    packing = current.packing
    flat = [torch.cat([x[0].transpose(0, 1), x.new_zeros(1, x.shape[1], x.shape[3])]) for x in (query, key, value)]
    outs = []
    for gather, mask in packing.buckets:
        q, k, v = (x[gather].transpose(1, 2) for x in flat)  # (S_b, heads, L_b, d)
        if current.prefix_kv is not None:
            prefix_k, prefix_v = current.prefix_kv[module.layer_idx]
            k = torch.cat([prefix_k.expand(len(k), -1, -1, -1), k], dim=2)
            v = torch.cat([prefix_v.expand(len(v), -1, -1, -1), v], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # (S_b * L_b, heads, d)
    return torch.cat(outs)[packing.scatter].unsqueeze(0), None  # (1, N, heads, d), like transformers' functions


@contextmanager
def _packed_attention(model, hf_pass: _HFPass):
    """Route the model's attention through ``_packed_attention_forward`` for one forward pass."""
    from transformers import AttentionInterface

    if _PACKED not in AttentionInterface._global_mapping:
        AttentionInterface.register(_PACKED, _packed_attention_forward)
    saved = model.config._attn_implementation
    model.config._attn_implementation = _PACKED
    _ACTIVE.append(hf_pass)
    try:
        yield
    finally:
        _ACTIVE.pop()
        model.config._attn_implementation = saved
