"""A small OpenAI-compatible HTTP server on loopback, for tests: the real embedded model or a scripted one.

Routes, shaped like vLLM's: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``,
greedy (temperature 0) with real top-k log-probs of each generated token, decoding with a key/value cache and
stopping at the model's stop tokens (``generation_config.eos_token_id``, whose text is not in the answer), as
vLLM does. Chat messages go through the tokenizer's chat template with ``add_generation_prompt=True`` and are
tokenized without special tokens added, as vLLM does for chat. ``usage`` carries ``prompt_tokens`` (the prompt
ids after the chat template), ``completion_tokens`` and ``total_tokens``; ``server.usage_totals`` adds them up
over every answered request. Errors look like vLLM's: ``{"error": {"message", "type", "code"}}``, and an unknown
route is FastAPI's ``{"detail": "Not Found"}``.

``server.faults`` simulates a bad or distant server (it may be changed while running):
``latency_s`` (a network round trip: every request waits this long, concurrently with the others),
``stall_s`` (sleep before answering), ``fail_first`` (500 for the first N completion requests),
``rate_limit_first`` (429 for the first N), ``no_logprobs`` (answer text only, ``logprobs: null``),
``no_choices`` (200 with an empty ``choices`` list), two ways llama.cpp's server differs from vLLM
(docs/endpoints.md, "llama.cpp's server"): ``any_model`` (a request for any model name gets this model's answer)
and ``stop_step_dropped`` (the stop token's step is left out of the log-probs, so an answer that stops at once
has an empty log-probs list); ``min_tokens_refused`` (400 for a request with ``min_tokens``, as OpenAI's API
answers a parameter it does not have), and ``mode``, one of ``FAULT_MODES``: a server that breaks
on every completion request in one way (the models list still answers, so a client gets as far as scoring):

* on the wire: ``stall`` (never answers), ``trickle`` (a good answer, one byte every ``trickle_s``), ``reset``
  (the connection is reset, no answer), ``huge`` (a 200 whose body never ends: ``huge_bytes`` of JSON-ish bytes);
* statuses: ``rate_limit`` (429 with ``Retry-After: retry_after``), ``rate_limit_bare`` (429, no Retry-After),
  ``unavailable`` (503 with Retry-After), ``error500`` (500);
* lies in a 200: ``garbage`` (an HTML page), ``not_json`` (JSON content type, broken JSON), ``wrong_shape``
  (``choices`` is an object), ``number_text`` (a number where the answer's text and tokens belong), ``nan`` and
  ``inf`` (every log-prob NaN or Infinity).

    with OpenAICompatServer(ModelBackend(load_causal_lm()), "smollm2") as server:
        server.base_url  # http://127.0.0.1:<free port>/v1

Run it by hand to point the CLI at it: ``python tests/openai_compat_server.py --port 8000 [--latency-ms 50]``;
once it serves, it prints one line to stdout, ``serving <name> at http://127.0.0.1:<port>/v1``.

Requests that arrive together are not batched (vLLM would): the model answers one at a time under a lock. On
2 AVX2 cores in float32, one left-padded pass over 8 risk prompts ran 0.91 times as fast as 8 single passes with
1 torch thread and 1.13-1.20 times as fast with 2 (padding eats most of the gain): not worth a batching scheduler.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's chat API limit

# One generated position: the chosen token, its log-prob, and the top alternatives [(token, log-prob)].
Step = tuple[str, float, list[tuple[str, float]]]


@dataclass
class Faults:
    latency_s: float = 0.0  # a simulated network round trip: every request waits this long, outside the model lock
    stall_s: float = 0.0  # sleep this long before answering a completion request
    fail_first: int = 0  # answer the first N completion requests with 500
    rate_limit_first: int = 0  # answer the first N completion requests with 429
    no_logprobs: bool = False  # a server without log-probs: answer text only
    no_choices: bool = False  # a broken server: 200 with an empty "choices" list
    any_model: bool = False  # like llama.cpp's server: answer a request for any model name with this model
    stop_step_dropped: bool = False  # like llama.cpp's server: no log-probs entry for the stop token's step
    min_tokens_refused: bool = False  # like OpenAI's API: 400 for a request with min_tokens
    mode: str | None = None  # one of FAULT_MODES: every completion request breaks that way
    trickle_s: float = 0.2  # mode "trickle": seconds between bytes
    retry_after: str = "0"  # rate_limit_first and modes "rate_limit", "unavailable": the Retry-After header
    huge_bytes: int = 64 * 2**20  # mode "huge": bytes sent before the server gives up


FAULT_MODES = ("stall", "trickle", "reset", "huge", "rate_limit", "rate_limit_bare", "unavailable", "error500",
               "garbage", "not_json", "wrong_shape", "number_text", "nan", "inf")


class ModelBackend:
    """The real model, greedy. One request at a time: a lock keeps CPU threads from fighting."""

    def __init__(self, lm):
        self.lm = lm
        self._lock = threading.Lock()
        eos = getattr(lm.model.generation_config, "eos_token_id", None)  # SmolLM2's <|im_end|>, where vLLM reads it
        self._stop = {*([eos] if isinstance(eos, int) else eos or []), lm.tokenizer.eos_token_id} - {None}

    def prompt_ids(self, messages: list[dict] | None, prompt: str | None) -> list[int]:
        tok = self.lm.tokenizer
        if messages is not None:
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(prompt, add_special_tokens=False).input_ids

    def generate(self, messages: list[dict] | None, prompt: str | None, max_tokens: int,
                 top_k: int) -> tuple[int, list[Step]]:
        """(prompt tokens, the generated steps)."""
        import torch

        tok, model = self.lm.tokenizer, self.lm.model
        ids = self.prompt_ids(messages, prompt)
        steps: list[Step] = []
        step_ids, cache = ids, None
        with self._lock, torch.inference_mode():
            for _ in range(max_tokens):
                out = model(input_ids=torch.tensor([step_ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                values, indices = logprobs.topk(max(top_k, 1))
                chosen = int(indices[0])
                top = [(tok.decode([int(i)]), float(v)) for v, i in zip(values[:top_k], indices[:top_k])]
                if chosen in self._stop:  # like vLLM: the stop token ends the answer, its text is not in it
                    steps.append(("", float(values[0]), top))
                    break
                steps.append((tok.decode([chosen]), float(values[0]), top))
                step_ids = [chosen]
        return len(ids), steps


class ScriptedBackend:
    """No model: ``rule(prompt text) -> [(token, log-prob)]``, most likely first. One step, the rule's first token.
    Without a tokenizer, ``prompt_tokens`` counts the whitespace-separated words of the prompt (every message's)."""

    def __init__(self, rule: Callable[[str], list[tuple[str, float]]]):
        self.rule = rule

    def generate(self, messages: list[dict] | None, prompt: str | None, max_tokens: int,
                 top_k: int) -> tuple[int, list[Step]]:
        text = messages[-1]["content"] if messages is not None else prompt
        texts = [str(m.get("content", "")) for m in messages] if messages is not None else [prompt]
        words = sum(len(t.split()) for t in texts)
        top = self.rule(text)
        return words, [(top[0][0], top[0][1], top[:top_k])]


class OpenAICompatServer:
    def __init__(self, backend, model_name: str = "smollm2-135m-instruct", *, api_key: str | None = None,
                 faults: Faults | None = None, max_logprobs: int | None = None):
        self.backend = backend
        self.model_name = model_name
        self.api_key = api_key
        self.faults = faults or Faults()
        self.max_logprobs = max_logprobs  # like vLLM's --max-logprobs (None: MAX_TOP_LOGPROBS)
        self.completion_requests = 0  # POSTs to a completion route, faulted ones included
        self.usage_totals = {"prompt_tokens": 0, "completion_tokens": 0}  # over the answered completion requests
        self.log: list[tuple[str, int]] = []  # (path, status) of every request
        self.request_times: list[float] = []  # time.monotonic() at each completion request's arrival
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def port(self) -> int:
        assert self._httpd is not None, "start() the server first"
        return self._httpd.server_address[1]

    def start(self, port: int = 0) -> "OpenAICompatServer":
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="openai-compat-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stopping.set()  # wakes stalled handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        self._httpd = None

    def __enter__(self) -> "OpenAICompatServer":
        return self.start() if self._httpd is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- request handling (called from handler threads) ----------------------------------------------
    def handle(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict, dict]:
        """(status, JSON body, extra headers) for one request."""
        faults = self.faults
        if faults.latency_s:  # on the wire, not in the model: concurrent requests wait at the same time
            self._stopping.wait(faults.latency_s)
        if self.api_key is not None and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}, {}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "tests"}]}, {}
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return 404, {"detail": "Not Found"}, {}
        with self._count_lock:
            self.completion_requests += 1
            n = self.completion_requests
            self.request_times.append(time.monotonic())
        if faults.stall_s:
            self._stopping.wait(faults.stall_s)
        if faults.mode == "stall":
            self._stopping.wait()
            return 503, _error("the server is stopping", "ServiceUnavailable", 503), {}
        status_fault = {"rate_limit": (429, {"Retry-After": faults.retry_after}), "rate_limit_bare": (429, {}),
                        "unavailable": (503, {"Retry-After": faults.retry_after}), "error500": (500, {})}
        if faults.mode in status_fault:
            code, extra = status_fault[faults.mode]
            return code, _error(f"simulated {faults.mode}", "SimulatedFault", code), extra
        if n <= faults.fail_first:
            return 500, _error(f"simulated failure {n} of {faults.fail_first}", "InternalServerError", 500), {}
        if n <= faults.rate_limit_first:
            return 429, _error("simulated rate limit", "RateLimitError", 429), {"Retry-After": faults.retry_after}
        try:
            request = json.loads(body)
        except ValueError:
            return 400, _error("the body is not JSON", "BadRequestError", 400), {}
        if request.get("model") != self.model_name and not faults.any_model:
            return 404, _error(f"The model `{request.get('model')}` does not exist.", "NotFoundError", 404), {}
        chat = path.endswith("/chat/completions")
        if chat:
            want = request.get("top_logprobs", 0) if request.get("logprobs") else None
        else:
            want = request.get("logprobs")
        limit = self.max_logprobs or MAX_TOP_LOGPROBS
        if want is not None and not 0 <= int(want) <= limit:
            return 400, _error(f"logprobs must be between 0 and {limit}", "BadRequestError", 400), {}
        if request.get("min_tokens") is not None and faults.min_tokens_refused:
            return 400, _error("Unrecognized request argument supplied: min_tokens", "invalid_request_error", 400), {}
        if faults.no_choices:
            return 200, {"id": f"cmpl-{n}", "object": "chat.completion", "model": self.model_name, "choices": []}, {}
        if faults.no_logprobs:
            want = None
        prompt_tokens, steps = self.backend.generate(
            request.get("messages") if chat else None, None if chat else request.get("prompt", ""),
            int(request.get("max_tokens") or 16), int(want or 0),
        )
        if request.get("min_tokens") and steps and steps[0][0] == "":
            # min_tokens 1, as llama.cpp applies it: the stop token is barred from the first step, whose
            # log-probs stay the raw ones. One step only: the label read that sends it asks for one token.
            token, logprob = next(((t, lp) for t, lp in steps[0][2] if t != ""), ("", steps[0][1]))
            steps = [(token, logprob, steps[0][2])]
        with self._count_lock:
            self.usage_totals["prompt_tokens"] += prompt_tokens
            self.usage_totals["completion_tokens"] += len(steps)
        text = "".join(token for token, _, _ in steps)
        limit = int(request.get("max_tokens") or 16)
        stopped = len(steps) < limit or (steps and steps[-1][0] == "")  # "": the end-of-sequence token
        if faults.stop_step_dropped and stopped and steps and steps[-1][0] == "":
            steps = steps[:-1]
        choice: dict = {"index": 0, "finish_reason": "stop" if stopped else "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None if want is None else {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in top]}
                for t, lp, top in steps
            ]}
        else:
            choice["text"] = text
            choice["logprobs"] = None if want is None else {
                "tokens": [t for t, _, _ in steps],
                "token_logprobs": [lp for _, lp, _ in steps],
                "top_logprobs": [dict(top) for _, _, top in steps],
            }
        return 200, _lie(faults.mode, {
            "id": f"cmpl-{n}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(steps),
                      "total_tokens": prompt_tokens + len(steps)},
        }), {}


def _lie(mode: str | None, answer: dict) -> dict:
    """A good answer changed the way a lying server would change it (modes wrong_shape, number_text, nan, inf)."""
    if mode == "wrong_shape":
        return {**answer, "choices": {"0": answer["choices"][0]}}
    value = {"nan": float("nan"), "inf": float("inf")}.get(mode)
    for choice in answer["choices"]:
        if mode == "number_text":
            if "message" in choice:
                choice["message"]["content"] = 7
            else:
                choice["text"] = 7
        logprobs = choice.get("logprobs") or {}
        for step in logprobs.get("content") or []:  # chat
            if mode == "number_text":
                step["token"] = 7
            if value is not None:
                step["logprob"] = value
                for alt in step["top_logprobs"]:
                    alt["logprob"] = value
        if value is not None and logprobs.get("token_logprobs"):  # completions
            logprobs["token_logprobs"] = [value for _ in logprobs["token_logprobs"]]
            logprobs["top_logprobs"] = [{t: value for t in top} for top in logprobs["top_logprobs"]]
        if mode == "number_text" and logprobs.get("tokens"):
            logprobs["tokens"] = [7 for _ in logprobs["tokens"]]
    return answer


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _handler_for(server: OpenAICompatServer):
    class Handler(BaseHTTPRequestHandler):
        def _respond(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?", 1)[0]
            status, payload, extra = server.handle(method, path, self.headers, body)
            server.log.append((path, status))
            data = json.dumps(payload).encode()
            mode = server.faults.mode if path != "/v1/models" else None
            content_type = "application/json"
            if mode == "garbage":
                data, content_type = b"<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"
            elif mode == "not_json":
                data = b'{"choices": [{"message": {"content": "yes"'
            try:
                if mode == "reset":  # SO_LINGER 0: close() sends a TCP reset, not an orderly end
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                if mode != "huge":
                    self.send_header("Content-Length", str(len(data)))
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                if mode == "trickle":
                    for i in range(len(data)):
                        if server._stopping.wait(server.faults.trickle_s):
                            return
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                elif mode == "huge":  # no Content-Length: the body ends when the connection does
                    self.close_connection = True
                    block = b'{"pad": "' + b"x" * 65536
                    for _ in range(server.faults.huge_bytes // len(block)):
                        self.wfile.write(block)
                else:
                    self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a stalled answer after its timeout)

        def do_GET(self) -> None:
            self._respond("GET")

        def do_POST(self) -> None:
            self._respond("POST")

        def log_message(self, format: str, *args) -> None:  # quiet; server.log has what tests need
            pass

    return Handler


if __name__ == "__main__":
    import argparse
    import sys

    from pipelines.engine.models import EMBEDDED, load_causal_lm

    parser = argparse.ArgumentParser(description="Serve the embedded model over an OpenAI-compatible API on loopback.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=EMBEDDED, help="what load_causal_lm() loads")
    parser.add_argument("--name", default="smollm2-135m-instruct", help="the model id clients send")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the machine's (models.default_dtype)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="a simulated network round trip per request")
    parser.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, help="as vLLM's: the most top log-probs a request may ask for")
    parser.add_argument("--fault", choices=FAULT_MODES, help="break every completion request this way")
    args = parser.parse_args()
    if args.latency_ms < 0:
        parser.error(f"--latency-ms {args.latency_ms} must not be negative")
    srv = OpenAICompatServer(ModelBackend(load_causal_lm(args.model, dtype=args.dtype)), args.name,
                             faults=Faults(latency_s=args.latency_ms / 1000, mode=args.fault), max_logprobs=args.max_logprobs).start(args.port)
    print(f"serving {args.name} at {srv.base_url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.stop()
