"""What the gateway accepts, and how each way a request can fail becomes one HTTP status with one line.

Pure code, no Ray and no web framework: ``pipelines/gateway.py`` (the Ray Serve deployment) reads each body
through ``parse_call`` and maps each call's exception through ``status_of``. Everything a client can get wrong is
a 4xx here, before any model or store work:

* 413: a body over ``max_body_bytes`` (refused before it is parsed);
* 400: a body that is not JSON, not UTF-8, or nested deeper than the parser goes;
* 422: a field missing, extra or of the wrong type; an input holding a control character (a NUL byte, an escape);
  an input that breaks the routed version's constraints; a label and a key together;
* 404: a task the gateway does not serve, a label the task does not have.

Past those, 504 is a request that could not be answered within its deadline, 502 a served target that failed,
503 a version the store holds damaged or without a decision rule. A 500 is a bug: it still gets one line.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelines.config import _Strict

MAX_INPUTS = 16
# C0 controls but tab, newline and carriage return, and DEL: no case text needs them, and a NUL byte in a prompt
# is either a bug in the caller or an attack on whatever reads the prompt next.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CONTROL_OR_BREAK = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


class GatewayError(Exception):
    """A request the gateway refuses: its HTTP status and one line for the body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class GatewaySettings(_Strict):
    """How ``tune-prompts serve`` batches, waits and bounds requests (its flags set these)."""

    replicas: int = Field(1, ge=1, le=64, description="gateway replicas, each with its own model and store reader")
    max_batch_size: int = Field(32, ge=1, le=512, description="requests scored together in one forward pass (1: "
                                "no batching)")
    batch_wait_ms: float = Field(5.0, ge=0, le=1000, description="how long a batch waits to fill before it runs")
    deadline_ms: float = Field(350.0, gt=0, le=600_000, description="a request's time limit once the gateway has "
                               "it: past it the answer is a 504")
    task_deadlines_ms: dict[str, float] = Field(default_factory=dict, description="per-task deadlines that replace "
                                                "deadline_ms for those tasks")
    body_timeout_ms: float = Field(250.0, gt=0, le=60_000, description="how long a body may take to arrive: a "
                                   "client that sends slower gets a 408 (the deadline bounds it too)")
    max_body_bytes: int = Field(65_536, ge=1024, le=16 * 2**20, description="the largest request body accepted")
    refresh_s: float = Field(0.05, gt=0, le=60, description="how often a replica's reader checks the store for moves")
    threads: int = Field(0, ge=0, le=256, description="torch threads per replica (0: the cores shared out among the "
                         "replicas)")

    @model_validator(mode="after")
    def _deadlines(self) -> "GatewaySettings":
        for task, ms in self.task_deadlines_ms.items():
            if not 0 < ms <= 600_000:
                raise ValueError(f"the deadline of task {task!r} is {ms} ms; give one between 1 and 600000 ms")
        return self

    def deadline_s(self, task: str) -> float:
        return self.task_deadlines_ms.get(task, self.deadline_ms) / 1000


class CallBody(BaseModel):
    """``POST /v1/predict`` and ``POST /v1/render``: the task, its inputs by name, and a label or a caller key."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task: str = Field(min_length=1, max_length=64)
    inputs: dict[str, str] = Field(max_length=MAX_INPUTS)
    key: str | None = Field(None, min_length=1, max_length=256)
    label: str | None = Field(None, min_length=1, max_length=64)
    deadline_ms: float | None = Field(None, gt=0, le=600_000)

    @model_validator(mode="after")
    def _route(self) -> "CallBody":
        if self.key is not None and self.label is not None:
            raise ValueError("give label or key, not both")
        for name, value in [*((f"inputs.{n}", v) for n, v in self.inputs.items()), ("key", self.key or "")]:
            bad = _CONTROL.search(value)
            if bad:
                raise ValueError(f"{name} holds the control character {bad.group()!r} at {bad.start()}: send plain "
                                 "text")
        return self


class BatchCost:
    """What a batch of ``n`` calls is expected to take, ``first + per_call * (n - 1)`` seconds, learnt from the
    batches the replica ran (exponential averages), and which calls of a batch can still meet their deadlines.

    A call that would be answered after its deadline is shed before the model runs (a 504 at once) rather than
    computed and thrown away: under overload the replica's time goes to calls that can still be answered in time,
    instead of every call missing while the model works for callers who have gone."""

    def __init__(self, first_s: float = 0.05, per_call_s: float = 0.02, weight: float = 0.2) -> None:
        self.first_s, self.per_call_s, self.weight = first_s, per_call_s, weight

    def expect(self, n: int) -> float:
        return self.first_s + self.per_call_s * max(0, n - 1)

    def observe(self, n: int, seconds: float) -> None:
        if n <= 0 or not seconds >= 0:
            return
        w = self.weight
        if n == 1:
            self.first_s += w * (seconds - self.first_s)
        else:
            self.per_call_s += w * (max(0.0, seconds - self.first_s) / (n - 1) - self.per_call_s)

    def admit(self, deadlines: list[float], now: float) -> list[int]:
        """The indices of the calls to run now, earliest deadline first: calls are shed, earliest deadline first,
        until the batch that is left is expected to end before every deadline in it."""
        keep = sorted(range(len(deadlines)), key=deadlines.__getitem__)
        while keep and deadlines[keep[0]] < now + self.expect(len(keep)):
            keep.pop(0)
        return keep


def parse_call(body: bytes, max_body_bytes: int) -> CallBody:
    """A predict or render body, or the ``GatewayError`` that refuses it."""
    if len(body) > max_body_bytes:
        raise GatewayError(413, f"the body is {len(body)} bytes, over the gateway's {max_body_bytes}: send one case "
                                "per request")
    try:
        data: Any = json.loads(body)
    except UnicodeDecodeError:
        raise GatewayError(400, "the body is not UTF-8 text: send JSON encoded as UTF-8") from None
    except RecursionError:
        raise GatewayError(400, "the body is nested too deeply to parse: send {task, inputs, key?, label?}") from None
    except ValueError as exc:
        raise GatewayError(400, f"the body is not JSON ({str(exc)[:80]}): send {{task, inputs, key?, label?}}") from None
    if not isinstance(data, dict):
        raise GatewayError(422, f"the body is a JSON {type(data).__name__}, not an object: send "
                                "{task, inputs, key?, label?}")
    try:
        return CallBody.model_validate(data)
    except ValidationError as exc:
        raise GatewayError(422, validation_line(exc)) from None


def validation_line(exc: ValidationError) -> str:
    """A pydantic error as one line: where, what, and how many more."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"][:4])[:80] or "body"
    message = str(first["msg"]).removeprefix("Value error, ")[:160]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    # A field name is the client's text: a newline or an escape in it must not break the line or reach a terminal.
    return _CONTROL_OR_BREAK.sub(lambda m: m.group().encode("unicode_escape").decode(), f"{where}: {message}{more}")


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and kind (a metrics label) of one call's exception from ``TemplateReader.predict_many``."""
    from pipelines.engine.endpoints import EndpointError
    from templates.serving import RouteError
    from templates.store import StoreError
    from templates.template import TemplateError

    if isinstance(exc, GatewayError):
        return exc.status, "refused"
    if isinstance(exc, RouteError):
        return 404, "not_found"
    if isinstance(exc, TemplateError):
        return 422, "input"
    if isinstance(exc, StoreError):
        return 503, "store"
    if isinstance(exc, EndpointError):
        return 502, "target"
    if isinstance(exc, TimeoutError):
        return 504, "deadline"
    return 500, "bug"
