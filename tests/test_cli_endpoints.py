"""`tune-prompts eval` scoring through an OpenAI-compatible endpoint: the loopback server running the real
embedded model (tests/openai_compat_server.py), and CandidateScorer's checks on prebuilt scorers."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.config import load_task
from pipelines.scoring import CandidateScorer

_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, srv)
_spec.loader.exec_module(srv)


class FakeScorer:
    def __init__(self, verbalizers):
        self.verbalizers = list(verbalizers)

    def score(self, template, texts):
        raise AssertionError("not called in these tests")


@pytest.mark.parametrize("target, judge, message", [
    (FakeScorer(["no", "yes"]), None, r"the target scorer answers \['no', 'yes'\]; it must answer \['yes', 'no'\]"),
    (FakeScorer(["yes", "no"]), FakeScorer(["Yes", "No"]), r"the judge scorer answers"),
    (object(), FakeScorer(["yes", "no"]), r"the target scorer answers \[\]"),
])
def test_prebuilt_scorers_must_answer_the_roles_words(target, judge, message):
    task = load_task("risk")
    with pytest.raises(ValueError, match=message):
        CandidateScorer(task, None, target, judge or target, tokenizer=None)


@pytest.fixture(scope="module")
def server():
    import torch

    from pipelines.engine.models import load_causal_lm

    # One torch thread: on a busy 2-core machine two threads that spin-wait for each other made each request
    # take about 2.5 s instead of 0.13 s, and requests then ran into the scorer's 30 s timeout.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with srv.OpenAICompatServer(srv.ModelBackend(load_causal_lm()), "smollm2") as s:
            yield s
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def small_task(write_small_risk_task) -> str:
    return write_small_risk_task(test=12, robustness_examples=3)  # every request through one torch thread


@pytest.mark.e2e
def test_eval_through_the_endpoint_scores_every_component(server, small_task, capsys):
    assert cli.main(["eval", "--task", small_task, "--split", "test", "--target-url", server.base_url,
                     "--target-model", "smollm2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 12 and report["valid"]
    assert 0.0 <= report["metrics"]["roc_auc"] <= 1.0 and report["decision_threshold"] is not None
    assert set(report["judge"]) == set(load_task("risk").judge.all_rubrics)  # the same server judged (shared scorer)
    kept, answered = report["rates"]["instruction_following"]["kept"], report["rates"]["instruction_following"]["of"]
    assert answered == 12 and 0 <= kept <= 12  # the server's greedy answers, parsed by the contract
    assert all(v is not None for v in report["reward"]["components"].values())
    assert report["latency_ms"]["p95"] >= report["latency_ms"]["p50"] > 0  # timed by the endpoint scorer
    endpoint = report["target_endpoint"]
    assert endpoint["url"] == server.base_url and endpoint["mode"] == "logprobs" and endpoint["errors"] == 0
    assert endpoint["pairs_scored"] >= 12 + 20 and report["template_tokens"] > 0  # tokens: the embedded tokenizer
    assert server.completion_requests >= endpoint["requests"]


@pytest.mark.e2e
def test_separate_judge_endpoint_and_the_api_key_from_its_variable(server, small_task, monkeypatch, capsys):
    server.api_key = "s3cret"
    try:
        assert cli.main(["eval", "--task", small_task, "--target-url", server.base_url, "--target-model", "smollm2",
                         "--json"]) == 2
        assert "gave no model list" in capsys.readouterr().err  # GET /models is refused without the key
        monkeypatch.setenv("MY_KEY", "s3cret")
        assert cli.main(["eval", "--task", small_task, "--split", "test", "--target-url", server.base_url,
                         "--target-model", "smollm2", "--judge-url", server.base_url, "--judge-model", "smollm2",
                         "--api-key-env", "MY_KEY", "--json"]) == 0
        out = capsys.readouterr().out
        assert "s3cret" not in out and json.loads(out)["valid"]
    finally:
        server.api_key = None


def test_endpoint_errors_exit_2_with_the_message(capsys):
    assert cli.main(["eval", "--task", "risk", "--target-url", "http://127.0.0.1:9/v1", "--target-model", "m"]) == 2
    assert "GET http://127.0.0.1:9/v1/models gave no model list" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "risk", "--target-url", "localhost:8000/v1", "--target-model", "m"]) == 2
    assert "must start with http://" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "risk", "--target-url", "http://127.0.0.1:9/v1"]) == 2
    assert "needs --target-model, the model name" in capsys.readouterr().err
