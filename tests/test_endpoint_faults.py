"""Faults from outside (issue #41): a served model that stalls, trickles, rate-limits, resets or lies. Each fault mode
of tests/openai_compat_server.py ends the scorer, `predict` and `eval` within the request's deadline plus 1 s, with
exit 2 and one line naming the server and what to check; a lie is never turned into a decision."""

import dataclasses
import importlib.util
import math
import sys
import time
from email.utils import formatdate
from pathlib import Path

import numpy as np
import pytest

from pipelines import cli
from pipelines.engine.endpoints import EndpointError, EndpointLabelScorer, EndpointResponseError
from templates.decision import DecisionRule
from templates.store import TemplateStore
from templates.template import Template

_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, srv)
_spec.loader.exec_module(srv)

SERVED_TASK = str(Path(__file__).parent / "data" / "risk_served.yaml")
TEMPLATE = Template("Is this message a scam?\nMessage: {text}\nAnswer yes or no.", ("text",))
SCAM = "WIN a prize now, call 0900"
TIMEOUT_S, DEADLINE_S = 0.5, 1.5
# What the one line says for each mode.
EXPECTED = {
    "stall": "no complete answer within 0.5 s", "trickle": "no complete answer within 0.5 s",
    "reset": "connection failed", "huge": "answer over the", "rate_limit": "HTTP 429", "rate_limit_bare": "HTTP 429",
    "unavailable": "HTTP 503", "error500": "HTTP 500", "garbage": "content type 'text/html', not JSON",
    "not_json": "not JSON", "wrong_shape": "wrong shape for /chat/completions: choices: Input should be a valid list",
    "number_text": "choices.0.message.content: Input should be a valid string (got 7)",
    "nan": "non-finite log-prob for 'yes' (nan)", "inf": "non-finite log-prob for 'yes' (inf)",
}
assert set(EXPECTED) == set(srv.FAULT_MODES)


def rule(prompt: str) -> list[tuple[str, float]]:
    return [("yes", -0.2), ("no", -1.8)] if "WIN" in prompt else [("no", -0.1), ("yes", -2.4)]


@pytest.fixture
def server():
    with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted") as s:
        yield s


def scorer(url: str, **options) -> EndpointLabelScorer:
    options = {"timeout_s": TIMEOUT_S, "deadline_s": DEADLINE_S, "max_retries": 3, "backoff_s": 0.05,
               "match": "token", **options}
    return EndpointLabelScorer(url, "scripted", ["yes", "no"], **options)


@pytest.mark.parametrize("mode", srv.FAULT_MODES)
def test_every_fault_ends_the_request_within_its_deadline_with_a_named_error(server, mode):
    server.faults.mode = mode
    s = scorer(server.base_url)
    t0 = time.monotonic()
    with pytest.raises(EndpointError) as raised:
        s.score(TEMPLATE, [SCAM])
    assert time.monotonic() - t0 < DEADLINE_S + 1
    message = str(raised.value)
    assert EXPECTED[mode] in message and "127.0.0.1" in message and "\n" not in message
    assert "Check" in message or "check" in message  # ... and what to do about it
    assert s.stats.errors == 1 and s.stats.pairs_scored == 0


def test_a_trickle_cannot_stretch_a_try_past_its_timeout(server):
    server.faults.mode, server.faults.trickle_s = "trickle", 0.05  # a byte every 50 ms: every read succeeds
    s = scorer(server.base_url, timeout_s=1, deadline_s=30, max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match="failed 2 times; last: no complete answer within 1 s"):
        s.score(TEMPLATE, [SCAM])
    assert 2 <= time.monotonic() - t0 < 2 + 0.1 + 1  # two tries of 1 s and a backoff, not 30 s
    assert s.stats.timeouts == 2


@pytest.mark.parametrize("retry_after, cap, least, most", [("0.4", 10, 0.4, 1.4), ("30", 0.3, 0.3, 1.3),
                                                            ("date", 0.5, 0.0, 1.5)])
def test_retry_after_is_honoured_up_to_its_cap(server, retry_after, cap, least, most):
    server.faults.rate_limit_first = 1
    server.faults.retry_after = formatdate(time.time() + 60, usegmt=True) if retry_after == "date" else retry_after
    s = scorer(server.base_url, deadline_s=5, max_retry_after_s=cap)
    t0 = time.monotonic()
    rows = s.score(TEMPLATE, [SCAM])
    assert least <= time.monotonic() - t0 < most
    assert rows[0, 0] > rows[0, 1] and s.stats.retries == 1


def test_a_wait_past_the_deadline_ends_the_request_at_once(server):
    server.faults.mode, server.faults.retry_after = "rate_limit", "8"
    s = scorer(server.base_url, deadline_s=2, max_retry_after_s=10)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"HTTP 429.*the next try \(in 8\.0 s\) would pass the request's 2 s deadline"):
        s.score(TEMPLATE, [SCAM])
    assert time.monotonic() - t0 < 1


def test_the_breaker_fails_fast_after_consecutive_failures(server):
    server.faults.mode = "error500"
    s = scorer(server.base_url, max_retries=1, breaker_failures=3)
    with pytest.raises(EndpointError, match="failed 2 times"):
        s.score(TEMPLATE, [SCAM])
    breaker = r"127\.0\.0\.1:\d+/v1 failed 3 tries in a row \(last: HTTP 500.*Check that the server is up"
    with pytest.raises(EndpointError, match=breaker):  # the third failure in a row opens it: no retry after it
        s.score(TEMPLATE, ["another"])
    assert server.completion_requests == 3
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=breaker):
        s.score(TEMPLATE, ["a third"])
    assert time.monotonic() - t0 < 0.1 and server.completion_requests == 3  # not asked again


def test_a_success_closes_the_count_of_failures(server):
    server.faults.fail_first = 2
    s = scorer(server.base_url, breaker_failures=3)
    s.score(TEMPLATE, [SCAM])  # two failures, then an answer
    server.faults.fail_first = server.completion_requests + 2
    assert s.score(TEMPLATE, ["again"]).shape == (1, 2)  # two more: 2 in a row, not 4


@pytest.mark.parametrize("mode", ["nan", "inf", "number_text", "wrong_shape", "garbage", "huge"])
def test_in_the_loop_a_lie_counts_as_an_answer_naming_no_label(server, mode):
    server.faults.mode = mode
    s = scorer(server.base_url, bad_responses="count")
    rows = s.score(TEMPLATE, [SCAM, "see you at lunch"])
    assert rows == pytest.approx(np.full((2, 2), -math.log(2)))  # no information, never a decision
    assert s.stats.responses_invalid == 2 and s.stats.errors == 0
    if mode not in ("nan", "inf"):  # a greedy answer asks for no log-probs
        (answer,) = s.answer(TEMPLATE, [SCAM], 3)
        assert answer.text == "" and s.stats.responses_invalid == 3  # an empty answer breaks any output contract
    server.faults.mode = None
    assert s.score(TEMPLATE, [SCAM])[0, 0] > -0.5  # not cached: asked again once the server tells the truth


@pytest.mark.parametrize("mode", ["garbage", "nan"])
def test_in_the_loop_a_server_that_never_keeps_the_contract_ends_the_run_but_later_lies_are_data(server, mode):
    server.faults.mode = mode
    liar = scorer(server.base_url, bad_responses="count", breaker_failures=4)
    texts = [f"message {i}" for i in range(6)]
    with pytest.raises(EndpointError, match=r"kept the API's contract in none of its first [4-6] label log-probs, so it serves no") as raised:
        liar.score(TEMPLATE, texts)
    assert not isinstance(raised.value, EndpointResponseError) and liar.stats.responses_invalid <= len(texts)
    if mode == "nan":  # its greedy answers keep the contract (they ask for no log-probs); its log-probs never do
        answers_only = scorer(server.base_url, bad_responses="count", breaker_failures=4)
        assert answers_only.answer(TEMPLATE, [SCAM], 3)[0].text
        with pytest.raises(EndpointError, match="none of its first [4-6] label log-probs"):
            answers_only.score(TEMPLATE, texts)
    server.faults.mode = None
    honest_first = scorer(server.base_url, bad_responses="count", breaker_failures=4)
    assert honest_first.score(TEMPLATE, [SCAM])[0, 0] > -0.5
    server.faults.mode = mode  # it kept the contract once: a lie after that is an answer naming no label
    assert honest_first.score(TEMPLATE, texts) == pytest.approx(np.full((6, 2), -math.log(2)))
    assert honest_first.stats.responses_invalid == 6


def test_a_log_prob_above_zero_is_a_lie(server):
    server.backend = srv.ScriptedBackend(lambda prompt: [("yes", 0.7), ("no", -1.0)])
    with pytest.raises(EndpointResponseError, match=r"log-prob 0\.7 for 'yes': above 0"):
        scorer(server.base_url).score(TEMPLATE, [SCAM])


def test_the_schema_bounds_every_wait(capsys):
    from pipelines.config import Endpoint

    defaults = Endpoint("http://h/v1", "m")
    assert defaults.timeout_s <= defaults.deadline_s <= 60 and defaults.max_retries <= 10
    for field, value in [("timeout_s", 0), ("deadline_s", 86400), ("max_retries", 1000), ("breaker_failures", 0),
                         ("max_retry_after_s", float("nan"))]:
        with pytest.raises(ValueError, match=f"{field}=.* is out of range"):
            Endpoint("http://h/v1", "m", **{field: value})
    for flag, value in [("--request-deadline", "0"), ("--max-retries", "11"), ("--request-timeout", "nan")]:
        with pytest.raises(SystemExit) as exited:
            cli.main(["predict", "--task", "risk", "--text", "hi", flag, value])
        assert exited.value.code == 2 and "out of range" in capsys.readouterr().err


# --- the commands -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    """A store whose risk-served production version decides with a threshold on the label log-odds."""
    from pipelines.config import load_task

    import pipelines.scoring  # noqa: F401 - predict imports it (and torch): paid here, not inside a deadline

    url = f"sqlite:///{tmp_path_factory.mktemp('faults') / 'store.sqlite'}"
    rule_ = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), positive="high_risk", threshold=0.0)
    template = dataclasses.replace(load_task(SERVED_TASK).seed_template(), decision=rule_)
    with TemplateStore(url) as store:
        store.promote("risk-served", store.add_version("risk-served", template).id, force=True)
    return url


def predict(server, store_url: str, *extra: str) -> list[str]:
    return ["predict", "--task", SERVED_TASK, "--store", store_url, "--target-url", server.base_url, "--target-model",
            "scripted", "--request-timeout", str(TIMEOUT_S), "--request-deadline", str(DEADLINE_S), "--max-retries", "3",
            "--text", SCAM, *extra]


def test_predict_answers_when_the_server_is_good(server, store_url, capsys):
    assert cli.main(predict(server, store_url)) == 0
    out = capsys.readouterr().out
    assert out.startswith("high_risk\tversion 1")


@pytest.mark.parametrize("mode", srv.FAULT_MODES)
def test_predict_exits_2_with_one_line_within_the_deadline(server, store_url, mode, capsys):
    server.faults.mode = mode
    t0 = time.monotonic()
    assert cli.main(predict(server, store_url)) == 2
    assert time.monotonic() - t0 < DEADLINE_S + 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no decision printed
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ") and EXPECTED[mode] in line and "Traceback" not in line


@pytest.mark.parametrize("mode", ["trickle", "nan", "number_text", "rate_limit_bare"])
def test_eval_exits_2_with_one_line_within_the_deadline(server, mode, capsys):
    server.faults.mode = mode
    argv = ["eval", "--task", SERVED_TASK, "--target-url", server.base_url, "--target-model", "scripted",
            "--request-timeout", str(TIMEOUT_S), "--request-deadline", str(DEADLINE_S), "--json"]
    assert cli.main(argv) == 2
    ended = time.monotonic()
    assert ended - server.request_times[0] < DEADLINE_S + 1  # from the first completion request (models load first)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and EXPECTED[mode].split(" for '")[0] in lines[0]  # the token is whichever came first


@pytest.mark.slow  # a tuning run each: Ray, the policy and the scoring actors start first
@pytest.mark.parametrize("mode", ["stall", "garbage", "nan"])
def test_a_tuning_run_against_a_faulty_server_exits_2_within_the_deadline_and_records_nothing(server, mode, tmp_path,
                                                                                              capsys, ray_session):
    server.faults.mode = mode
    store = tmp_path / "store.sqlite"
    argv = ["--task", SERVED_TASK, "--steps", "1", "--candidates", "2", "--dev-examples", "4", "--wandb-mode",
            "disabled", "--store", f"sqlite:///{store}", "--run-dir", str(tmp_path / "run"), "--target-url",
            server.base_url, "--target-model", "scripted", "--request-timeout", str(TIMEOUT_S), "--request-deadline",
            str(DEADLINE_S)]
    assert cli.main(argv) == 2
    assert time.monotonic() - server.request_times[0] < DEADLINE_S + 1  # from the first completion request
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and server.base_url in lines[0] and not store.exists()
    assert "Traceback" not in captured.err and "Unhandled error" not in captured.err
