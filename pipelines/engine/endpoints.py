"""Target and judge models behind an OpenAI-compatible HTTP endpoint (vLLM, OpenAI, and the like).

``EndpointLabelScorer`` keeps ``pipelines.engine.target.LabelScorer``'s contract: ``score(template, texts)`` returns
label log-probabilities normalised over the labels, shape (len(texts), n_labels), cached by (template, text).
This module imports neither torch nor transformers and needs no tokenizer: the server owns the model.
It is long because it owns the whole HTTP contract: two ways of reading labels, retries, and an error
message for each way a server can refuse.

One pair is one request. The template is rendered with the text (constraints are not applied, as in
``prompt_frame``) and sent

* ``chat=True``: as one user message to ``POST {base_url}/chat/completions``; the server applies the model's
  chat template with the generation prompt, which is what ``LabelScorer(chat_template=True)`` does in-process;
* ``chat=False``: as a raw prompt to ``POST {base_url}/completions`` (``LabelScorer(chat_template=False)``).

Two ways to read labels off the answer; the first response decides, ``stats.mode`` says which:

``logprobs`` -- ``max_tokens=1, temperature=0`` and the 20 most likely next tokens (chat: ``logprobs: true,
top_logprobs: 20``; completions: ``logprobs: 20``). 20 is the most OpenAI's chat API accepts and vLLM's default
``--max-logprobs``; OpenAI's legacy completions API allows only 5, so use ``chat=True`` with OpenAI. A label's
log-prob is read from those entries, by ``match``:

* ``"word"`` (default): the entries whose stripped, case-folded text is the verbalizer's (``Yes``, ``yes``,
  `` yes``), their probabilities added: what ``LabelScorer`` does in-process (it pools the single-token
  capitalisations of each verbalizer), so a server running the same model gives the same scores;
* ``"token"``: only the entry whose text is exactly the verbalizer.

A label with no matching entry was less likely than every returned token: it gets the smallest returned
log-prob minus ln 2 ("at most half as likely as the least likely token the server named"), and counts in
``stats.labels_floored``. Watch that count: SmolLM2-135M-Instruct starts its answers with ``No``/``Yes``, and with
the risk seed template lowercase ``yes`` or ``no`` fell outside the top 20 for 12 of 24 dev messages; on those
rows the endpoint's log-odds differ from ``LabelScorer``'s (by up to 0.6). Where nothing is floored, a server
running the same model in float32 gives ``LabelScorer``'s numbers to about 2e-5 (tests/test_endpoints.py).
Verbalizers should be single tokens (``yes``/``no`` are, in common tokenizers): an endpoint names tokens, not words.

When the model's first token is its stop token, llama.cpp's server names no tokens at all (empty log-probs,
``finish_reason: stop``, no text), where vLLM names the stop step and its alternatives. That pair is asked once
more with ``min_tokens: 1``: llama.cpp then bars the stop token from that one token and returns the position's
raw log-probs, the stop token's own among them (vLLM knows the parameter too, but never needs it here). A server
that refuses the parameter (400 or 422) is not asked with it again, and such a pair's labels are all floored: a
uniform row.

``answers`` -- when the server returns no log-probs (or rejects the parameter): ``max_tokens=3,
temperature=0`` and the answer's first word picks the label whose verbalizer it is (case-insensitive; a
word that begins exactly one verbalizer also counts, for answers cut short). That label gets log(1 - 1e-3),
the others share 1e-3; an answer naming no label gives every label log(1/n) and counts in
``stats.answers_unmapped``. Scores then take two values per label, so ROC-AUC is coarse.

Failures, all in bounded time (``pipelines/engine/http_deadline.py`` does the socket work):

* one try of a request has ``timeout_s`` for everything: connect, send, first byte and the whole body, so a
  server that stalls or trickles its answer cannot stretch it; one request has ``deadline_s`` in all, its tries,
  backoffs and waits included;
* timeouts, connection errors, 429 and 5xx are retried up to ``max_retries`` times with exponential backoff
  and jitter (``backoff_s * 2**attempt``, times 0.5-1); a 429's or 503's Retry-After (seconds or an HTTP date)
  is honoured up to ``max_retry_after_s``; a wait that would pass the deadline ends the request at once;
* after ``breaker_failures`` failed tries in a row (any request of this scorer), the circuit opens: every
  request fails at once, for ``deadline_s``, with one line naming the server and what to check;
* anything else (404 on the route, a model the server does not serve, a refused key) raises ``EndpointError``
  at once, naming the URL and what is missing. Before its first request a scorer reads ``GET /models`` once
  and refuses a model the list leaves out: llama.cpp's server answers a request for any model name with its
  own model.

A response that arrives but breaks the API's contract (not JSON, another content type, a field of the wrong
type, no choices, a NaN or infinite log-prob, a body over ``max_response_bytes``) is an
``EndpointResponseError`` naming the server and the field. It is never turned into a decision:
``bad_responses="raise"`` (predict, eval) raises it; ``"count"`` (the tuning loop's scorers) treats it like an
answer that names no label (every label log(1/n), not cached) or an empty greedy answer (which breaks any
output contract), counted in ``stats.responses_invalid``, the first one logged.

A pair that fails for good counts in ``stats.errors`` and its ``score`` call raises. The API key comes from
the environment variable ``api_key_env``, is sent as a bearer token, and never appears in a message or a log line.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import random
import re
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import ValidationError

from pipelines.engine import http_deadline
from pipelines.engine import openai_responses as api
from pipelines.engine.answers import Answer, AnswerCache
from pipelines.engine.pair_cache import PairCache
from pipelines.engine.scorer import Scorer
from pipelines.engine.usage import Usage
from templates.template import Template

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 20
ANSWER_MAX_TOKENS = 3
ANSWER_EPS = 1e-3
FLOOR_MARGIN = math.log(2.0)
_DETAIL_CHARS = 300
MAX_RESPONSE_BYTES = 8 * 2**20  # a top-20 log-probs answer is a few kB; an answer this big is a broken server
LOGPROB_SLACK = 1e-4  # a log-prob above this is a probability above 1 (rounding aside): a lie
RETRY_AFTER_STATUSES = (429, 503)


class EndpointError(RuntimeError):
    """The endpoint cannot give what scoring needs; the message names the URL and what is missing."""


class EndpointResponseError(EndpointError):
    """The server answered, but not as the OpenAI API says (shape, types, non-finite log-probs, size). The
    message ends with what to check, since the server, not the command, is at fault."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}. Check what serves that URL (an OpenAI-compatible server, not a proxy's "
                         "error page) and its logs")


@dataclass
class EndpointStats:
    mode: str | None = None  # "logprobs" or "answers": how labels were read (None before the first answer)
    pairs_scored: int = 0  # answered by the server
    pairs_cached: int = 0  # answered from the cache
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0  # requests repeated after a timeout, a connection error, 429 or 5xx
    timeouts: int = 0  # requests that got no answer within timeout_s
    errors: int = 0  # pairs that failed for good (their score() call raised EndpointError)
    responses_invalid: int = 0  # answers that broke the API's contract, counted as no answer (bad_responses="count")
    labels_floored: int = 0  # labels missing from the top log-probs, given the floor value
    answers_unmapped: int = 0  # answers-mode replies that named no label
    answers_generated: int = 0  # greedy answers asked for (``answer``), cached ones not counted
    seconds: float = 0.0
    request_ms: list[float] = field(default_factory=list)  # wall time of each successful request

    def as_dict(self) -> dict:
        ms = self.request_ms
        return {
            "mode": self.mode,
            "pairs_scored": self.pairs_scored,
            "pairs_cached": self.pairs_cached,
            "requests": self.requests,
            "retries": self.retries,
            "timeouts": self.timeouts,
            "errors": self.errors,
            "responses_invalid": self.responses_invalid,
            "labels_floored": self.labels_floored,
            "answers_unmapped": self.answers_unmapped,
            "answers_generated": self.answers_generated,
            "seconds": round(self.seconds, 4),
            "request_ms_p50": float(np.percentile(ms, 50)) if ms else None,
            "request_ms_p95": float(np.percentile(ms, 95)) if ms else None,
        }


class _Retryable(Exception):
    """One attempt failed in a way worth repeating (timeout, connection, 429, 5xx)."""

    def __init__(self, reason: str, wait_s: float | None = None):
        super().__init__(reason)
        self.wait_s = wait_s


class _Skipped(Exception):
    """A pair not asked for because another pair of the same call had already failed."""


class _NoLogprobs(Exception):
    """The server does not give log-probs: switch to answers mode."""


class _MinTokensRefused(Exception):
    """The server refused ``min_tokens`` (OpenAI's API has no such parameter)."""


def _count(value) -> int:
    """A token count from a server's ``usage`` (0 when it sends none or nonsense)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class _Breaker:
    """Fails fast after ``threshold`` failed tries in a row: a server that is down should cost one line, not a
    deadline per request. It stays open for ``cool_s``, then lets requests try again (one more failure reopens it)."""

    def __init__(self, server: str, threshold: int, cool_s: float):
        self.server, self.threshold, self.cool_s = server, threshold, cool_s
        self._lock = threading.Lock()
        self._failures, self._last, self._open_until = 0, "", 0.0

    def check(self) -> None:
        with self._lock:
            if self._failures >= self.threshold and time.monotonic() < self._open_until:
                raise EndpointError(
                    f"{self.server} failed {self._failures} tries in a row (last: {self._last}); not asking it again "
                    f"for {self.cool_s:g} s. Check that the server is up and serves the model, then run the command "
                    "again (a tuning run: with --resume)")

    def failed(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self._last = reason
            if self._failures >= self.threshold:
                self._open_until = time.monotonic() + self.cool_s

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0


def _retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds: a number of seconds or an HTTP date; None when absent or unreadable."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


class EndpointLabelScorer:
    """Label scoring through an OpenAI-compatible server (a ``pipelines.engine.scorer.Scorer``). ``score`` is not
    re-entrant; one per caller."""

    def __init__(
        self,
        base_url: str,
        model: str,
        verbalizers: Sequence[str],
        *,
        api_key_env: str = "TUNE_PROMPTS_API_KEY",
        chat: bool = True,
        match: Literal["token", "word"] = "word",
        timeout_s: float = 30,
        deadline_s: float = 60,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_retry_after_s: float = 10,
        breaker_failures: int = 8,
        max_concurrency: int = 4,
        cache_pairs: int = 200_000,
        top_logprobs: int = TOP_LOGPROBS,
        bad_responses: Literal["raise", "count"] = "raise",
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ):
        _check_address(base_url, model)
        if match not in ("token", "word"):
            raise ValueError(f"match must be 'token' or 'word', not {match!r}")
        self.verbalizers = list(verbalizers)
        if len(self.verbalizers) < 2 or any(not v.strip() for v in self.verbalizers):
            raise ValueError(f"need at least two non-empty verbalizers, got {self.verbalizers}")
        folded = [v.strip().casefold() for v in self.verbalizers]
        if len(set(folded)) != len(folded):
            raise ValueError(f"verbalizers {self.verbalizers} differ only in case or spaces; an endpoint cannot tell them apart")
        if not (timeout_s > 0 and deadline_s > 0 and max_concurrency >= 1 and top_logprobs >= 1
                and breaker_failures >= 1 and max_response_bytes >= 1):
            raise ValueError("timeout_s, deadline_s, max_concurrency, top_logprobs, breaker_failures and "
                             "max_response_bytes must be positive")
        if not (max_retries >= 0 and backoff_s >= 0 and max_retry_after_s >= 0):
            raise ValueError("max_retries, backoff_s and max_retry_after_s must not be negative")
        if bad_responses not in ("raise", "count"):
            raise ValueError(f"bad_responses must be 'raise' or 'count', not {bad_responses!r}")
        self.top_logprobs = top_logprobs
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        self.match = match
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) or None  # read once; never logged or put in a message
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.max_concurrency = max_concurrency
        self.bad_responses = bad_responses
        self.breaker_failures = breaker_failures
        # per kind of request (label log-probs, greedy answers): answers that broke the API's contract before one
        # of that kind kept it; once one has, later breaches of that kind are data
        self._broken_before_kept: dict[str, int | None] = {"score": 0, "answer": 0}
        self.max_response_bytes = max_response_bytes
        self.route = "/chat/completions" if chat else "/completions"
        self._breaker = _Breaker(self.base_url, breaker_failures, deadline_s)
        self._model_listed = False  # GET /models listed self.model (checked before the first request)
        self._min_tokens_refused = False  # the server refused min_tokens once: not sent again
        self._model_lock = threading.Lock()
        self._cache = PairCache(cache_pairs)
        self._answers = AnswerCache()
        self._lock = threading.Lock()  # guards stats and mode, written from worker threads
        self.stats = EndpointStats()
        self.usage = Usage()  # requests answered, and the tokens the server's ``usage`` reported

    def __repr__(self) -> str:
        return f"EndpointLabelScorer({self.base_url!r}, model={self.model!r}, verbalizers={self.verbalizers}, mode={self.stats.mode})"

    # --- public API ------------------------------------------------------------------------
    def score(self, template: Template, texts: Sequence[str]) -> np.ndarray:
        """Label log-probs (normalised over the labels), shape (len(texts), n_labels)."""
        started = time.perf_counter()
        out = np.zeros((len(texts), len(self.verbalizers)), dtype=np.float32)
        todo, hits = self._cache.lookup(template.text, texts, out)
        self.stats.pairs_cached += hits
        try:
            if todo:
                if len(template.variables) != 1:
                    raise ValueError(f"a scored template has one input variable; this one has {list(template.variables)}")
                before, after = template.split_at(template.variables[0])
                unique = list(todo)
                stop = threading.Event()  # set by the first pair that fails: no pair starts after it

                def one(prompt: str) -> np.ndarray | None:
                    if stop.is_set():
                        raise _Skipped()
                    try:
                        return self._score_or_none(prompt)
                    except BaseException:
                        stop.set()
                        raise

                with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(unique))) as pool:
                    futures = [pool.submit(one, before + text + after) for text in unique]
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                    if any(f.exception() is not None for f in done):
                        for f in futures:
                            f.cancel()  # queued pairs are dropped; the pool waits for those in flight
                failed = [f.exception() for f in futures if not f.cancelled()
                          and f.exception() is not None and not isinstance(f.exception(), _Skipped)]
                if failed:
                    self.stats.errors += len(failed)
                    raise failed[0]
                n = len(self.verbalizers)
                for future, text in zip(futures, unique):
                    row = future.result()
                    if row is None:  # a response that broke the contract: no information, and not cached
                        out[todo[text]] = np.full(n, -math.log(n), dtype=np.float32)
                        continue
                    out[todo[text]] = row
                    self._cache.put(template.text, text, row)
                self.stats.pairs_scored += len(unique)
        finally:
            self.stats.seconds += time.perf_counter() - started
        return out

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int,
               complete: Callable[[str], bool] | None = None) -> list[Answer]:
        """The server's greedy answer (temperature 0) to each prompt, at most ``max_new_tokens`` tokens;
        ``truncated`` when the server says it stopped at the limit (``finish_reason: length``). ``complete`` is
        accepted for the in-process path's signature: a server cannot be told when a parse is settled."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        started = time.perf_counter()
        key = (template.text, max_new_tokens)
        out, todo = self._answers.lookup(key, list(texts))
        try:
            if todo:
                before, after = template.split_at(template.variables[0])
                unique = list(todo)
                with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(unique))) as pool:
                    answers = list(pool.map(lambda text: self._answer_one(before + text + after, max_new_tokens), unique))
                for text, found in zip(unique, answers):
                    self._answers.put(key, text, found)
                    for i in todo[text]:
                        out[i] = found
                self.stats.answers_generated += len(unique)
        except EndpointError:
            self.stats.errors += 1
            raise
        finally:
            self.stats.seconds += time.perf_counter() - started
        return out  # type: ignore[return-value]

    def _answer_one(self, prompt: str, max_new_tokens: int) -> Answer:
        payload = self._payload(prompt, logprobs=False)
        payload["max_tokens"] = max_new_tokens
        try:
            data = self._post(payload)
            choice = self._parse(data).choices[0]
        except EndpointResponseError as exc:
            self._invalid(exc, "answer")
            return Answer("", False, 0)  # no answer is an empty one, which breaks any output contract
        self._broken_before_kept["answer"] = None
        text = (choice.message.content if choice.message else None) if self.chat else choice.text
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        tokens = _count(usage.get("completion_tokens"))
        return Answer(text or "", choice.finish_reason == "length", tokens)

    def check(self) -> list[str]:
        """``check_served_model`` for this scorer's server and model."""
        served = check_served_model(self.base_url, self.model, api_key_env=self.api_key_env,
                                    timeout_s=min(self.timeout_s, self.deadline_s), max_bytes=self.max_response_bytes)
        self._model_listed = True
        return served

    def _check_model_listed(self) -> None:
        """Before the first request: a server whose ``GET /models`` lists other models does not serve this one, even
        if it answers (llama.cpp's server answers any model name with the model it has). A server that gives no
        list is not refused here: the request itself then says what is wrong (route, key, connection)."""
        if self._model_listed:
            return
        with self._model_lock:  # one GET, however many threads start at once
            if self._model_listed:
                return
            served, _ = _served_models(self.base_url, self._api_key, min(self.timeout_s, self.deadline_s),
                                       self.max_response_bytes)
            if served is None:
                return
            if self.model not in served:
                raise EndpointError(f"{self.base_url} does not serve model {self.model!r}; it serves {served}")
            self._model_listed = True

    def request_latency_ms(self, template: Template, texts: Sequence[str], n: int = 12) -> dict[str, float]:
        """What a service sees: one request at a time, no cache. p50 and p95 in milliseconds over the requests
        that succeeded, and ``error_rate``: the share that failed after their retries (a fast failure would
        flatter the percentiles and a timeout swamp them, so failures are gated on their own)."""
        before, after = template.split_at(template.variables[0])
        samples, failed = [], 0
        for text in list(texts)[:n]:
            t0 = time.perf_counter()
            try:
                self._score_one(before + text + after)
            except EndpointError:
                failed += 1
                continue
            samples.append((time.perf_counter() - t0) * 1000)
        nan = float("nan")  # every request failed: no latency, which fails the gate's latency bar too
        return {"p50": float(np.percentile(samples, 50)) if samples else nan,
                "p95": float(np.percentile(samples, 95)) if samples else nan,
                "error_rate": failed / max(1, len(samples) + failed)}

    # --- one pair ------------------------------------------------------------------------------
    def _score_or_none(self, prompt: str) -> np.ndarray | None:
        """``_score_one``, or None for a response that broke the API's contract when those are counted."""
        try:
            scores = self._score_one(prompt)
        except EndpointResponseError as exc:
            self._invalid(exc, "score")
            return None
        self._broken_before_kept["score"] = None
        return scores

    def _invalid(self, exc: EndpointResponseError, kind: str) -> None:
        """A response that broke the contract: raised (predict, eval) or counted as no answer (the loop). A server
        whose first ``breaker_failures`` responses of one ``kind`` (``"score"``: label log-probs, ``"answer"``) all
        broke it is not serving a model that kind of request can read: that ends the run too."""
        if self.bad_responses == "raise":
            raise exc
        with self._lock:
            self.stats.responses_invalid += 1
            first = self.stats.responses_invalid == 1
            broken = self._broken_before_kept[kind]
            if broken is not None:
                broken = self._broken_before_kept[kind] = broken + 1
        if broken is not None and broken >= self.breaker_failures:
            what = "label log-probs" if kind == "score" else "answers"
            raise EndpointError(f"{self.base_url} kept the API's contract in none of its first {broken} {what}, so "
                                f"it serves no model to tune. The last: {exc}") from None
        if first:
            logger.warning("%s; counted as an answer naming no label (stats.responses_invalid)", exc)

    def _score_one(self, prompt: str) -> np.ndarray:
        if self.stats.mode != "answers":
            try:
                payload = self._payload(prompt, logprobs=True)
                top = self._top_logprobs(self._post(payload))
                if not top and not self._min_tokens_refused:  # stopped at once and named nothing (llama.cpp)
                    try:
                        top = self._top_logprobs(self._post({**payload, "min_tokens": 1}))
                    except _MinTokensRefused as exc:
                        self._min_tokens_refused = True
                        logger.info("%s refused min_tokens (%s): a pair whose answer stops at once is a uniform "
                                    "row", self.base_url, exc)
                with self._lock:
                    self.stats.mode = self.stats.mode or "logprobs"
                return self._row_from_logprobs(top)
            except _NoLogprobs as exc:
                with self._lock:
                    if self.stats.mode != "answers":
                        logger.warning("%s gives no log-probs (%s): scoring labels from answers", self.base_url, exc)
                    self.stats.mode = "answers"
        return self._row_from_answer(self._answer_text(self._post(self._payload(prompt, logprobs=False))))

    def _payload(self, prompt: str, *, logprobs: bool) -> dict:
        payload: dict = {"model": self.model, "temperature": 0, "max_tokens": 1 if logprobs else ANSWER_MAX_TOKENS}
        if self.chat:
            payload["messages"] = [{"role": "user", "content": prompt}]
            if logprobs:
                payload.update(logprobs=True, top_logprobs=self.top_logprobs)
        else:
            payload["prompt"] = prompt
            if logprobs:
                payload["logprobs"] = self.top_logprobs
        return payload

    def _row_from_logprobs(self, top: list[tuple[str, float]]) -> np.ndarray:
        if not top:  # the model stopped at once and the server named no token, twice: every label floored, alike
            with self._lock:
                self.stats.labels_floored += len(self.verbalizers)
            n = len(self.verbalizers)
            return np.full(n, -math.log(n), dtype=np.float32)
        floor = min(lp for _, lp in top) - FLOOR_MARGIN
        values, floored = [], 0
        for word in self.verbalizers:
            if self.match == "token":
                found = [lp for token, lp in top if token == word]
            else:
                found = [lp for token, lp in top if token.strip().casefold() == word.strip().casefold()]
            if found:
                values.append(float(np.logaddexp.reduce(found)))
            else:
                values.append(floor)
                floored += 1
        if floored:
            with self._lock:
                self.stats.labels_floored += floored
        values = np.asarray(values, dtype=np.float64)
        return (values - np.logaddexp.reduce(values)).astype(np.float32)

    def _row_from_answer(self, answer: str) -> np.ndarray:
        n = len(self.verbalizers)
        first = re.match(r"\W*(\w*)", answer)
        word = first.group(1).casefold() if first else ""
        folded = [v.strip().casefold() for v in self.verbalizers]
        hits = [i for i, v in enumerate(folded) if v == word] or [i for i, v in enumerate(folded) if word and v.startswith(word)]
        if len(hits) != 1:
            with self._lock:
                self.stats.answers_unmapped += 1
            return np.full(n, -math.log(n), dtype=np.float32)
        row = np.full(n, math.log(ANSWER_EPS / (n - 1)), dtype=np.float32)
        row[hits[0]] = math.log(1 - ANSWER_EPS)
        return row

    # --- reading responses -------------------------------------------------------------------
    def _parse(self, data) -> api.ChatResponse | api.CompletionResponse:
        """The response checked against the parts of the OpenAI API this client reads."""
        model = api.ChatResponse if self.chat else api.CompletionResponse
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            if isinstance(data, dict) and data.get("choices") == []:
                problem = f"no choices: {json.dumps(data)[:_DETAIL_CHARS]}"
                raise EndpointResponseError(f"POST {self.base_url}{self.route} answered without choices ({problem})") from None
            raise EndpointResponseError(
                f"{self.base_url} returned a response in the wrong shape for {self.route}: {api.first_problem(exc)}"
            ) from None

    def _top_logprobs(self, data) -> list[tuple[str, float]]:
        """(token text, log-prob) of the first generated position: the chosen token and its alternatives."""
        choice = self._parse(data).choices[0]
        if _stopped_at_once(choice, self.chat):
            return []
        entries: list[tuple[str, float | None]] = []
        if self.chat:
            first = choice.logprobs.content[0] if choice.logprobs and choice.logprobs.content else None
            if first is not None:
                entries.append((first.token, first.logprob))
                entries += [(e.token, e.logprob) for e in first.top_logprobs or []]
        elif choice.logprobs is not None:
            lp = choice.logprobs
            if lp.tokens and lp.token_logprobs:
                entries.append((lp.tokens[0], lp.token_logprobs[0]))
            entries += list(((lp.top_logprobs or [None])[0] or {}).items())
        entries = [(t, v) for t, v in entries if v is not None]  # a completion's first token may carry none
        for token, value in entries:
            if not math.isfinite(value):
                raise EndpointResponseError(f"{self.base_url} returned a non-finite log-prob for {token!r} ({value})")
            if value > LOGPROB_SLACK:
                raise EndpointResponseError(f"{self.base_url} returned log-prob {value} for {token!r}: above 0, "
                                            "a probability above 1")
        if not entries:
            raise _NoLogprobs("the response has no log-probs")
        return list(dict(entries).items())  # the chosen token is also among the alternatives: once each

    def _answer_text(self, data) -> str:
        choice = self._parse(data).choices[0]
        text = (choice.message.content if choice.message else None) if self.chat else choice.text
        return text or ""

    # --- HTTP ---------------------------------------------------------------------------------------
    def _post(self, payload: dict) -> dict:
        """One request: tries, backoffs and waits all inside ``deadline_s``; each try inside ``timeout_s``."""
        self._check_model_listed()
        url = self.base_url + self.route
        body = json.dumps(payload).encode()
        started = time.monotonic()
        deadline = started + self.deadline_s
        last, tries = "", 0
        for attempt in range(self.max_retries + 1):
            self._breaker.check()
            tries += 1
            try:
                data = self._post_once(url, body, payload, min(deadline, time.monotonic() + self.timeout_s))
            except _Retryable as exc:
                last = str(exc)
                self._breaker.failed(last)
                if attempt == self.max_retries:
                    break
                delay = self.backoff_s * 2**attempt * random.uniform(0.5, 1.0)  # jitter: clients do not retry in step
                if exc.wait_s is not None:
                    delay = max(delay, min(exc.wait_s, self.max_retry_after_s))
                if time.monotonic() + delay >= deadline:
                    last += f"; the next try (in {delay:.1f} s) would pass the request's {self.deadline_s:g} s deadline"
                    break
                with self._lock:
                    self.stats.retries += 1
                logger.info("POST %s failed (%s); retry %d of %d in %.2f s", url, last, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
            else:
                self._breaker.succeeded()
                return data
        raise EndpointError(f"POST {url} failed {tries} times; last: {last}. Gave up after "
                            f"{time.monotonic() - started:.1f} s: check the server, or allow more with "
                            "--request-timeout, --request-deadline or --max-retries")

    def _post_once(self, url: str, body: bytes, payload: dict, deadline: float) -> dict:
        with self._lock:
            self.stats.requests += 1
        t0 = time.perf_counter()
        try:
            reply = http_deadline.request("POST", url, body, _headers(self._api_key, content=True),
                                          deadline=deadline, max_bytes=self.max_response_bytes)
        except http_deadline.DeadlineExceeded:
            with self._lock:
                self.stats.timeouts += 1
            raise _Retryable(f"no complete answer within {min(self.timeout_s, self.deadline_s):g} s") from None
        except http_deadline.ConnectionFailed as exc:
            raise _Retryable(f"connection failed: {exc}") from None
        except http_deadline.BodyTooLarge as exc:
            raise EndpointResponseError(f"{self.base_url} returned an answer over the {self.max_response_bytes} "
                                        f"bytes accepted ({exc})") from None
        elapsed_ms = (time.perf_counter() - t0) * 1000
        if reply.status != 200:
            detail = _detail(reply, self._api_key)
            if reply.status == 429 or reply.status >= 500:
                wait_s = _retry_after_s(reply.headers.get("Retry-After")) if reply.status in RETRY_AFTER_STATUSES else None
                raise _Retryable(f"HTTP {reply.status}: {detail}", wait_s)
            raise self._refusal(url, reply.status, detail, payload, reply)
        data = _json(reply, f"POST {url}")
        usage = data.get("usage") if isinstance(data, dict) and isinstance(data.get("usage"), dict) else {}
        with self._lock:
            self.stats.request_ms.append(elapsed_ms)
            self.usage.add(1, _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))
        return data

    def _refusal(self, url: str, code: int, detail: str, payload: dict, reply: http_deadline.Reply) -> Exception:
        """A non-retryable HTTP status as the error that says what to fix (or _NoLogprobs)."""
        if code in (400, 422) and "logprob" in detail.lower() and ("logprobs" in payload or "top_logprobs" in payload):
            return _NoLogprobs(f"the server rejected log-probs: {detail}")
        if code in (400, 422) and "min_tokens" in payload:  # the same request without it was answered
            return _MinTokensRefused(detail)
        if code in (401, 403):
            key_state = "is set" if self._api_key else "is not set"
            return EndpointError(f"POST {url} returned {code} ({detail}): the server refused the API key; ${self.api_key_env} {key_state}")
        if code == 404 and "model" in detail.lower():
            served, _ = _served_models(self.base_url, self._api_key, min(self.timeout_s, self.deadline_s),
                                       self.max_response_bytes)
            listing = f"; it serves {served}" if served else ""
            return EndpointError(f"{self.base_url} does not know model {self.model!r} ({detail}){listing}")
        if code in (404, 405):
            return EndpointError(
                f"POST {url} returned {code} ({detail}): the server has no {self.route} route. "
                f"Is {self.base_url!r} the OpenAI-compatible root (it usually ends in /v1)?"
            )
        if 300 <= code < 400:
            where = reply.headers.get("Location", "elsewhere")
            return EndpointError(f"POST {url} was redirected ({code}) to {where[:_DETAIL_CHARS]!r}: give that "
                                 "address as the URL")
        if 200 <= code < 300:
            return EndpointResponseError(f"POST {url} returned {code}, not 200 with an answer")
        return EndpointError(f"POST {url} returned {code}: {detail}")


def _stopped_at_once(choice: api.ChatChoice | api.CompletionChoice, chat: bool) -> bool:
    """The model's first token was its stop token, and the server (llama.cpp's) left that step out of the
    log-probs: an empty log-probs list, no text, ``finish_reason: stop``. vLLM and the test server name the stop
    step (text "") with its alternatives instead. Not a server without log-probs: that sends ``logprobs: null``."""
    if choice.finish_reason != "stop" or choice.logprobs is None:
        return False
    if isinstance(choice, api.ChatChoice):
        return chat and choice.logprobs.content == [] and not (choice.message and choice.message.content)
    return not chat and choice.logprobs.tokens == [] and not choice.text


def _check_address(base_url: str, model: str) -> None:
    """A URL and a model name that a request can be sent with; a ValueError that says what to give otherwise."""
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL {base_url!r} must start with http:// or https:// (e.g. http://localhost:8000/v1)")
    if not model:
        raise ValueError(f"give the model name that {base_url} serves (GET {base_url.rstrip('/')}/models lists them)")


def check_served_model(base_url: str, model: str, *, api_key_env: str = "TUNE_PROMPTS_API_KEY", timeout_s: float = 30,
                       max_bytes: int = MAX_RESPONSE_BYTES) -> list[str]:
    """At start-up, before any work: the server at ``base_url`` answers ``GET /models`` (in one try of
    ``timeout_s``) and serves ``model``; the served model ids. The one check of a served target or judge (the
    scorers, a tuning run before its Ray actors start, predict); an ``EndpointError`` names what is wrong, a
    ``ValueError`` a URL or model name that cannot work."""
    _check_address(base_url, model)
    base_url = base_url.rstrip("/")
    url = base_url + "/models"
    served, why = _served_models(base_url, os.environ.get(api_key_env) or None, timeout_s, max_bytes)
    if served is None:
        raise EndpointError(
            f"GET {url} gave no model list ({why}): is {base_url!r} the OpenAI-compatible root (it usually "
            "ends in /v1), and is the server up?"
        )
    if model not in served:
        raise EndpointError(f"{base_url} does not serve model {model!r}; it serves {served}")
    return served


def _served_models(base_url: str, api_key: str | None, timeout_s: float, max_bytes: int) -> tuple[list[str] | None, str]:
    """The model ids ``GET {base_url}/models`` lists (None, and why, when it lists none), in one try of ``timeout_s``."""
    try:
        reply = http_deadline.request("GET", base_url + "/models", None, _headers(api_key, content=False),
                                      deadline=time.monotonic() + timeout_s, max_bytes=max_bytes)
    except http_deadline.DeadlineExceeded:
        return None, f"no complete answer within {timeout_s:g} s"
    except (http_deadline.ConnectionFailed, http_deadline.BodyTooLarge) as exc:
        return None, str(exc)
    if reply.status != 200:
        return None, f"HTTP {reply.status}: {_detail(reply, api_key)}"
    try:
        return [m.id for m in api.ModelList.model_validate(_json(reply, "GET /models")).data], ""
    except EndpointResponseError as exc:
        return None, str(exc)
    except ValidationError as exc:
        return None, api.first_problem(exc)


def _headers(api_key: str | None, *, content: bool) -> dict[str, str]:
    headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if content else {})}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _json(reply: http_deadline.Reply, what: str) -> Any:
    """A 200 reply's JSON body; another content type or a body that is not JSON is a response error."""
    kind = (reply.headers.get_content_type() or "").lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise EndpointResponseError(f"{what} answered with content type {kind!r}, not JSON: "
                                    f"{reply.body[:80]!r}")
    try:
        return json.loads(reply.body)
    except (ValueError, RecursionError):
        raise EndpointResponseError(f"{what} answered with something that is not JSON: "
                                    f"{reply.body[:_DETAIL_CHARS]!r}") from None


def _detail(reply: http_deadline.Reply, api_key: str | None) -> str:
    """A refusal's message, short, on one line, the API key blanked out."""
    text = reply.body[:10_000].decode("utf-8", "replace")
    try:  # OpenAI and vLLM: {"error": {"message": ...}}; FastAPI: {"detail": ...}
        data = json.loads(text)
        error = data.get("error", data.get("detail", text))
        text = error.get("message", json.dumps(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        pass
    if api_key:
        text = text.replace(api_key, "***")
    return " ".join(text.split())[:_DETAIL_CHARS] or "no detail"


def make_label_scorer(
    target,
    verbalizers: Sequence[str],
    *,
    model: str | None = None,
    chat_template: bool = True,
    batch_size: int = 64,
    **endpoint_options: Any,
) -> Scorer:
    """A ``LabelScorer`` for a loaded model, an ``EndpointLabelScorer`` for a URL (``model`` then required).

    ``endpoint_options`` go to ``EndpointLabelScorer`` (api_key_env, match, timeout_s, max_retries, ...).
    """
    if isinstance(target, str):
        if not model:
            raise ValueError(f"scoring through {target} needs the model name it serves (--target-model / --judge-model)")
        return EndpointLabelScorer(target, model, verbalizers, chat=chat_template, **endpoint_options)
    if endpoint_options or model:
        raise ValueError(f"model and {sorted(endpoint_options)} apply to endpoints only; the target is a loaded model")
    # Imported here so that importing this module (as the CLI does at start, for EndpointError) loads no torch.
    # A scoring run loads torch anyway, through pipelines.scoring -> pipelines.engine.target, even for URLs.
    from pipelines.engine.target import LabelScorer

    return LabelScorer(target, list(verbalizers), chat_template=chat_template, batch_size=batch_size)
