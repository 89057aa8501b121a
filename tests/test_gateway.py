"""The prompt gateway (``tune-prompts serve``): what it accepts and refuses (pure), the batched serving path
(``TemplateReader.predict_many``, with a scripted scorer), the command line, and one real gateway on Ray Serve with
the embedded model and two replicas: its predict equals the library's, a key's arm is the same on both replicas, a
ramp and a promotion are served without a restart, a deadline gives a 504 while other requests succeed, and every
hostile request of the load bench's catalogue gets a one-line 4xx while a good load runs."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from bench.gateway import TEXTS, closed_loop, free_port, hostile_requests, judge_hostile, send_raw
from pipelines import cli
from pipelines.gateway_requests import GatewayError, GatewaySettings, parse_call, status_of
from templates.decision import DecisionRule
from templates.routing import takes_canary
from templates.serving import Call, Prediction, RouteError, TemplateReader
from templates.store import StoreError, TemplateStore
from templates.template import Template, TemplateError

RULE = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), "high_risk", 0.5)
LIMIT = 65_536


# --- what a body may hold: pure -----------------------------------------------------------------------------------
def test_a_good_body_is_read():
    call = parse_call(b'{"task": "risk", "inputs": {"text": "hi\\nthere"}, "key": "user-1"}', LIMIT)
    assert (call.task, call.inputs, call.key, call.label) == ("risk", {"text": "hi\nthere"}, "user-1", None)


BODY_CASES = [case for case in hostile_requests() if case[0] in ("bad_json", "huge", "inputs", "control", "nesting")
              and case[1] not in ("lying content-length", "missing variable", "extra variable", "wrong variable",
                                  "17 inputs")]


@pytest.mark.parametrize("kind, name, method, path, headers, body", BODY_CASES, ids=[c[1] for c in BODY_CASES])
def test_each_malformed_body_is_a_4xx_with_one_line(kind, name, method, path, headers, body):
    with pytest.raises(GatewayError) as caught:
        parse_call(body, LIMIT)
    assert 400 <= caught.value.status < 500 and "\n" not in caught.value.message and len(caught.value.message) < 300


def test_a_field_name_with_a_newline_stays_on_one_line():  # found by the property test below
    with pytest.raises(GatewayError) as caught:
        parse_call(b'{"task": "risk", "inputs": {"\\n\\u001b[2J": null}}', LIMIT)
    assert caught.value.status == 422 and "\n" not in caught.value.message and "\x1b" not in caught.value.message


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20).map(lambda v: json.dumps({"task": "risk", "inputs": v}).encode())))
def test_any_body_is_read_or_refused_with_a_4xx(body):
    try:
        parse_call(body, LIMIT)
    except GatewayError as exc:
        assert 400 <= exc.status < 500 and "\n" not in exc.message


def test_statuses_of_what_a_call_can_raise():
    from pipelines.engine.endpoints import EndpointError

    assert status_of(RouteError("no label"))[0] == 404
    assert status_of(TemplateError("constraint failed"))[0] == 422
    assert status_of(StoreError("damaged"))[0] == 503
    assert status_of(EndpointError("server down"))[0] == 502
    assert status_of(TimeoutError())[0] == 504
    assert status_of(KeyError("bug"))[0] == 500


def test_settings_bound_deadlines_and_batches():
    assert GatewaySettings(task_deadlines_ms={"risk": 500}).deadline_s("risk") == 0.5
    assert GatewaySettings().deadline_s("other") == 0.35
    for bad in ({"task_deadlines_ms": {"risk": 0}}, {"max_batch_size": 0}, {"deadline_ms": math.nan}):
        with pytest.raises(ValueError):
            GatewaySettings(**bad)


# --- the batched serving path, with a scripted scorer --------------------------------------------------------------
class Scripted:
    """A label scorer whose log-probs come from the input's length; it counts its calls."""

    verbalizers = ["yes", "no"]

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def score(self, frame, texts):
        self.calls.append((frame.text, list(texts)))
        return [[math.log(0.9), math.log(0.1)] if len(t) % 2 else [math.log(0.2), math.log(0.8)] for t in texts]


@pytest.fixture
def store_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with TemplateStore(url) as store:
        v1 = store.add_version("risk", Template("v1 {text}", ("text",), decision=RULE))
        v2 = store.add_version("risk", Template("v2 {text}", ("text",), decision=RULE))
        store.promote("risk", v1.id, force=True)
        store.set_canary("risk", v2.id, 0.5)
    return url


def test_predict_many_sends_each_version_once_and_keeps_errors_to_their_call(store_url):
    reader = TemplateReader(store_url, watch=False)
    target = Scripted()
    keys = [f"user-{i}" for i in range(12)]
    calls = [Call("risk", {"text": "x" * i}, key=k) for i, k in enumerate(keys)]
    calls += [Call("risk", {"text": "y" * 3000}), Call("risk", {}), Call("risk", {"text": "a"}, label="staging")]
    results = reader.predict_many(calls, target)
    assert len(target.calls) == 2  # production and canary: one scoring call each
    for call, result in zip(calls[:12], results[:12]):
        assert isinstance(result, Prediction)
        assert result.arm == ("canary" if takes_canary("risk", call.key, 0.5) else "production")
        assert result.version_id == (2 if result.arm == "canary" else 1)
        assert result == reader.predict("risk", call.values, Scripted(), key=call.key)  # one at a time: the same
    assert isinstance(results[12], Prediction)  # no constraint on this template: a long text is fine
    assert isinstance(results[13], TemplateError) and isinstance(results[14], RouteError)
    with pytest.raises(RouteError):
        reader.predict("risk", {"text": "a"}, Scripted(), label="staging")
    reader.close()


# --- the command line ---------------------------------------------------------------------------------------------
def test_serve_help_and_bad_input_exit_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0 and "/v1/predict" in capsys.readouterr().out
    missing = f"sqlite:///{tmp_path / 'none.sqlite'}"
    for argv, says in [(["serve", "--task", "risk", "--store", missing], "no store at"),
                       (["serve", "--task", "risk", "--task-deadline", "sentiment=5", "--store", missing], "names no served task"),
                       (["serve", "--task", "risk", "--task-deadline", "risk=fast", "--store", missing], "TASK=MILLISECONDS"),
                       (["serve", "--task", "risk", "--replicas", "0"], "out of range")]:
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse refuses a flag's value itself
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and says in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "none.sqlite").exists()


def test_serve_refuses_a_task_the_store_does_not_hold(store_url, capsys):
    assert cli.main(["serve", "--task", "sentiment", "--store", store_url]) == 2
    assert "holds no versions of ['sentiment']" in capsys.readouterr().err


# --- one real gateway: Ray Serve, two replicas, the embedded model --------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A gateway with two replicas over a store whose risk task has v1 in production, v2 as a 20% canary, and v3."""
    import ray

    from pipelines import gateway
    from pipelines.config import load_task
    from pipelines.engine.models import EMBEDDED

    task = load_task("risk")
    seed = task.seed_template()
    url = f"sqlite:///{tmp_path_factory.mktemp('gateway') / 'store.sqlite'}"
    with TemplateStore(url) as store:
        ids = [store.add_version("risk", Template(seed.text.replace("below.", f"below ({n})."), seed.variables,
                                                  seed.constraints, decision=RULE)).id for n in (1, 2, 3)]
        store.promote("risk", ids[0], force=True)
        store.set_canary("risk", ids[1], 0.2)
    port = free_port()
    # A long default deadline: on a shared 2-core machine a good request must not miss it; the 504 test asks
    # for a short one per request.
    settings_ = GatewaySettings(replicas=2, deadline_ms=20_000)
    base = gateway.start(url, EMBEDDED, {"risk": gateway.ServedTask("risk", task.template.chat_template,
                                                                    task.scoring.batch_size)}, settings_, port=port)
    try:
        yield {"base": base, "port": port, "url": url, "ids": ids, "task": task}
    finally:
        gateway.stop()
        ray.shutdown()


def post(served, body: dict) -> tuple[int, dict]:
    status, answer = send_raw("127.0.0.1", served["port"], "POST", "/v1/predict", {}, json.dumps(body).encode(),
                              timeout_s=60)
    return status, json.loads(answer)


@pytest.mark.e2e
def test_the_gateway_predicts_what_the_library_predicts(served):
    from pipelines.engine.models import EMBEDDED
    from pipelines.scoring import label_scorer

    target = label_scorer(EMBEDDED, ["yes", "no"], chat_template=served["task"].template.chat_template)
    reader = TemplateReader(served["url"], watch=False)
    try:
        for i, text in enumerate(TEXTS[:4]):
            status, got = post(served, {"task": "risk", "inputs": {"text": text}, "key": f"caller-{i}"})
            assert status == 200, got
            want = reader.predict("risk", {"text": text}, target, key=f"caller-{i}")
            assert (got["label"], got["version"], got["arm"]) == (want.label, want.version_id, want.arm)
            # the same model and code; the replicas run fewer torch threads, so sums may round differently
            assert got["logprobs"] == pytest.approx(want.logprobs, abs=0.05)
            status, answer = send_raw("127.0.0.1", served["port"], "POST", "/v1/render", {}, json.dumps(
                {"task": "risk", "inputs": {"text": text}, "key": f"caller-{i}"}).encode())
            rendered = json.loads(answer)
            assert status == 200 and (rendered["version"], rendered["arm"]) == (want.version_id, want.arm)
            assert rendered["prompt"] == reader.render("risk", {"text": text}, key=f"caller-{i}")
    finally:
        reader.close()


@pytest.mark.e2e
def test_a_keys_arm_is_the_same_on_both_replicas_and_a_ramp_needs_no_restart(served):
    keys = [f"user-{i}" for i in range(40)]

    def arms(share: float) -> set[str]:
        replicas = set()
        for key in keys:
            for _ in range(2):
                status, got = post(served, {"task": "risk", "inputs": {"text": "see you at 7"}, "key": key})
                assert status == 200, got
                canary = takes_canary("risk", key, share)
                assert (got["arm"], got["version"]) == (("canary", served["ids"][1]) if canary
                                                        else ("production", served["ids"][0])), (key, share, got)
                replicas.add(got["replica"])
        return replicas

    assert len(arms(0.2)) == 2  # both replicas answered, and agreed on every key
    with TemplateStore(served["url"]) as store:
        assert store.advance_canary("risk").share == 1.0  # 20% -> 100%, while the gateway runs
    time.sleep(1.0)  # the readers' watchers apply it within refresh_s (0.05 s)
    assert len(arms(1.0)) == 2
    with TemplateStore(served["url"]) as store:
        store.promote("risk", served["ids"][2], force=True)
    deadline = time.monotonic() + 5
    while True:
        status, got = post(served, {"task": "risk", "inputs": {"text": "hi"}, "label": "production"})
        if got.get("version") == served["ids"][2] or time.monotonic() > deadline:
            break
    assert got["version"] == served["ids"][2]


@pytest.mark.e2e
def test_a_request_past_its_deadline_gets_a_504_while_others_succeed(served):
    async def burst():
        import httpx

        async with httpx.AsyncClient(base_url=served["base"], timeout=60) as client:
            bodies = [{"task": "risk", "inputs": {"text": t}, **({"deadline_ms": 1} if i % 2 else {})}
                      for i, t in enumerate(TEXTS * 2)]
            return await asyncio.gather(*(client.post("/v1/predict", json=b) for b in bodies))

    answers = asyncio.run(burst())
    late = answers[1::2]
    on_time = answers[0::2]
    assert all(r.status_code == 504 and r.json()["kind"] == "deadline" for r in late), [r.text for r in late]
    assert all(r.status_code == 200 for r in on_time), [r.text for r in on_time]
    assert send_raw("127.0.0.1", served["port"], "GET", "/healthz", {}, b"")[0] == 200


@pytest.mark.e2e
def test_hostile_requests_get_one_line_4xx_while_the_good_load_goes_on(served):
    keys = [f"user-{i}" for i in range(50)]
    rows: list = []
    done = threading.Event()

    def good_load():
        while not done.is_set():
            rows.extend(asyncio.run(closed_loop(served["base"], 4, 0.5, keys)))

    thread = threading.Thread(target=good_load, daemon=True)
    thread.start()
    cases = hostile_requests()
    try:
        wrong = []
        for kind, name, method, path, headers, body in cases:
            status, answer = send_raw("127.0.0.1", served["port"], method, path, headers, body)
            why = judge_hostile(status, answer)
            if why:
                wrong.append(f"{kind}/{name}: {why}")
    finally:
        done.set()
        thread.join()
    assert len(cases) >= 40 and len({c[0] for c in cases}) >= 8
    assert wrong == []
    assert rows and all(r[3] == 200 for r in rows), sorted({r[3] for r in rows})
    metrics = send_raw("127.0.0.1", served["port"], "GET", "/metrics", {}, b"")[1].decode()
    assert 'gateway_requests_total{code="200"' in metrics and "gateway_batch_size_bucket" in metrics
