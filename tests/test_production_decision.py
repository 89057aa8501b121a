"""What production receives: the decision rule ships inside the stored version, and the serving path
(TemplateReader.predict, `tune-prompts predict`) reproduces the held-out figures the store recorded, on the same
examples, in-process and through the loopback OpenAI-compatible server running the real embedded model."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from pipelines import cli
from rewards import promptbench_metrics as pbm
from templates.decision import DecisionError, DecisionRule
from templates.store import TemplateStore
from templates.template import Template, TemplateError

_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, srv)
_spec.loader.exec_module(srv)

RISK = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), "high_risk", 0.5)


# --- the rule itself: pure -----------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs, expected", [
    ((math.log(0.7), math.log(0.3)), "high_risk"),  # log-odds 0.85 > 0.5
    ((math.log(0.6), math.log(0.4)), "low_risk"),  # log-odds 0.41 <= 0.5: the threshold, not argmax, decides
    ((math.log(0.2), math.log(0.8)), "low_risk"),
])
def test_a_calibrated_rule_thresholds_the_positive_log_odds(logprobs, expected):
    assert RISK.decide(logprobs) == expected


def test_an_argmax_rule_takes_the_most_probable_label_of_any_number():
    rule = DecisionRule("argmax", ("a", "b", "c"), ("x", "y", "z"))
    assert rule.decide([-2.0, -0.5, -1.0]) == "b"


def test_a_calibrated_rule_over_three_labels_adds_its_offsets_before_the_argmax_and_travels_in_json():
    rule = DecisionRule("calibrated", ("pos", "neg", "plot"), ("positive", "negative", "plot"),
                        offsets=(0.0, 1.0, -1.0))
    assert rule.decide([-0.9, -1.2, -1.5]) == "neg"  # argmax alone would say pos: -1.2 + 1 > -0.9 + 0
    assert rule.decide([-0.1, -3.0, -2.8]) == "pos"
    assert DecisionRule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    assert "neg +1" in rule.describe() and "threshold" not in rule.to_dict()
    assert "offsets" not in RISK.to_dict()  # binary records (and their content hashes) are as before


def test_fitted_offsets_beat_the_argmax_on_skewed_log_probs_and_ovr_auc_matches_binary():
    import numpy as np

    rng = np.random.default_rng(0)
    gold = [label for label in ("a", "b", "c") for _ in range(60)]
    centers = {"a": (0.0, -1.0, -1.0), "b": (-1.0, 0.0, -1.0), "c": (-1.0, -1.0, 0.0)}
    raw = np.array([centers[g] for g in gold]) + rng.normal(0, 0.6, (180, 3)) + (2.0, 0.0, -2.0)  # a strong bias to a
    logprobs = raw - np.logaddexp.reduce(raw, axis=1, keepdims=True)
    argmax = [("a", "b", "c")[k] for k in logprobs.argmax(axis=1)]
    offsets = pbm.fit_offsets(logprobs, gold, ("a", "b", "c"))
    fitted = [("a", "b", "c")[k] for k in (logprobs + offsets).argmax(axis=1)]
    assert abs(offsets.sum()) < 1e-9
    assert pbm.balanced_accuracy(argmax, gold, "abc") < 0.55 < 0.75 < pbm.balanced_accuracy(fitted, gold, "abc")
    # two labels: the macro one-vs-rest ROC-AUC is the binary ROC-AUC of the positive log-odds
    two = logprobs[:, :2] - np.logaddexp.reduce(logprobs[:, :2], axis=1, keepdims=True)
    y = gold[:120]
    assert pbm.roc_auc_ovr(two[:120], y, ("a", "b")) == pytest.approx(
        pbm.roc_auc(two[:120, 0] - two[:120, 1], [g == "a" for g in y]))
    with pytest.raises(ValueError, match="at least two labels"):
        pbm.fit_offsets(logprobs[:60], gold[:60], ("a", "b", "c"))


def test_an_answer_rule_parses_the_answer_and_travels_with_its_contract():
    from templates.contract import OutputContract

    contract = OutputContract("labels", ("high_risk", "low_risk"), ("yes", "no"))
    rule = DecisionRule("answer", ("high_risk", "low_risk"), ("yes", "no"), contract=contract, max_new_tokens=4)
    assert rule.parse("Yes, it is.").value == "high_risk"
    assert not rule.parse("It is a scam").ok and not rule.parse("Ye", truncated=True).ok
    assert DecisionRule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    shipped = Template("Is it a scam? {text}", ("text",), decision=rule)
    assert Template.from_dict(json.loads(json.dumps(shipped.to_dict()))).decision == rule
    with pytest.raises(DecisionError, match="use parse"):
        rule.decide([0.0, 0.0])
    with pytest.raises(DecisionError, match="reads label log-probs"):
        RISK.parse("yes")
    with pytest.raises(DecisionError, match="contract"):
        DecisionRule.from_dict({**rule.to_dict(), "contract": {"kind": "labels", "labels": ["a"], "words": ["x"]}})


@pytest.mark.parametrize("make, message", [
    (lambda: DecisionRule("vote", ("a", "b"), ("x", "y")), "not one of"),
    (lambda: DecisionRule("argmax", ("a",), ("x",)), "two or more distinct labels"),
    (lambda: DecisionRule("argmax", ("a", "a"), ("x", "y")), "two or more distinct labels"),
    (lambda: DecisionRule("calibrated", ("a", "b"), ("x", "y"), "c", 0.0), "names the positive one"),
    (lambda: DecisionRule("calibrated", ("a", "b"), ("x", "y"), "a", math.nan), "finite threshold"),
    (lambda: DecisionRule("argmax", ("a", "b"), ("x", "y"), threshold=1.0), "no positive label, threshold"),
    (lambda: DecisionRule("argmax", ("a", "b", "c"), ("x", "y", "z"), offsets=(0, 0, 0)), "or offsets"),
    (lambda: DecisionRule("calibrated", ("a", "b"), ("x", "y"), "a", 0.0, offsets=(0, 0)), "not offsets"),
    (lambda: DecisionRule("calibrated", ("a", "b", "c"), ("x", "y", "z"), "a", 0.0), "offsets, not a positive"),
    (lambda: DecisionRule("calibrated", ("a", "b", "c"), ("x", "y", "z"), offsets=(0, 1)), "one finite offset per"),
    (lambda: DecisionRule("calibrated", ("a", "b", "c"), ("x", "y", "z"), offsets=(0, 1, math.inf)), "finite offset"),
    (lambda: DecisionRule("calibrated", ("a", "b", "c"), ("x", "y", "z"), offsets="012"), "list of numbers"),
    (lambda: DecisionRule("answer", ("a", "b"), ("x", "y"), max_new_tokens=4), "needs its output contract"),
    (lambda: DecisionRule("calibrated", ("a", "b"), ("x", "y"), "a", 0.0, max_new_tokens=4), "no contract"),
    (lambda: RISK.decide([0.0]), "2 finite label log-probs"),
    (lambda: RISK.decide([math.nan, 0.0]), "finite"),
])
def test_bad_rules_and_inputs_are_refused_with_the_fix(make, message):
    with pytest.raises(DecisionError, match=message):
        make()


def test_the_rule_travels_inside_the_template_record_and_a_bare_record_is_unchanged():
    bare = Template("Is it a scam? {text}", ("text",))
    assert "decision" not in bare.to_dict()  # stored bare templates keep their record and content hash
    shipped = Template(bare.text, bare.variables, decision=RISK)
    again = Template.from_dict(json.loads(json.dumps(shipped.to_dict())))
    assert again == shipped and again.decision == RISK and again != bare
    with pytest.raises(TemplateError, match="decision record has 1 unknown field"):
        Template.from_dict({**shipped.to_dict(), "decision": {**RISK.to_dict(), "bias": 1}})


# --- the serving path reproduces the stored figures ----------------------------------------------------
def _stored_and_served(task_path, store_url, target, served_target, decision="calibrated") -> tuple[dict, list, list]:
    """Evaluate the seed on test with ``target``, store it the way a tuning run does, then predict every test
    example through TemplateReader with ``served_target`` (a fresh scorer: no pair comes from a cache)."""
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.promotion import promote
    from pipelines.scoring import build_scorer
    from templates.serving import TemplateReader

    task = load_task(task_path)
    splits = load_splits(task)
    ev = build_scorer(task, splits, target).evaluate(task.seed_template().text, "test")
    promote(task, store_url, [ev], "test-run")
    with TemplateStore(store_url) as store:
        version = store.get_label(task.name, "production")
    assert version.template.decision == ev.decision and ev.decision.kind == decision
    reader = TemplateReader(store_url)
    served = [reader.predict(task.name, {"text": e.text}, served_target) for e in splits.test]
    reader.close()
    gold = [e.label for e in splits.test]
    preds = [p.label for p in served]
    if decision == "answer":  # the application sees each raw answer, and whether it kept the contract
        assert all(isinstance(p.answer, str) and (p.label is None) == bool(p.reason) for p in served)
        kept = sum(p.label is not None for p in served)
        assert version.scores["test"]["instruction_following"] == kept / len(served)
    return version.scores["test"], gold, preds


@pytest.fixture(scope="module")
def lm():
    from pipelines.engine.models import load_causal_lm

    return load_causal_lm()


# Each decision kind runs in the default tier once: calibrated in process, answer over the endpoint; the other pairs
# in the slow tier.
@pytest.fixture(params=["calibrated", pytest.param("answer", marks=pytest.mark.slow)])
def small_task(request, write_small_risk_task) -> str:
    return write_small_risk_task(test=24, robustness_examples=4, decision=request.param)


@pytest.fixture(params=["answer", pytest.param("calibrated", marks=pytest.mark.slow)])
def served_task(request, write_small_risk_task) -> str:
    # 12 held-out examples: every request goes through the loopback server on one torch thread (on an AVX2
    # machine, float32, 24 made this the default tier's second-longest test at 101 s)
    return write_small_risk_task(test=12, robustness_examples=2, decision=request.param)


def _decision(task_path) -> str:
    from pipelines.config import load_task

    return load_task(task_path).scoring.decision


@pytest.mark.e2e
def test_predict_in_process_reproduces_the_stored_held_out_figures(lm, small_task, tmp_path):
    from pipelines.scoring import label_scorer

    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    served_target = label_scorer(lm, ["yes", "no"], chat_template=True)
    stored, gold, preds = _stored_and_served(small_task, url, lm, served_target, _decision(small_task))
    labels = ["high_risk", "low_risk"]
    assert pbm.balanced_accuracy(preds, gold, labels) == stored["balanced_accuracy"]
    assert pbm.accuracy(preds, gold) == stored["accuracy"]


@pytest.fixture(scope="module")
def server(lm):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_cli_endpoints.py: spinning threads on a busy 2-core machine
    try:
        with srv.OpenAICompatServer(srv.ModelBackend(lm), "smollm2") as s:
            yield s
    finally:
        torch.set_num_threads(threads)


@pytest.mark.e2e
def test_predict_over_the_endpoint_reproduces_the_stored_held_out_figures(server, served_task, tmp_path, capsys):
    from pipelines.config import Endpoint
    from pipelines.scoring import label_scorer

    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    endpoint = Endpoint(server.base_url, "smollm2")
    served_target = label_scorer(endpoint, ["yes", "no"], chat_template=True)
    stored, gold, preds = _stored_and_served(served_task, url, endpoint, served_target, _decision(served_task))
    assert pbm.balanced_accuracy(preds, gold, ["high_risk", "low_risk"]) == stored["balanced_accuracy"]
    # The command line gives an application's answer for the same inputs, through the same path.
    from pipelines.config import load_task
    from pipelines.data import load_splits

    test = load_splits(load_task(served_task)).test[:3]
    argv = ["predict", "--task", served_task, "--store", url, "--target-url", server.base_url, "--target-model",
            "smollm2", "--json"]
    for e in test:
        argv += ["--text", e.text]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["label"] for row in out] == preds[:3] and all(row["version"] == 1 for row in out)


def test_predict_refuses_a_version_without_a_decision_and_a_missing_store(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    assert cli.main(["predict", "--task", "risk", "--store", url, "--text", "hi"]) == 2
    assert "no store at" in capsys.readouterr().err
    from pipelines.config import load_task

    with TemplateStore(url) as store:  # a version stored before decisions shipped with versions
        store.promote("risk", store.add_version("risk", load_task("risk").seed_template()).id, force=True)
    assert cli.main(["predict", "--task", "risk", "--store", url, "--text", "hi"]) == 2
    assert "carries no decision rule" in capsys.readouterr().err
