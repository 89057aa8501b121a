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

``answers`` -- when the server returns no log-probs (or rejects the parameter): ``max_tokens=3,
temperature=0`` and the answer's first word picks the label whose verbalizer it is (case-insensitive; a
word that begins exactly one verbalizer also counts, for answers cut short). That label gets log(1 - 1e-3),
the others share 1e-3; an answer naming no label gives every label log(1/n) and counts in
``stats.answers_unmapped``. Scores then take two values per label, so ROC-AUC is coarse.

Failures: each request has a per-socket-operation timeout; connection errors, timeouts, 429 and 5xx are
retried ``max_retries`` times with exponential backoff (``backoff_s * 2**attempt``; a 429's numeric
Retry-After is honoured up to ``timeout_s``). Anything else (404 on the route, a model the server does not
serve, a refused key, a response without choices) raises ``EndpointError`` at once, naming the URL and what
is missing. A pair that fails for good counts in ``stats.errors`` and its ``score`` call raises. The API key
comes from the environment variable ``api_key_env``, is sent as a bearer token, and never appears in a
message or a log line.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from pipelines.engine.answers import Answer, AnswerCache
from pipelines.engine.pair_cache import PairCache
from pipelines.engine.usage import Usage
from templates.template import Template

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 20
ANSWER_MAX_TOKENS = 3
ANSWER_EPS = 1e-3
FLOOR_MARGIN = math.log(2.0)
_DETAIL_CHARS = 300


class EndpointError(RuntimeError):
    """The endpoint cannot give what scoring needs; the message names the URL and what is missing."""


@dataclass
class EndpointStats:
    mode: str | None = None  # "logprobs" or "answers": how labels were read (None before the first answer)
    pairs_scored: int = 0  # answered by the server
    pairs_cached: int = 0  # answered from the cache
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0  # requests repeated after a timeout, a connection error, 429 or 5xx
    timeouts: int = 0  # requests that got no answer within timeout_s
    errors: int = 0  # pairs that failed for good (their score() call raised EndpointError)
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


class _NoLogprobs(Exception):
    """The server does not give log-probs: switch to answers mode."""


def _count(value) -> int:
    """A token count from a server's ``usage`` (0 when it sends none or nonsense)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EndpointLabelScorer:
    """Label scoring through an OpenAI-compatible server. ``score`` is not re-entrant; one per caller."""

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
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 4,
        cache_pairs: int = 200_000,
        top_logprobs: int = TOP_LOGPROBS,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint URL {base_url!r} must start with http:// or https:// (e.g. http://localhost:8000/v1)")
        if not model:
            raise ValueError(f"give the model name that {base_url} serves (GET {base_url.rstrip('/')}/models lists them)")
        if match not in ("token", "word"):
            raise ValueError(f"match must be 'token' or 'word', not {match!r}")
        self.verbalizers = list(verbalizers)
        if len(self.verbalizers) < 2 or any(not v.strip() for v in self.verbalizers):
            raise ValueError(f"need at least two non-empty verbalizers, got {self.verbalizers}")
        folded = [v.strip().casefold() for v in self.verbalizers]
        if len(set(folded)) != len(folded):
            raise ValueError(f"verbalizers {self.verbalizers} differ only in case or spaces; an endpoint cannot tell them apart")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_concurrency < 1 or top_logprobs < 1:
            raise ValueError("timeout_s, max_concurrency and top_logprobs must be positive, max_retries and backoff_s "
                             "not negative")
        self.top_logprobs = top_logprobs
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        self.match = match
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) or None  # read once; never logged or put in a message
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self.route = "/chat/completions" if chat else "/completions"
        # A proxy from the environment is for the outside world, never for this machine's own servers.
        self._opener = urllib.request.build_opener(
            *([urllib.request.ProxyHandler({})] if _is_loopback(self.base_url) else [])
        )
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
                with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(unique))) as pool:
                    futures = [pool.submit(self._score_one, before + text + after) for text in unique]
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                    if any(f.exception() is not None for f in done):
                        for f in futures:
                            f.cancel()  # queued pairs are dropped; the pool waits for those in flight
                failed = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
                if failed:
                    self.stats.errors += len(failed)
                    raise failed[0]
                for future, text in zip(futures, unique):
                    row = future.result()
                    out[todo[text]] = row
                    self._cache.put(template.text, text, row)
                self.stats.pairs_scored += len(unique)
        finally:
            self.stats.seconds += time.perf_counter() - started
        return out

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int, complete=None) -> list[Answer]:
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
        data = self._post(payload)
        choice = self._choice(data)
        text = self._answer_text(data)
        if not isinstance(text, str):
            text = ""  # a malformed answer is an empty one, which breaks any contract
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        tokens = _count(usage.get("completion_tokens"))
        return Answer(text, choice.get("finish_reason") == "length", tokens)

    def check(self) -> list[str]:
        """At start-up: the server answers ``GET /models`` and serves ``model``. Returns the served model ids."""
        url = self.base_url + "/models"
        served = self._served_models()
        if served is None:
            raise EndpointError(
                f"GET {url} gave no model list: is {self.base_url!r} the OpenAI-compatible root (it usually ends in /v1)?"
            )
        if self.model not in served:
            raise EndpointError(f"{self.base_url} does not serve model {self.model!r}; it serves {served}")
        return served

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
    def _score_one(self, prompt: str) -> np.ndarray:
        if self.stats.mode != "answers":
            try:
                top = self._top_logprobs(self._post(self._payload(prompt, logprobs=True)))
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
    def _choice(self, data: dict) -> dict:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise EndpointError(
                f"POST {self.base_url}{self.route} answered without choices: {json.dumps(data)[:_DETAIL_CHARS]}"
            )
        return choices[0]

    def _top_logprobs(self, data: dict) -> list[tuple[str, float]]:
        """(token text, log-prob) of the first generated position: the chosen token and its alternatives."""
        logprobs = self._choice(data).get("logprobs") or {}
        entries: list[tuple[str, float]] = []
        try:
            if self.chat:
                first = (logprobs.get("content") or [None])[0]
                if first:
                    entries.append((first["token"], first["logprob"]))
                    entries += [(e["token"], e["logprob"]) for e in first.get("top_logprobs") or []]
            else:
                if logprobs.get("tokens"):
                    entries.append((logprobs["tokens"][0], logprobs["token_logprobs"][0]))
                entries += list(((logprobs.get("top_logprobs") or [None])[0] or {}).items())
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise EndpointError(
                f"POST {self.base_url}{self.route}: log-probs in an unexpected shape ({type(exc).__name__}: {exc})"
            ) from None
        entries = [(t, float(lp)) for t, lp in entries if isinstance(t, str) and lp is not None and math.isfinite(float(lp))]
        if not entries:
            raise _NoLogprobs("the response has no log-probs")
        return list(dict(entries).items())  # the chosen token is also among the alternatives: once each

    def _answer_text(self, data: dict) -> str:
        choice = self._choice(data)
        text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
        return text or ""

    # --- HTTP ---------------------------------------------------------------------------------------
    def _post(self, payload: dict) -> dict:
        url = self.base_url + self.route
        body = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                return self._post_once(url, body, payload)
            except _Retryable as exc:
                last = str(exc)
                if attempt == self.max_retries:
                    break
                delay = self.backoff_s * 2**attempt
                if exc.wait_s is not None:
                    delay = max(delay, min(exc.wait_s, self.timeout_s))
                with self._lock:
                    self.stats.retries += 1
                logger.info("POST %s failed (%s); retry %d of %d in %.2f s", url, last, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise EndpointError(f"POST {url} failed {self.max_retries + 1} times; last: {last}")

    def _post_once(self, url: str, body: bytes, payload: dict) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with self._lock:
            self.stats.requests += 1
        t0 = time.perf_counter()
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = self._detail(exc)
            if exc.code == 429 or exc.code >= 500:
                retry_after = exc.headers.get("Retry-After", "") if exc.headers else ""
                raise _Retryable(
                    f"HTTP {exc.code}: {detail}", float(retry_after) if retry_after.strip().isdigit() else None
                ) from None
            raise self._refusal(url, exc.code, detail, payload) from None
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, refused connections
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                with self._lock:
                    self.stats.timeouts += 1
                raise _Retryable(f"no answer within {self.timeout_s} s") from None
            raise _Retryable(f"connection failed: {type(reason).__name__}: {reason}") from None
        elapsed_ms = (time.perf_counter() - t0) * 1000
        try:
            data = json.loads(raw)
        except ValueError:
            raise EndpointError(f"POST {url} answered with something that is not JSON: {raw[:_DETAIL_CHARS]!r}") from None
        usage = data.get("usage") if isinstance(data, dict) and isinstance(data.get("usage"), dict) else {}
        with self._lock:
            self.stats.request_ms.append(elapsed_ms)
            self.usage.add(1, _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))
        return data

    def _detail(self, exc: urllib.error.HTTPError) -> str:
        try:
            text = exc.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        try:  # OpenAI and vLLM: {"error": {"message": ...}}; FastAPI: {"detail": ...}
            data = json.loads(text)
            error = data.get("error", data.get("detail", text))
            text = error.get("message", json.dumps(error)) if isinstance(error, dict) else str(error)
        except (ValueError, AttributeError):
            pass
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return text.strip()[:_DETAIL_CHARS] or exc.reason or "no detail"

    def _refusal(self, url: str, code: int, detail: str, payload: dict) -> Exception:
        """A non-retryable HTTP error as the error that says what to fix (or _NoLogprobs)."""
        if code in (400, 422) and "logprob" in detail.lower() and ("logprobs" in payload or "top_logprobs" in payload):
            return _NoLogprobs(f"the server rejected log-probs: {detail}")
        if code in (401, 403):
            key_state = "is set" if self._api_key else "is not set"
            return EndpointError(f"POST {url} returned {code} ({detail}): the server refused the API key; ${self.api_key_env} {key_state}")
        if code == 404 and "model" in detail.lower():
            served = self._served_models()
            listing = f"; it serves {served}" if served else ""
            return EndpointError(f"{self.base_url} does not know model {self.model!r} ({detail}){listing}")
        if code in (404, 405):
            return EndpointError(
                f"POST {url} returned {code} ({detail}): the server has no {self.route} route. "
                f"Is {self.base_url!r} the OpenAI-compatible root (it usually ends in /v1)?"
            )
        return EndpointError(f"POST {url} returned {code}: {detail}")

    def _served_models(self) -> list[str] | None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            request = urllib.request.Request(self.base_url + "/models", headers=headers)
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return [m["id"] for m in json.loads(response.read())["data"]]
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException):
            return None


def make_label_scorer(
    target,
    verbalizers: Sequence[str],
    *,
    model: str | None = None,
    chat_template: bool = True,
    batch_size: int = 64,
    **endpoint_options,
):
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
