"""Scoring through an OpenAI-compatible endpoint: a real loopback server, scripted or with the real model."""

import importlib.util
import logging
import math
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipelines.engine.endpoints import EndpointError, EndpointLabelScorer, make_label_scorer
from templates.template import Template

# tests/ is not a package (openrlhf installs one named `tests`): load the server module by path.
_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = srv
_spec.loader.exec_module(srv)

TEMPLATE = Template("Is this message a scam?\nMessage: {text}\nAnswer yes or no.", ("text",))
SCAM, PLAIN = "WIN a prize now, call 0900", "see you at lunch"


def rule(prompt: str) -> list[tuple[str, float]]:
    """Scripted next-token log-probs: capitals first, like SmolLM2; lowercase 'yes' missing for plain messages."""
    if "WIN" in prompt:
        return [("Yes", -0.2), ("yes", -1.0), ("No", -2.5), ("no", -3.0), ("The", -4.0)]
    if "gibberish" in prompt:
        return [("The", -0.1), ("A", -2.0)]
    if "(silence)" in prompt:  # the model's first token is its stop token ("")
        return [("", -0.1), ("No", -2.6), ("Yes", -3.0)]
    return [("No", -0.3), ("no", -1.2), ("Yes", -2.0), ("The", -3.5)]


@pytest.fixture
def server():
    with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted") as s:
        yield s


def scorer(url: str, model: str = "scripted", **options) -> EndpointLabelScorer:
    options = {"timeout_s": 2, "max_retries": 2, "backoff_s": 0.01, "match": "token", **options}  # scripted top-k
    return EndpointLabelScorer(url, model, ["yes", "no"], **options)


def log_odds(rows: np.ndarray) -> np.ndarray:
    return rows[:, 0] - rows[:, 1]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_labels_from_top_logprobs_by_exact_token(server, chat):
    s = scorer(server.base_url, chat=chat)
    rows = s.score(TEMPLATE, [SCAM, PLAIN])
    floor = -3.5 - math.log(2)  # below the least likely token the server named
    assert log_odds(rows) == pytest.approx([-1.0 - -3.0, floor - -1.2], abs=1e-5)
    assert np.exp(rows).sum(axis=1) == pytest.approx([1.0, 1.0], abs=1e-5)  # normalised over the labels
    assert s.stats.mode == "logprobs" and s.stats.labels_floored == 1
    assert server.log[-1][0] == ("/v1/chat/completions" if chat else "/v1/completions")


def test_word_match_adds_case_and_space_variants(server):
    rows = scorer(server.base_url, match="word").score(TEMPLATE, [SCAM])
    assert log_odds(rows)[0] == pytest.approx(np.logaddexp(-0.2, -1.0) - np.logaddexp(-2.5, -3.0), abs=1e-5)


def test_repeated_pairs_come_from_the_cache(server):
    s = scorer(server.base_url)
    first = s.score(TEMPLATE, [SCAM, PLAIN, SCAM])
    again = s.score(TEMPLATE, [PLAIN, SCAM])
    assert np.array_equal(again, first[[1, 0]])
    assert (s.stats.pairs_scored, s.stats.pairs_cached, server.completion_requests) == (2, 2, 2)
    assert s.stats.as_dict()["request_ms_p95"] > 0


def test_stalled_server_times_out_retries_then_raises_within_bounds(server):
    server.faults.stall_s = 30
    s = scorer(server.base_url, timeout_s=0.3, max_retries=2, backoff_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(EndpointError, match=r"127\.0\.0\.1.*failed 3 times.*no complete answer within 0\.3 s"):
        s.score(TEMPLATE, [SCAM])
    elapsed = time.perf_counter() - t0
    assert elapsed < 3 * 0.3 + 0.05 + 0.1 + 1.0  # three timeouts, two backoffs, slack for a busy CPU
    assert (s.stats.timeouts, s.stats.retries, s.stats.errors) == (3, 2, 1)


@pytest.mark.parametrize("fault", ["fail_first", "rate_limit_first"])
def test_500s_and_429s_are_retried_until_the_server_answers(server, fault):
    setattr(server.faults, fault, 2)
    s = scorer(server.base_url, max_retries=3)
    rows = s.score(TEMPLATE, [SCAM])
    assert log_odds(rows)[0] == pytest.approx(2.0, abs=1e-5)
    assert (s.stats.retries, s.stats.requests, s.stats.errors) == (2, 3, 0)
    assert server.log[0] == ("/v1/models", 200)  # the model list, read once before the first request
    assert [status for _, status in server.log[1:]] == [500 if fault == "fail_first" else 429] * 2 + [200]


def test_retries_give_up_after_max_retries(server):
    server.faults.fail_first = 10
    s = scorer(server.base_url, max_retries=1)
    with pytest.raises(EndpointError, match=r"failed 2 times; last: HTTP 500: simulated failure \d of 10"):
        s.score(TEMPLATE, [SCAM, PLAIN])
    assert s.stats.errors == 2 and s.stats.retries == 2


def test_no_logprobs_falls_back_to_answers_and_says_so(server, caplog):
    server.faults.no_logprobs = True
    s = scorer(server.base_url, max_concurrency=1)
    with caplog.at_level(logging.WARNING, logger="pipelines.engine.endpoints"):
        rows = s.score(TEMPLATE, [SCAM, PLAIN, "gibberish"])
    assert s.stats.mode == "answers" and s.stats.as_dict()["mode"] == "answers"
    assert log_odds(rows)[:2] == pytest.approx([math.log(999), -math.log(999)], abs=1e-3)  # "Yes" / "No"
    assert rows[2] == pytest.approx([math.log(0.5)] * 2) and s.stats.answers_unmapped == 1  # "The"
    assert server.completion_requests == 4  # one probe with logprobs, then three answers
    assert sum("gives no log-probs" in r.message for r in caplog.records) == 1


def test_a_server_that_rejects_top_20_logprobs_gets_answers_mode(server, monkeypatch):
    monkeypatch.setattr(srv, "MAX_TOP_LOGPROBS", 5)  # like vLLM started with --max-logprobs 5: a 400
    s = scorer(server.base_url)
    assert log_odds(s.score(TEMPLATE, [SCAM]))[0] == pytest.approx(math.log(999), abs=1e-3)
    assert s.stats.mode == "answers" and s.stats.retries == 0


def test_loopback_ignores_a_proxy_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    assert log_odds(scorer(server.base_url, max_retries=0).score(TEMPLATE, [SCAM]))[0] == pytest.approx(2.0, abs=1e-5)


def test_unknown_route_names_the_url_and_the_fix(server):
    root = server.base_url.removesuffix("/v1")
    with pytest.raises(EndpointError, match=r"POST http://127\.0\.0\.1:\d+/chat/completions returned 404.*ends in /v1"):
        scorer(root).score(TEMPLATE, [SCAM])
    with pytest.raises(EndpointError, match="gave no model list"):
        scorer(root).check()


def test_unknown_model_names_the_models_served(server):
    with pytest.raises(EndpointError, match=r"does not serve model 'gpt-x'; it serves \['scripted'\]"):
        scorer(server.base_url, model="gpt-x").score(TEMPLATE, [SCAM])
    assert server.completion_requests == 0  # refused from the model list, before any request
    with pytest.raises(EndpointError, match=r"does not serve model 'gpt-x'; it serves \['scripted'\]"):
        scorer(server.base_url, model="gpt-x").check()
    assert scorer(server.base_url).check() == ["scripted"]


def test_a_server_that_answers_any_model_name_is_refused_from_its_model_list(server):
    # llama.cpp's server answers a request for a model it does not have with its own model, 200, the asked
    # name echoed in "model": only GET /models tells. Asked once per scorer, before its first request.
    server.faults.any_model = True
    with pytest.raises(EndpointError, match=r"does not serve model 'gpt-x'; it serves \['scripted'\]"):
        scorer(server.base_url, model="gpt-x").score(TEMPLATE, [SCAM])
    with pytest.raises(EndpointError, match=r"does not serve model 'gpt-x'"):
        scorer(server.base_url, model="gpt-x").answer(TEMPLATE, [SCAM], 3)
    assert server.completion_requests == 0
    seen = len(server.log)
    s = scorer(server.base_url)
    s.score(TEMPLATE, [SCAM, PLAIN])
    s.answer(TEMPLATE, [SCAM], 3)
    assert [path for path, _ in server.log[seen:]].count("/v1/models") == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_first_token_stop_with_empty_logprobs_is_asked_again_with_min_tokens(server, chat):
    # llama.cpp's server leaves the stop token's step out of the log-probs: a model that stops at once gets
    # an empty list (chat: "content": []; completions: "tokens": []), no text, finish_reason "stop". That is not
    # a server without log-probs (which would switch the scorer to answers for good). Asked again with
    # min_tokens 1, the server names that position's tokens: the labels' own log-probs, as vLLM gives at once.
    server.faults.stop_step_dropped = True
    s = scorer(server.base_url, chat=chat, match="word")
    rows = s.score(TEMPLATE, ["(silence)", SCAM])
    assert log_odds(rows) == pytest.approx([-3.0 - -2.6, np.logaddexp(-0.2, -1.0) - np.logaddexp(-2.5, -3.0)], abs=1e-5)
    assert s.stats.mode == "logprobs" and s.stats.labels_floored == 0 and s.stats.responses_invalid == 0
    assert (s.stats.requests, server.completion_requests) == (3, 3)  # "(silence)" twice, the scam message once
    assert s.answer(TEMPLATE, ["(silence)"], 3)[0].text == ""  # the answer itself is empty
    server.faults.stop_step_dropped = False  # vLLM's shape: the stop step is named, with its alternatives
    assert np.array_equal(scorer(server.base_url, chat=chat, match="word").score(TEMPLATE, ["(silence)"]), rows[:1])
    assert server.completion_requests == 5  # asked once


def test_a_server_that_refuses_min_tokens_gives_a_stopped_pair_a_uniform_row(server, caplog):
    server.faults.stop_step_dropped = server.faults.min_tokens_refused = True
    s = scorer(server.base_url, max_concurrency=1)
    with caplog.at_level(logging.INFO, logger="pipelines.engine.endpoints"):
        rows = s.score(TEMPLATE, ["(silence)", SCAM, "(silence) again"])
    assert rows[0] == pytest.approx([math.log(0.5)] * 2) and rows[2] == pytest.approx([math.log(0.5)] * 2)
    assert log_odds(rows)[1] == pytest.approx(2.0, abs=1e-5)  # the other pairs still read their log-probs
    assert s.stats.mode == "logprobs" and s.stats.labels_floored == 4 and s.stats.errors == 0
    assert server.completion_requests == 4  # min_tokens refused once, then not sent again
    assert sum("refused min_tokens" in r.message for r in caplog.records) == 1


def test_response_without_choices_is_an_error(server):
    server.faults.no_choices = True
    with pytest.raises(EndpointError, match="answered without choices"):
        scorer(server.base_url).score(TEMPLATE, [SCAM])


def test_nothing_listening_is_retried_then_reported():
    with socket.socket() as sock:  # a port that was free a moment ago and has no server now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scorer(f"http://127.0.0.1:{port}/v1", max_retries=1)
    with pytest.raises(EndpointError, match="failed 2 times; last: connection failed"):
        s.score(TEMPLATE, [SCAM])
    assert s.stats.retries == 1


def test_api_key_is_sent_and_never_shown(monkeypatch, caplog):
    key = "sk-test-5ecret-do-not-print"
    with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted", api_key=key) as server:
        monkeypatch.setenv("TEST_ENDPOINT_KEY", key)
        good = scorer(server.base_url, api_key_env="TEST_ENDPOINT_KEY")
        assert log_odds(good.score(TEMPLATE, [SCAM]))[0] == pytest.approx(2.0, abs=1e-5)
        monkeypatch.setenv("TEST_ENDPOINT_KEY", key + "-wrong")
        bad = scorer(server.base_url, api_key_env="TEST_ENDPOINT_KEY")
        with caplog.at_level(logging.DEBUG), pytest.raises(EndpointError) as raised:
            bad.score(TEMPLATE, [SCAM])
    message = str(raised.value)
    assert "refused the API key" in message and "$TEST_ENDPOINT_KEY is set" in message
    assert key not in message + repr(good) + repr(bad) + caplog.text


def test_make_label_scorer_picks_the_endpoint_for_a_url(server):
    s = make_label_scorer(server.base_url, ["yes", "no"], model="scripted", chat_template=False, timeout_s=5)
    assert isinstance(s, EndpointLabelScorer) and s.chat is False and s.timeout_s == 5
    with pytest.raises(ValueError, match="needs the model name"):
        make_label_scorer(server.base_url, ["yes", "no"])
    with pytest.raises(ValueError, match="differ only in case"):
        EndpointLabelScorer(server.base_url, "scripted", ["yes", "Yes"])


# The risk seed template is a poor fit for exact-token matching: SmolLM2 starts its answer with "No"/"Yes",
# and lowercase "yes" falls outside the top 20 for about half of these messages (see pipelines/engine/endpoints.py).
# This instruction keeps both lowercase answers in the top 20 for every example, so the endpoint sees the
# same two numbers LabelScorer reads and the comparison tests the transport, not the truncation.
LOWERCASE_TEMPLATE = Template("Is the following SMS a scam? Write only yes or no, in lowercase letters.\n{text}", ("text",))


@pytest.mark.e2e
def test_endpoint_scores_match_the_in_process_scorer_on_real_risk_examples():
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import load_causal_lm
    from pipelines.engine.target import LabelScorer
    from rewards.promptbench_metrics import roc_auc

    task = load_task("risk")
    dev = load_splits(task).dev
    examples = [e for e in dev if e.label == "high_risk"][:12] + [e for e in dev if e.label == "low_risk"][:12]
    texts, positive = [e.text for e in examples], [e.label == "high_risk" for e in examples]
    verbalizers = [task.labels[name].verbalizer for name in task.labels]
    # float32 on both sides (the cached bf16 weights, upcast): in bf16 batching and padding alone move
    # log-odds by up to about 0.16 here, and ROC-AUC by 0.02; in float32 the two paths agree to about 2e-5.
    lm = load_causal_lm()
    lm.model.float()
    expected = LabelScorer(lm, verbalizers).score(LOWERCASE_TEMPLATE, texts)
    with srv.OpenAICompatServer(srv.ModelBackend(lm), "smollm2") as server:
        endpoint = EndpointLabelScorer(server.base_url, "smollm2", verbalizers, timeout_s=60)
        got = endpoint.score(LOWERCASE_TEMPLATE, texts)
    assert endpoint.stats.as_dict() | {"seconds": 0, "request_ms_p50": 0, "request_ms_p95": 0} == {
        "mode": "logprobs", "pairs_scored": 24, "pairs_cached": 0, "requests": 24, "retries": 0, "timeouts": 0,
        "errors": 0, "responses_invalid": 0, "labels_floored": 0, "answers_unmapped": 0, "answers_generated": 0, "seconds": 0,
        "request_ms_p50": 0, "request_ms_p95": 0,
    }
    # Both pool each verbalizer's capitalisations; the server names only its top 20 tokens, so a rare form
    # (" YES") can be missing there: measured differences up to 0.01 in log-probs.
    assert np.abs(got - expected).max() < 0.02
    assert np.abs(log_odds(got) - log_odds(expected)).max() < 0.02
    auc_in, auc_ep = roc_auc(log_odds(expected), positive), roc_auc(log_odds(got), positive)
    assert abs(auc_in - auc_ep) <= 1 / (12 * 12) + 1e-9  # at most one discordant pair


def test_greedy_answers_over_the_endpoint_say_when_they_were_cut_off(server):
    s = scorer(server.base_url)
    first = s.answer(TEMPLATE, [SCAM, PLAIN], 3)
    assert [a.text for a in first] == ["Yes", "No"] and not any(a.truncated for a in first)  # stopped by itself
    assert s.stats.answers_generated == 2
    again = s.answer(TEMPLATE, [SCAM], 3)
    assert again == first[:1] and s.stats.answers_generated == 2  # cached
    (cut,) = s.answer(TEMPLATE, [SCAM], 1)
    assert cut.text == "Yes" and cut.truncated  # the server stopped at the limit: finish_reason "length"
    with pytest.raises(ValueError, match="at least 1"):
        s.answer(TEMPLATE, [SCAM], 0)


def test_a_malformed_answer_is_an_empty_one_not_a_crash(server):
    server.faults.no_choices = True
    with pytest.raises(EndpointError, match="without choices"):  # no answer at all is a failed request
        scorer(server.base_url, max_retries=0).answer(TEMPLATE, [PLAIN], 2)
