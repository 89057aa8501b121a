"""Load, faults and bad input against the prompt gateway (``tune-prompts serve``), on loopback only.

    python -m bench.gateway [--seconds 8] [--levels 1 2 4 8 32 128] [--pg-url URL] [--json OUT]

For each store (SQLite, and PostgreSQL when ``--pg-url`` or TUNE_PROMPTS_TEST_PG_URL gives one) and each gateway
(1 replica batched, 1 replica unbatched, 2 replicas batched), the embedded model as target:

* closed-loop clients (httpx, asyncio) at each level of concurrency for ``--seconds``: throughput, p50/p95/p99,
  the deadline-miss rate (504s) and every other error; batching's throughput gain over the unbatched gateway at
  the same level, measured in the same run;
* meanwhile a writer promotes, rolls back and ramps a canary 5% -> 20% -> 100% (then promotes it), a step every
  ``--step-s``, and logs when each move committed. Each 200 is checked against that log: it must name a version
  (and an arm) that was live at some moment between its request and its answer, allowing for the reader's refresh
  (``refresh_s`` plus its slack) - a "torn read" is one that was not. A key's arm must be ``routing.takes_canary``
  at a share live then. After the run, the store must still hold every version written (none lost) and decode;
* at the end, the hostile requests of ``HOSTILE`` while a good load runs: each must get a 4xx with a one-line JSON
  body, none a 5xx, and the good load's error rate must stay 0.

First, without HTTP, the ceiling on batching's gain on this machine: the scorer's time per message for new messages
one call each against one batch. Every message the load sends is new (a counter in its text): the target caches
(template, text) pairs, and repeats would measure the cache.

Figures go to stdout (and ``--json``); name the CPU and dtype next to them. The deadline is the gateway's default
(350 ms); 504s are reported, not hidden. Clients, proxy, replicas and writer share the machine's cores.

The module is long because the load, the writer, the torn-read check and the hostile requests run against the
same gateways at the same time, and each check reads the others' logs; it is one experiment, read top to bottom.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

STALENESS_S = 0.3  # a reader's refresh (0.05 s) and its slack (0.05 s), and the watcher's thread being late on 2 busy cores
TASK = "risk"
TEXTS = [
    "WIN a FREE prize! Reply YES to claim your reward now",
    "are we still on for dinner at 7?",
    "Your account is locked. Verify at http://bit.ly/xx to avoid suspension",
    "Can you pick up milk on the way home",
    "URGENT: you have won a cash prize of 2000 pounds, call 09061701461",
    "ok see you tomorrow then",
    "Your parcel is held at customs: pay the 2.99 fee here",
    "Mum says thanks for the flowers",
]


# --- the hostile catalogue: (class, name, method, path, headers, body) --------------------------------------------
def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def hostile_requests() -> list[tuple[str, str, str, str, dict, bytes]]:
    good = {"text": "hello"}
    deep = b'{"task": "risk", "inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases = [
        ("bad_json", "not json", "POST", "/v1/predict", {}, b"{task: risk"),
        ("bad_json", "empty body", "POST", "/v1/predict", {}, b""),
        ("bad_json", "trailing comma", "POST", "/v1/predict", {}, b'{"task": "risk", "inputs": {"text": "a"},}'),
        ("bad_json", "json array", "POST", "/v1/predict", {}, b'[1, 2, 3]'),
        ("bad_json", "json string", "POST", "/v1/predict", {}, b'"risk"'),
        ("bad_json", "json null", "POST", "/v1/predict", {}, b"null"),
        ("bad_json", "latin-1 bytes", "POST", "/v1/predict", {}, b'{"task": "risk\xe9"}'),
        ("bad_json", "NaN literal", "POST", "/v1/predict", {}, b'{"task": "risk", "inputs": {"text": NaN}}'),
        ("bad_json", "render not json", "POST", "/v1/render", {}, b"<xml/>"),
        ("huge", "2 MB input", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "a" * 2_000_000})),
        ("huge", "70 KB body", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "b" * 70_000})),
        ("huge", "lying content-length", "POST", "/v1/predict", {"content-length-override": "999999999"},
         _body(task=TASK, inputs=good)),
        ("unknown", "unknown task", "POST", "/v1/predict", {}, _body(task="nope", inputs=good)),
        ("unknown", "unknown label", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, label="staging")),
        ("unknown", "unknown task (render)", "POST", "/v1/render", {}, _body(task="../etc/passwd", inputs=good)),
        ("unknown", "unknown task (tasks)", "GET", "/v1/tasks/nope", {}, b""),
        ("unknown", "unknown route", "GET", "/v2/predict", {}, b""),
        ("unknown", "wrong method", "GET", "/v1/predict", {}, b""),
        ("unknown", "label with slash", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, label="a/b")),
        ("inputs", "missing inputs", "POST", "/v1/predict", {}, _body(task=TASK)),
        ("inputs", "missing task", "POST", "/v1/predict", {}, _body(inputs=good)),
        ("inputs", "missing variable", "POST", "/v1/predict", {}, _body(task=TASK, inputs={})),
        ("inputs", "extra variable", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "a", "x": "b"})),
        ("inputs", "wrong variable", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"txt": "a"})),
        ("inputs", "extra field", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, debug=True)),
        ("inputs", "number input", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": 5})),
        ("inputs", "list input", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": ["a"]})),
        ("inputs", "inputs a string", "POST", "/v1/predict", {}, _body(task=TASK, inputs="hello")),
        ("inputs", "task a number", "POST", "/v1/predict", {}, _body(task=7, inputs=good)),
        ("inputs", "label and key", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, key="u", label="production")),
        ("inputs", "empty key", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, key="")),
        ("inputs", "negative deadline", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, deadline_ms=-5)),
        ("inputs", "17 inputs", "POST", "/v1/predict", {}, _body(task=TASK, inputs={f"v{i}": "a" for i in range(17)})),
        ("constraint", "over max_chars", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "c" * 2001})),
        ("constraint", "over max_chars (render)", "POST", "/v1/render", {}, _body(task=TASK, inputs={"text": "c" * 5000})),
        ("constraint", "over max_chars with key", "POST", "/v1/predict", {},
         _body(task=TASK, inputs={"text": "d" * 3000}, key="user-1")),
        ("control", "NUL byte", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "a\x00b"})),
        ("control", "escape sequence", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": "\x1b[2Jcleared"})),
        ("control", "NUL in key", "POST", "/v1/predict", {}, _body(task=TASK, inputs=good, key="u\x00")),
        ("control", "DEL", "POST", "/v1/render", {}, _body(task=TASK, inputs={"text": "a\x7f"})),
        ("control", "raw NUL in body", "POST", "/v1/predict", {}, b'{"task": "risk", "inputs": {"text": "a\x00"}}'),
        ("nesting", "5000 deep list", "POST", "/v1/predict", {}, deep),
        ("nesting", "nested inputs", "POST", "/v1/predict", {}, _body(task=TASK, inputs={"text": {"a": {"b": "c"}}})),
        ("nesting", "deep object", "POST", "/v1/predict", {}, b'{"a":' * 3000 + b"1" + b"}" * 3000),
        ("slow", "stalled body", "POST", "/v1/predict", {"slow": "stall"}, _body(task=TASK, inputs=good)),
        ("slow", "trickled body", "POST", "/v1/predict", {"slow": "trickle"}, _body(task=TASK, inputs=good)),
    ]
    return cases


def send_raw(host: str, port: int, method: str, path: str, headers: dict, body: bytes,
             timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One request over a plain socket (so a slow or lying client can be played): the status and the body."""
    length = headers.get("content-length-override", str(len(body)))
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if method == "POST":
        head += f"Content-Length: {length}\r\n"
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        try:
            s.sendall(head.encode() + b"\r\n")
            slow = headers.get("slow")
            if slow == "stall":
                s.sendall(body[:10])  # then nothing: the gateway must give up on it
            elif slow == "trickle":
                for i in range(0, len(body), 4):
                    s.sendall(body[i:i + 4])
                    time.sleep(0.05)
            else:
                s.sendall(body)  # with a lying Content-Length, fewer bytes than it declares
        except OSError:  # the gateway answered (and closed) before the client finished: read what it said
            pass
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            pass
    raw = b"".join(chunks)
    if not raw:
        return 0, b""
    status = int(raw.split(b" ", 2)[1])
    return status, raw.split(b"\r\n\r\n", 1)[-1]


def judge_hostile(status: int, body: bytes) -> str | None:
    """Why a hostile request's answer is wrong, or None: a 4xx with a one-line JSON error and no traceback."""
    if not 400 <= status < 500:
        return f"status {status}"
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"body is not a JSON error: {body[:80]!r}"
    if "\n" in error or "Traceback" in error or len(error) > 400:
        return f"error is not one short line: {error[:80]!r}"
    return None


# --- the writer: moves in the store, and when each committed ------------------------------------------------------
@dataclass
class Timeline:
    """The store's production and canary after each move, and the monotonic times around its commit."""

    states: list[tuple[float, float, int, int | None, float]] = field(default_factory=list)  # before, after, prod,
    # canary id, share

    def allows(self, sent: float, answered: float, key: str, version: int, arm: str) -> bool:
        from templates.routing import takes_canary

        for k, (before, _, prod, canary, share) in enumerate(self.states):
            ends = self.states[k + 1][1] + STALENESS_S if k + 1 < len(self.states) else float("inf")
            if before > answered or ends < sent:
                continue
            routed_canary = canary is not None and share > 0 and takes_canary(TASK, key, share)
            if arm == "canary" and routed_canary and version == canary:
                return True
            if arm == "production" and not routed_canary and version == prod:
                return True
        return False


def writer(store_url: str, stop: threading.Event, timeline: Timeline, step_s: float, counts: dict) -> None:
    """Promote, roll back and ramp canaries until ``stop``: add a version, canary it at 5%, ramp it to 20% and
    100%, promote it, roll back to the one before, and again."""
    from templates.store import TemplateStore

    store = TemplateStore(store_url)
    base = store.get_template(store.label_target(TASK, "production") or 1)

    def record(move) -> None:
        before = time.monotonic()
        move()
        canary = store.canary(TASK)
        timeline.states.append((before, time.monotonic(), store.label_target(TASK, "production") or 0,
                                canary.version_id if canary else None, canary.share if canary else 0.0))
        counts["moves"] += 1

    try:
        n = 0
        while not stop.is_set():
            n += 1
            text = base.text.replace("Read the SMS message below.", f"Read the SMS message below (pass {n}).")
            from templates.template import Template

            version = store.add_version(TASK, Template(text, base.variables, base.constraints, decision=base.decision))
            counts["added"] += 1
            steps = [lambda: store.set_canary(TASK, version.id, 0.05), lambda: store.advance_canary(TASK),
                     lambda: store.advance_canary(TASK), lambda: store.promote(TASK, version.id, force=True),
                     lambda: store.rollback(TASK)]
            for step in steps:
                if stop.wait(step_s):
                    return
                record(step)
    finally:
        store.close()


# --- the load --------------------------------------------------------------------------------------------------
async def closed_loop(base: str, clients: int, seconds: float, keys: list[str]) -> list[tuple]:
    """``clients`` callers, each sending its next request as soon as the last is answered, for ``seconds``:
    (sent, answered, key, status, version, arm) per request."""
    import httpx

    out: list[tuple] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
        end = time.monotonic() + seconds

        async def caller(i: int) -> None:
            rng = random.Random(i)
            n = 0
            while time.monotonic() < end:
                key = rng.choice(keys)
                n += 1
                # Every text new: the target caches (template, text) pairs, and repeats would measure the cache.
                body = {"task": TASK, "inputs": {"text": f"{rng.choice(TEXTS)} #{i * 100_000 + n}"},
                        "key": key}
                sent = time.monotonic()
                try:
                    r = await client.post("/v1/predict", json=body)
                    status, data = r.status_code, (r.json() if r.headers.get("content-type", "").startswith(
                        "application/json") else {})
                except Exception as exc:  # noqa: BLE001 - a dropped connection is a result to count
                    status, data = 0, {"error": type(exc).__name__}
                out.append((sent, time.monotonic(), key, status, data.get("version"), data.get("arm")))

        await asyncio.gather(*(caller(i) for i in range(clients)))
    return out


def summarize(rows: list[tuple], seconds: float) -> dict:
    from templates.gate import percentile

    ok = [r for r in rows if r[3] == 200]
    lat = [(r[1] - r[0]) * 1000 for r in ok]
    codes: dict[str, int] = {}
    for r in rows:
        codes[str(r[3])] = codes.get(str(r[3]), 0) + 1
    return {"requests": len(rows), "ok": len(ok), "throughput_rps": round(len(ok) / seconds, 1),
            "p50_ms": round(percentile(lat, 50), 1) if lat else None,
            "p95_ms": round(percentile(lat, 95), 1) if lat else None,
            "p99_ms": round(percentile(lat, 99), 1) if lat else None,
            "deadline_miss_rate": round(codes.get("504", 0) / max(1, len(rows)), 4), "codes": codes,
            "unexpected_5xx": sum(n for c, n in codes.items() if c.startswith("5") and c != "504"),
            "failed_connections": codes.get("0", 0)}


# --- one gateway ------------------------------------------------------------------------------------------------
def seed_store(url: str) -> None:
    from pipelines.config import load_task
    from templates.decision import DecisionRule
    from templates.store import TemplateStore
    from templates.template import Template

    task = load_task(TASK)
    seed = task.seed_template()
    # The seed's calibrated rule as a tuning run ships it (the threshold is a fixed figure here: the bench measures
    # the gateway, not the rule).
    rule = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), "high_risk", 0.5)
    with TemplateStore(url) as store:
        version = store.add_version(TASK, Template(seed.text, seed.variables, seed.constraints, decision=rule))
        store.promote(TASK, version.id, force=True)


def run_gateway(store_url: str, replicas: int, batching: bool, levels: list[int], seconds: float, step_s: float,
                port: int, hostile: bool) -> dict:
    from pipelines import gateway
    from pipelines.config import ConfigError, load_task
    from pipelines.engine.models import EMBEDDED
    from pipelines.gateway_requests import GatewaySettings
    from templates.store import TemplateStore

    task = load_task(TASK)
    settings = GatewaySettings(replicas=replicas, max_batch_size=32 if batching else 1)
    started = time.monotonic()
    served = {TASK: gateway.ServedTask(TASK, task.template.chat_template, task.scoring.batch_size)}
    for attempt in range(3):  # a free port can be taken again (by Ray's own workers) before the proxy binds it
        try:
            base = gateway.start(store_url, EMBEDDED, served, settings, port=port)
            break
        except ConfigError as exc:
            if "port is taken" not in str(exc) or attempt == 2:
                raise
            port = free_port()
    result: dict = {"replicas": replicas, "batching": batching, "start_s": round(time.monotonic() - started, 1),
                    "levels": {}}
    keys = [f"user-{i}" for i in range(500)]
    try:
        asyncio.run(closed_loop(base, 4, 2.0, keys))  # warm the connections and the replicas
        with TemplateStore(store_url) as store:
            before = len(store.list_versions(TASK))
        counts = {"moves": 0, "added": 0}
        torn = 0
        timeline = Timeline()  # one for the whole run: a reader may still serve the last level's final move
        with TemplateStore(store_url) as store:  # the state the load starts from, live since before it
            canary = store.canary(TASK)
            timeline.states.append((-math.inf, -math.inf, store.label_target(TASK, "production") or 0,
                                    canary.version_id if canary else None, canary.share if canary else 0.0))
        for clients in levels:
            moves_before = len(timeline.states)
            stop = threading.Event()
            thread = threading.Thread(target=writer, args=(store_url, stop, timeline, step_s, counts), daemon=True)
            thread.start()
            rows = asyncio.run(closed_loop(base, clients, seconds, keys))
            stop.set()
            thread.join()
            level = summarize(rows, seconds)
            torn_rows = [r for r in rows if r[3] == 200 and not timeline.allows(r[0], r[1], r[2], r[4], r[5])]
            level["torn_reads"] = len(torn_rows)
            level["torn_examples"] = [list(r) for r in torn_rows[:3]]
            level["moves"] = len(timeline.states) - moves_before
            torn += level["torn_reads"]
            result["levels"][str(clients)] = level
            print(f"  {clients:>4} clients: {level['throughput_rps']:>7} req/s  p50 {level['p50_ms']} ms  "
                  f"p95 {level['p95_ms']} ms  p99 {level['p99_ms']} ms  504 rate {level['deadline_miss_rate']:.1%}  "
                  f"other 5xx {level['unexpected_5xx']}  torn {level['torn_reads']}  moves {level['moves']}",
                  flush=True)
        with TemplateStore(store_url) as store:
            after = store.list_versions(TASK)
            damaged = store.check_rows()
        result["versions_written"] = counts["added"]
        result["lost_versions"] = before + counts["added"] - len(after)
        result["damaged_rows"] = len(damaged)
        result["torn_reads"] = torn
        if hostile:
            result["hostile"] = hostile_under_load(base, int(base.rsplit(":", 1)[1]), keys)
    finally:
        gateway.stop()
    return result


def hostile_under_load(base: str, port: int, keys: list[str]) -> dict:
    """Every hostile request while 1 good client keeps calling (a load this machine answers within the deadline:
    see the 1-client level; the good load's error rate must stay 0)."""
    failures = []
    cases = hostile_requests()
    rows: list[tuple] = []
    done = threading.Event()

    def good_load() -> None:
        while not done.is_set():
            rows.extend(asyncio.run(closed_loop(base, 1, 1.0, keys)))

    thread = threading.Thread(target=good_load, daemon=True)
    thread.start()
    by_class: dict[str, int] = {}
    for kind, name, method, path, headers, body in cases:
        status, answer = send_raw("127.0.0.1", port, method, path, headers, body)
        why = judge_hostile(status, answer)
        by_class[kind] = by_class.get(kind, 0) + 1
        if why:
            failures.append(f"{kind}/{name}: {why}")
    done.set()
    thread.join()
    bad_good = [r for r in rows if r[3] != 200]
    summary = {"requests": len(cases), "classes": by_class, "failures": failures, "good_requests": len(rows),
               "good_errors": len(bad_good), "good_error_codes": sorted({str(r[3]) for r in bad_good})}
    print(f"  hostile: {len(cases)} requests in {len(by_class)} classes, {len(failures)} not a one-line 4xx "
          f"{failures[:3]}; good load alongside: {len(rows)} requests, {len(bad_good)} errors "
          f"{summary['good_error_codes']}", flush=True)
    return summary


def model_batching_gain(n: int = 32, rounds: int = 3) -> dict:
    """The ceiling on what batching can gain here, without HTTP: ``n`` new messages scored one call each against
    one call for all ``n``, by the gateway's scorer (padded rows, warmed), the fastest of ``rounds``."""
    from pipelines.config import load_task
    from pipelines.engine.models import EMBEDDED
    from pipelines.scoring import label_scorer

    task = load_task(TASK)
    frame, _ = task.seed_template().input_frame()
    scorer = label_scorer(EMBEDDED, ["yes", "no"], chat_template=task.template.chat_template,
                          batch_size=task.scoring.batch_size)
    counter = iter(range(10**9))

    def texts(k: int) -> list[str]:
        return [f"{TEXTS[i % len(TEXTS)]} #{next(counter)}" for i in range(k)]

    for size in (1, n):  # warm both row counts
        scorer.score(frame, texts(size))
    alone, together = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for text in texts(n):
            scorer.score(frame, [text])
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        scorer.score(frame, texts(n))
        together.append(time.perf_counter() - started)
    return {"messages": n, "one_call_each_ms_per_message": round(min(alone) / n * 1000, 1),
            "one_batch_ms_per_message": round(min(together) / n * 1000, 1), "gain": round(min(alone) / min(together), 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_store(admin_url: str) -> tuple[str, str]:
    import psycopg

    schema = f"bench_gateway_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{admin_url}{'&' if '?' in admin_url else '?'}options={quote(f'-csearch_path={schema}')}", schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="load time per level (default %(default)s)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    parser.add_argument("--step-s", type=float, default=0.25, help="seconds between the writer's moves")
    parser.add_argument("--pg-url", default=os.environ.get("TUNE_PROMPTS_TEST_PG_URL"),
                        help="a PostgreSQL server to test the store on as well (default $TUNE_PROMPTS_TEST_PG_URL)")
    parser.add_argument("--only", choices=["sqlite", "postgresql"], help="one store only")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    import torch

    from pipelines.cli import quiet_libraries

    quiet_libraries()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"embedded model dtype: the loader's default for this CPU", flush=True)
    report: dict = {"seconds": args.seconds, "levels": args.levels, "runs": []}
    gain = model_batching_gain()
    report["model_batching_gain"] = gain
    print(f"the model alone, {gain['messages']} new messages: {gain['one_call_each_ms_per_message']} ms each one at a "
          f"time, {gain['one_batch_ms_per_message']} ms each in one batch: batching gains at most {gain['gain']}x here",
          flush=True)
    stores = [] if args.only == "postgresql" else ["sqlite"]
    if args.pg_url and args.only != "sqlite":
        stores.append("postgresql")
    elif args.only == "postgresql":
        raise SystemExit("--only postgresql needs --pg-url or TUNE_PROMPTS_TEST_PG_URL (bash scripts/start_postgres.sh)")
    import ray

    try:
        for kind in stores:
            for replicas, batching in ([(1, True), (1, False), (2, True)] if kind == "sqlite" else [(1, True), (2, True)]):
                with tempfile.TemporaryDirectory() as tmp:
                    url = f"sqlite:///{tmp}/store.sqlite" if kind == "sqlite" else pg_store(args.pg_url)[0]
                    seed_store(url)
                    print(f"{kind}, {replicas} replica(s), batching {'on' if batching else 'off'}:", flush=True)
                    run = run_gateway(url, replicas, batching, args.levels, args.seconds, args.step_s, free_port(),
                                      hostile=(kind == "sqlite" and replicas == 1 and batching))
                    print(f"  versions written {run['versions_written']}, lost {run['lost_versions']}, damaged rows "
                          f"{run['damaged_rows']}, torn reads {run['torn_reads']}", flush=True)
                    report["runs"].append({"store": kind, **run})
    finally:
        if ray.is_initialized():
            ray.shutdown()
    on = next((r for r in report["runs"] if r["store"] == "sqlite" and r["replicas"] == 1 and r["batching"]), None)
    off = next((r for r in report["runs"] if r["store"] == "sqlite" and r["replicas"] == 1 and not r["batching"]), None)
    if on and off:
        gains = {level: round(on["levels"][level]["throughput_rps"] / max(off["levels"][level]["throughput_rps"], 1e-9), 2)
                 for level in on["levels"]}
        report["batching_gain"] = gains
        print(f"batching's throughput gain over the unbatched gateway (same run, SQLite, 1 replica): {gains}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
