"""The prompt gateway: ``tune-prompts serve``, an HTTP API on Ray Serve in front of the template store and the target.

    POST /v1/predict {task, inputs, key?, label?, deadline_ms?} -> {label, value, version, arm, answer, logprobs, ...}
    POST /v1/render  {task, inputs, key?, label?}               -> {prompt, version, arm}
    GET  /v1/tasks/{task}                                        -> versions, labels, canary share and ramp
    GET  /healthz                                                -> this replica is up, the tasks it serves
    GET  /metrics                                                -> Prometheus text: this replica's counters

One deployment, ``Gateway``, with one or more replicas. Each replica holds its own ``TemplateReader`` (its watcher
thread applies the store's label moves, so a promotion, rollback or ramp step is served without a restart) and its
own target: the embedded model loaded in the replica, or a scorer of an OpenAI-compatible server. A predict goes
through ``TemplateReader.predict_many``, the code ``TemplateReader.predict`` runs, so the gateway's answer is the
library's. Routing by caller key is a hash of task and key (``templates/routing.py``): the same arm on every
replica, in every process.

Batching: concurrent predicts wait up to ``batch_wait_ms`` in Ray Serve's ``@serve.batch`` queue and go to the
target together, at most ``max_batch_size`` at a time; calls routed to the same version share one forward pass
with the prompt before the input computed once. The forward pass runs on a worker thread, so the replica's event
loop keeps taking requests (and filling the next batch) meanwhile, and one batch runs at a time.

Deadlines: a request has ``deadline_ms`` (the task's, or a shorter one it asks for) from the moment its replica
takes it. Reading the body, waiting in the batch queue and the model call all count. A request past it gets a 504
with one line. When a batch starts, the calls it could not finish in time (``BatchCost``: what batches of each
size took) are shed with a 504 before the model runs, so an overloaded replica spends its time on calls that can
still be answered instead of answering everything late. Errors are one line of JSON, ``{"error": ..., "kind":
...}``; the statuses are listed in ``pipelines/gateway_requests.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipelines.config import ConfigError, ModelSource
from pipelines.gateway_requests import BatchCost, CallBody, GatewayError, GatewaySettings, parse_call, status_of

ROUTES = "POST /v1/predict, POST /v1/render, GET /v1/tasks/TASK, GET /healthz, GET /metrics"


@dataclass(frozen=True)
class ServedTask:
    """What the gateway needs of a task file: how its target is asked (chat template, batch size)."""

    name: str
    chat_template: bool
    batch_size: int


@dataclass
class _Job:
    call: Any  # templates.serving.Call
    deadline: float  # monotonic seconds


class _Targets:
    """The replica's target model, and one label scorer per (label words, chat template) over it."""

    def __init__(self, source: ModelSource, tasks: dict[str, ServedTask]) -> None:
        from pipelines.config import Endpoint
        from pipelines.scoring import load_source

        self._model = load_source(source)
        self.local = not isinstance(self._model, Endpoint)  # a model in this process, not a server's
        self._tasks = tasks
        self._scorers: dict[tuple, Any] = {}

    def __call__(self, task: str, template) -> Any:
        from pipelines.scoring import label_scorer
        from rewards.judge import JUDGE_VERBALIZERS

        served = self._tasks[task]
        words = tuple(template.decision.verbalizers or JUDGE_VERBALIZERS)  # a generation task reads no labels
        key = (words, served.chat_template, served.batch_size)
        if key not in self._scorers:
            self._scorers[key] = label_scorer(self._model, words, chat_template=served.chat_template,
                                              batch_size=served.batch_size)
        return self._scorers[key]


class _Metrics:
    """This replica's Prometheus series, each labelled with the replica."""

    def __init__(self, replica: str) -> None:
        self.registry = CollectorRegistry()
        self.replica = replica
        self.requests = Counter("gateway_requests", "requests by route and status", ["replica", "route", "code"],
                                registry=self.registry)
        self.latency = Histogram("gateway_request_seconds", "time from the replica taking a request to its answer",
                                 ["replica", "route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2.5, 5))
        self.batch = Histogram("gateway_batch_size", "calls per batch sent to the target", ["replica"],
                               registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.errors = Counter("gateway_errors", "refused or failed requests by kind", ["replica", "kind"],
                              registry=self.registry)
        self.version = Gauge("gateway_served_version", "the version id last served per task and arm",
                             ["replica", "task", "arm"], registry=self.registry)

    def done(self, route: str, code: int, started: float) -> None:
        self.requests.labels(self.replica, route, str(code)).inc()
        self.latency.labels(self.replica, route).observe(time.monotonic() - started)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": message, "kind": kind}, status_code=status)


@serve.deployment(name="gateway", max_ongoing_requests=512)
class Gateway:
    def __init__(self, store_url: str, target: ModelSource, tasks: dict[str, ServedTask], settings: dict) -> None:
        import torch

        from templates.serving import TemplateReader

        self.settings = GatewaySettings.model_validate(settings)
        torch.set_num_threads(self.settings.threads or max(1, (os.cpu_count() or 1) // self.settings.replicas))
        self.tasks = tasks
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a unit test constructing the class): one replica
            self.replica = "local"
        self.reader = TemplateReader(store_url, refresh_s=self.settings.refresh_s)
        self.targets = _Targets(target, tasks)
        self.series = _Metrics(self.replica)
        self.cost = BatchCost()
        self._warm_up()
        batched: Any = self._batched  # Serve's batch wrapper, typed as the method it wraps
        batched.set_max_batch_size(self.settings.max_batch_size)
        batched.set_batch_wait_timeout_s(self.settings.batch_wait_ms / 1000)

    def _warm_up(self) -> None:
        """Forward passes over each served task's production version before the first request, one per batch size
        up to the largest: a model's first call pays for set-up (allocations, and oneDNN's kernels for the row
        counts of ``packed_llama.by_rows``) that must not count against a caller's deadline."""
        if not self.targets.local:
            return  # a served target: its server warms itself; no calls it would bill
        sizes = sorted({min(n, self.settings.max_batch_size) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)})
        for task in self.tasks:
            try:
                template = self.reader.get(task)
                if template.decision is None:
                    continue
                frame, _ = template.input_frame()
                scorer = self.targets(task, template)
                for n in sizes:
                    for _ in range(2):  # the second pass of a size is what a warm replica takes
                        started = time.monotonic()
                        scorer.score(frame, [f"warm-up message {i} of {n} ({started})" for i in range(n)])
                    self.cost.observe(n, time.monotonic() - started)
            except Exception:  # noqa: BLE001 - no production version yet, or a damaged one: its requests say so
                pass

    # --- requests ---------------------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP proxy hands every request here: the route by method and path."""
        method, path = request.method, request.url.path.rstrip("/")
        if path == "/v1/predict" and method == "POST":
            return await self.predict(request)
        if path == "/v1/render" and method == "POST":
            return await self.render(request)
        if path.startswith("/v1/tasks/") and method == "GET":
            return await self.task(path.removeprefix("/v1/tasks/"))
        if path == "/healthz" and method == "GET":
            return await self.healthz()
        if path == "/metrics" and method == "GET":
            return await self.metrics()
        known = path in ("/v1/predict", "/v1/render", "/healthz", "/metrics") or path.startswith("/v1/tasks/")
        self.series.errors.labels(self.replica, "refused").inc()
        return _error(405 if known else 404, f"{'method not allowed' if known else 'no such route'}: {method[:10]} "
                      f"{path[:80]!r}; the gateway serves {ROUTES}", "refused")

    async def predict(self, request: Request) -> Response:
        started = time.monotonic()
        code, body = await self._predict(request, started)
        self.series.done("predict", code, started)
        if code != 200:
            self.series.errors.labels(self.replica, body["kind"]).inc()
        else:
            body["latency_ms"] = round((time.monotonic() - started) * 1000, 2)
        return JSONResponse(body, status_code=code)

    async def _predict(self, request: Request, started: float) -> tuple[int, dict]:
        from templates.serving import Call

        limit_s = self.settings.deadline_ms / 1000
        try:
            call = await self._read(request, started)
            limit_s = min(self.settings.deadline_s(call.task), (call.deadline_ms or 1e9) / 1000)
            self.reader.render(call.task, call.inputs, label=call.label, key=call.key)  # a bad route or input is
            # refused here, before it waits in the queue (predict_many checks again, against the state it reads)
            job = _Job(Call(call.task, call.inputs, call.label, call.key), started + limit_s)
            result = await asyncio.wait_for(self._batched(job), timeout=max(0.0, job.deadline - time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):
            return 504, {"error": f"no answer within the deadline of {limit_s * 1000:.0f} ms: retry, or ask the "
                                  "operator for more replicas or a longer deadline for the task", "kind": "deadline"}
        except GatewayError as exc:
            return exc.status, {"error": exc.message, "kind": "refused"}
        except Exception as exc:  # noqa: BLE001 - the route or the input refused before queueing: its status
            status, kind = status_of(exc)
            return status, {"error": _one_line(exc), "kind": kind}
        if isinstance(result, BaseException):
            status, kind = status_of(result)
            return status, {"error": _one_line(result), "kind": kind}
        self.series.version.labels(self.replica, call.task, result.arm).set(result.version_id)
        return 200, {"label": result.label, "value": result.value, "version": result.version_id, "arm": result.arm,
                     "answer": result.answer, "contract_broken": result.reason or None, "logprobs": result.logprobs,
                     "replica": self.replica}

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def _batched(self, jobs: list[_Job]) -> list[Any]:
        """One batch: the calls that can still be answered within their deadlines (``BatchCost.admit``; the others
        are shed with a 504) go to the target together, on a worker thread."""
        self.series.batch.labels(self.replica).observe(len(jobs))
        admitted = self.cost.admit([job.deadline for job in jobs], time.monotonic())
        results: list[Any] = [TimeoutError("shed: it could not be answered within its deadline")] * len(jobs)
        if admitted:
            started = time.monotonic()
            done = await asyncio.to_thread(self.reader.predict_many, [jobs[i].call for i in admitted], self.targets)
            self.cost.observe(len(admitted), time.monotonic() - started)
            for i, result in zip(admitted, done):
                results[i] = result
        return results

    async def render(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            call = await self._read(request, started)
            version_id, arm = self.reader.route(call.task, call.label, call.key)
            prompt = self.reader.version(version_id).render(call.inputs)  # the version routed, whatever moves since
            code, body = 200, {"prompt": prompt, "version": version_id, "arm": arm, "replica": self.replica}
        except GatewayError as exc:
            code, body = exc.status, {"error": exc.message, "kind": "refused"}
        except Exception as exc:  # noqa: BLE001 - a route or input the store or template refuses: its status
            code, kind = status_of(exc)
            body = {"error": _one_line(exc), "kind": kind}
        self.series.done("render", code, started)
        return JSONResponse(body, status_code=code)

    async def task(self, task: str) -> Response:
        started = time.monotonic()
        if task not in self.tasks:
            self.series.done("tasks", 404, started)
            return _error(404, self._unknown_task(task), "not_found")
        state = await asyncio.to_thread(self.reader.task_state, task)
        self.series.done("tasks", 200, started)
        return JSONResponse({**state, "replica": self.replica})

    async def healthz(self) -> Response:
        return JSONResponse({"status": "ok", "replica": self.replica, "tasks": sorted(self.tasks)})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.series.registry), media_type="text/plain; version=0.0.4")

    # --- reading a body ---------------------------------------------------------------------------------------
    async def _read(self, request: Request, started: float) -> CallBody:
        """The call in the body, read within ``body_timeout_ms`` (a client that sends slowly gets a 408) and the
        size limit (a 413 before the rest is read)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"the body is {declared} bytes, over the gateway's {limit}: send one case per "
                                    "request")

        async def whole() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise GatewayError(413, f"the body is over the gateway's {limit} bytes: send one case per request")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            body = await asyncio.wait_for(whole(), timeout=min(self.settings.body_timeout_ms,
                                                               self.settings.deadline_ms) / 1000)
        except (TimeoutError, asyncio.TimeoutError):
            raise GatewayError(408, f"the body did not arrive within {self.settings.body_timeout_ms:.0f} ms: send it "
                                    "whole, at once") from None
        call = parse_call(body, limit)
        if call.task not in self.tasks:
            raise GatewayError(404, self._unknown_task(call.task))
        return call

    def _unknown_task(self, task: str) -> str:
        return f"task {task[:64]!r} is not served here; the gateway serves {sorted(self.tasks)}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(exc).__name__


# --- starting and stopping -------------------------------------------------------------------------------------
APP_NAME = "tune-prompts"


def start(store_url: str, target: ModelSource, tasks: dict[str, ServedTask], settings: GatewaySettings, *,
          host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None) -> str:
    """Deploy the gateway (a local Ray unless ``ray_address``) and return its base URL once every replica is up."""
    from pipelines.ray_scoring import init_ray

    init_ray(ray_address)
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        # @serve.deployment made the class a Deployment, which mypy does not know
        deployment = Gateway.options(num_replicas=settings.replicas,  # type: ignore[attr-defined]
                                     ray_actor_options={"num_cpus": 0})
        serve.run(deployment.bind(store_url, target, tasks, settings.model_dump()), name=APP_NAME, route_prefix="/",
                  logging_config={"log_level": "WARNING"})
    except Exception as exc:  # noqa: BLE001 - Serve's errors arrive wrapped in RayTaskErrors, tracebacks and all
        serve.shutdown()
        text = str(exc)
        if "bind" in text:
            raise ConfigError(f"the gateway cannot listen on {host}:{port}: the port is taken; pick another with "
                              "--port") from None
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), type(exc).__name__)
        raise ConfigError(f"the gateway's replicas did not start: {last[:300]}; Ray's logs are in "
                          "/tmp/ray/session_latest/logs/serve") from None
    return f"http://{host}:{port}"


def stop() -> None:
    """Take the gateway down (and Serve with it); Ray itself stays up for the caller to shut down."""
    serve.shutdown()
