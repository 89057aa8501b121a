"""How readable an instruction is on its own, 0..1 (higher: more like an instruction an analyst would sign).

No LLM judge: asked "is this instruction clear, sensible and on topic?", the 135M model prefers the policy's own
text (ROC-AUC 0.19, shared/FACTS.md). The measure is a logistic function of six interpretable features, read from
the instruction, the task's ``description`` and a frozen causal LM (the embedded SmolLM2-135M-Instruct):

* ``pmi``: on-topic-ness. The mean per-token log-prob of the instruction after ``Task: <description>
  Instruction:`` minus the same after ``Instruction:`` alone (nats per token). Fluent text about web cafes or
  mouse detectives is no likelier after the task's description than without it; "Decide whether the critic liked
  the film." is.
* ``fluency``: the summed log-prob of the instruction after ``Instruction:`` per whitespace word read (nats per
  word); a made-up word costs several unlikely tokens.
* ``dictionary``: the share of whitespace-separated words that are plain words of autocorrect's English word list
  (its package data; punctuation around a word allowed, each part of a hyphenated or apostrophe word checked).
* ``markup``: marks of code, URLs or markup per word: ``<>{}[]|`#*_=^~\\/@$%&``, newlines, ``http://``, ``www.``,
  characters outside ASCII other than typographic quotes and dashes.
* ``complete``: 1 when the text ends a sentence (``.``, ``?`` or ``!``), else 0: the policy's text is often cut
  off mid-sentence at its token limit.
* ``names``: the share of words capitalized inside a sentence that the description does not contain (people,
  places, products and acronyms the task never mentions).

The LM reads the first ``MAX_TOKENS`` (24) tokens of an instruction, the text features all of it. On the fixture
the first 24 tokens told as much as 48 (ROC-AUC 0.984 against 0.985, on its first 164-item version; 16 tokens:
0.976) at half the cost, so the LM does not see the second half of a 48-token instruction: a readable start with
a fluent but pointless tail is left to the text features. Per call, each prefix is run once per scorer and its
cache repeated; instructions run in buckets of similar length, right-padded, with logits only where they predict
a real token; a scorer remembers what it has read.

Calibration: ``tests/data/readability_fixture.yaml``, 168 items: 52 hand-written instructions (13 per built-in
task, each task's seed among them) against 116 degraded ones: 80 instructions that tuning runs chose (the
policy's fluent nonsense), 12 word salads, 12 shuffled hand-written ones and 12 with code or markup.
``COEFFICIENTS`` and ``INTERCEPT`` are an L2-regularised logistic regression (l2 = 1 on standardized features,
folded back to raw units) fitted on the fixture's even-indexed items (84) and frozen;
``scripts/bench/readability.py --fit`` refits and prints them. ROC-AUC, hand-written against all degraded, with
the embedded model in bfloat16 on 2 AMD EPYC cores with AVX-512 BF16 (``scripts/bench/readability.py``; 95%
bootstrap intervals): whole fixture 0.981 [0.963, 0.994], held-out odd-indexed half 0.987 [0.964, 1.000], against
past winners alone 0.972 (held-out half 0.981); word salad, shuffled and markup items 1.000. In float32 on the
same machine: 0.980 and 0.987. Each feature alone (whole fixture / held-out half): pmi 0.941 / 0.946, fluency
0.800 / 0.851, dictionary 0.763 / 0.735, markup 0.642 / 0.647, complete 0.781 / 0.826, names 0.782 / 0.810.

Time to score 16 risk instructions (up to 24 tokens read each), bfloat16, on those 2 cores, whose bf16 matrix
products ran at about 420 GFLOP/s (half the 810 FACTS.md records for its machine): 0.72-0.89 s on a scorer that
has run its prefixes, 0.83-1.03 s on a fresh one (medians of repeated runs), a few ms for instructions it has
read; float32 1.65-1.9 s.

An empty (or blank) instruction scores 0.0: it tells the reader nothing, and a floor it passed would let the
policy dodge the measure by writing nothing.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import re
import tarfile
from pathlib import Path
from typing import Any, Sequence

FEATURES = ("pmi", "fluency", "dictionary", "markup", "complete", "names")
# Fitted on the fixture's even-indexed items in bfloat16 (module docstring). Units: pmi nats per token, fluency
# nats per word, dictionary and names shares 0..1, markup marks per word, complete 0 or 1.
COEFFICIENTS = {"pmi": 2.012, "fluency": 0.194, "dictionary": 4.703, "markup": -0.141, "complete": 1.867,
                "names": -11.161}
INTERCEPT = -7.275
# The promotion gate's bar: the highest multiple of 0.05 that at least 90% of the fixture's hand-written
# instructions reach, in bfloat16 and in float32 alike (47 of 52 in each; 0.50 keeps 47 in bfloat16 but 46 in
# float32). 10 of the 80 past winners reach it, none of the other 36 degraded items; the four seed instructions
# score 0.897-0.991 (bfloat16).
READABILITY_FLOOR = 0.45

MAX_TOKENS = 24  # what the LM reads of an instruction (the policy writes up to 48): module docstring
_MEMO_LIMIT = 20_000  # remembered (prefix, tokens) pairs per scorer before the memo starts over
UNCONDITIONED_PREFIX = "Instruction:"
CONDITIONED_PREFIX = "Task: {description}\nInstruction:"

_TYPOGRAPHIC = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})
_PLAIN_WORD = re.compile(r"[\"'(]*([A-Za-z]+(?:[-'][A-Za-z]+)*)[\"'),.;:!?]*")
_MARKUP = re.compile(r"https?://|www\.|[<>{}\[\]|`#*_=^~\\/@$%&\n]|[^\x00-\x7f]")
_SENTENCE_END = re.compile(r"""[.?!]["')\]]*$""")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


@functools.lru_cache(maxsize=1)
def english_words() -> frozenset[str]:
    """autocorrect's English word list (91k words, lowercased), read from its package data without importing it."""
    spec = importlib.util.find_spec("autocorrect")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package 'autocorrect' is not installed (it comes with promptbench); run scripts/setup.sh")
    archive = Path(spec.submodule_search_locations[0]) / "data" / "en.tar.gz"
    with tarfile.open(archive) as tar:
        counts = json.load(tar.extractfile("word_count.json"))
    return frozenset(w.lower() for w in counts)


def dictionary_share(text: str, words: frozenset[str] | None = None) -> float:
    """The share of whitespace-separated words that are plain dictionary words; 0.0 for no words."""
    words = english_words() if words is None else words
    tokens = text.translate(_TYPOGRAPHIC).split()
    if not tokens:
        return 0.0
    ok = 0
    for token in tokens:
        m = _PLAIN_WORD.fullmatch(token)
        ok += bool(m) and all(part.lower() in words for part in re.split(r"[-']", m.group(1)))
    return ok / len(tokens)


def markup_per_word(text: str) -> float:
    """Marks of code, URLs, markup or non-Latin script per whitespace word (an empty text: 0.0)."""
    marks = len(_MARKUP.findall(text.strip().translate(_TYPOGRAPHIC)))
    return marks / max(1, len(text.split()))


def ends_sentence(text: str) -> float:
    return 1.0 if _SENTENCE_END.search(text.strip().translate(_TYPOGRAPHIC)) else 0.0


def offtask_name_share(text: str, description: str) -> float:
    """The share of words capitalized inside a sentence that the description does not contain (case ignored)."""
    known = {w.lower() for w in _WORD.findall(description)} | {"i"}
    text = text.translate(_TYPOGRAPHIC)
    words = list(_WORD.finditer(text))
    names = 0
    for m in words:
        before = text[: m.start()].rstrip().rstrip("\"'([")
        sentence_start = not before or before[-1] in ".?!:;\n"
        names += m.group()[0].isupper() and not sentence_start and m.group().lower() not in known
    return names / max(1, len(words))


def text_features(text: str, description: str) -> dict[str, float]:
    """The features that need no model."""
    return {"dictionary": dictionary_share(text), "markup": markup_per_word(text), "complete": ends_sentence(text),
            "names": offtask_name_share(text, description)}


def combine(features: dict[str, float]) -> float:
    """The logistic function of the features with the fitted coefficients, 0..1."""
    z = INTERCEPT + sum(COEFFICIENTS[name] * features[name] for name in FEATURES)
    return 1.0 / (1.0 + math.exp(-z))


class ReadabilityScorer:
    """Reads instructions with a frozen causal LM (a ``LoadedLM``; the coefficients and the floor were fitted
    with the embedded SmolLM2-135M-Instruct at ``max_tokens=MAX_TOKENS``).

    Deterministic: the same call on a new scorer gives the same scores. In bfloat16 an instruction's log-probs
    move slightly with the padding of the bucket it lands in (at most 0.008 in score over the fixture;
    ``tests/test_readability.py`` allows 0.02); a scorer remembers what it read, so it gives an instruction one
    score for its life."""

    def __init__(self, lm: Any, *, max_tokens: int = MAX_TOKENS) -> None:
        self.lm = lm
        self.max_tokens = max_tokens
        self._read: dict[tuple[str, tuple[int, ...]], list[float]] = {}  # (prefix, token ids) -> log-probs
        self._prefixes: dict[str, Any] = {}  # prefix -> the model's output on it, with its cache

    def score(self, instructions: Sequence[str], description: str) -> list[float]:
        """One readability per instruction, 0..1; an empty instruction 0.0."""
        return [0.0 if f is None else combine(f) for f in self.features(instructions, description)]

    def features(self, instructions: Sequence[str], description: str) -> list[dict[str, float] | None]:
        """Each instruction's features (``FEATURES``), None for an empty one."""
        texts = [t.strip() for t in instructions]
        present = [i for i, t in enumerate(texts) if t]
        out: list[dict[str, float] | None] = [None] * len(texts)
        if not present:
            return out
        tokenizer = self.lm.tokenizer
        ids = [tokenizer(" " + texts[i], add_special_tokens=False).input_ids[: self.max_tokens] for i in present]
        plain = self.token_logprobs(UNCONDITIONED_PREFIX, ids)
        given = self.token_logprobs(CONDITIONED_PREFIX.format(description=" ".join(description.split())), ids)
        for i, read, u, c in zip(present, ids, plain, given):
            # A word cut at max_tokens counts as read.
            words_read = max(1, len(tokenizer.decode(read, clean_up_tokenization_spaces=False).split()))
            out[i] = {"pmi": (sum(c) - sum(u)) / len(u), "fluency": sum(u) / words_read,
                      **text_features(texts[i], description)}
        return out

    def token_logprobs(self, prefix: str, ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token | prefix, earlier tokens) for each token of each id list (non-empty).

        A scorer remembers what it read (the loop reads a candidate in racing and again in full scoring). The
        rest runs in buckets of similar length after the prefix, which runs once per scorer and whose cache is
        repeated for each bucket. A bucket's rows are right-padded (with causal attention a row's real tokens
        never see its padding, so no mask is needed), and logits are computed only where they predict a real
        token."""
        import torch

        todo = sorted({tuple(i) for i in ids if (prefix, tuple(i)) not in self._read}, key=len)
        if len(self._read) + len(todo) > _MEMO_LIMIT:
            self._read.clear()
        with torch.inference_mode():
            bucket: list[tuple[int, ...]] = []
            for row in todo + [None]:
                # A bucket closes when the next row would pad it by more than half and by more than 8 tokens.
                first = len(bucket[0]) if bucket else 0
                if bucket and (row is None or len(row) > max(1.5 * first, first + 8)):
                    for key, lps in zip(bucket, self._bucket_logprobs(self._prefix(prefix), bucket)):
                        self._read[(prefix, key)] = lps
                    bucket = []
                if row is not None:
                    bucket.append(row)
        return [self._read[(prefix, tuple(i))] for i in ids]

    def _prefix(self, prefix: str):
        if prefix not in self._prefixes:
            if len(self._prefixes) >= 16:  # a scorer serves one or a few tasks; bound it anyway
                self._prefixes.clear()
            ids = self.lm.tokenizer(prefix, add_special_tokens=False, return_tensors="pt").input_ids
            self._prefixes[prefix] = self.lm.model.base_model(input_ids=ids, use_cache=True)
        return self._prefixes[prefix]

    def _bucket_logprobs(self, pre, rows: list[tuple[int, ...]]) -> list[list[float]]:
        import torch

        model = self.lm.model
        batch = torch.zeros((len(rows), len(rows[-1])), dtype=torch.long)  # padding: any id, never read
        keep = torch.zeros(batch.shape, dtype=torch.bool)
        for r, row in enumerate(rows):
            batch[r, : len(row)] = torch.tensor(row)
            keep[r, : len(row)] = True
        cache = copy.deepcopy(pre.past_key_values)  # the forward pass appends to the cache it is given
        cache.batch_repeat_interleave(len(rows))
        hidden = model.base_model(input_ids=batch, past_key_values=cache, use_cache=False).last_hidden_state
        # The state before token k predicts it: the prefix's last state for token 0, the row's position k-1 after.
        states = torch.cat([pre.last_hidden_state[:, -1:].expand(len(rows), 1, -1), hidden[:, :-1]], dim=1)
        states, targets, head = states[keep], batch[keep], model.get_output_embeddings()
        picked: list[float] = []
        for at in range(0, len(targets), 128):  # in slices: 128 x 49k float logits stay in cache (~30% faster)
            logits = head(states[at : at + 128]).float()
            chosen = logits.gather(1, targets[at : at + 128, None])[:, 0]
            picked += (chosen - torch.logsumexp(logits, dim=1)).tolist()
        out, at = [], 0
        for row in rows:
            out.append(picked[at : at + len(row)])
            at += len(row)
        return out
