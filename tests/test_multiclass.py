"""Tasks with more than two labels: config, the calibrated offsets, and a user's 4-label task over a CSV of its
own through `eval`, a 1-step tuning run (real model, Ray, W&B offline files, SQLite) and `predict`."""

import json
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.config import ConfigError, load_task

DATA = Path(__file__).parent / "data"
CASES = str(DATA / "cases_4label.yaml")
LABELS = ["fraud", "dispute", "access", "inquiry"]


def test_a_task_with_four_labels_loads_and_two_label_rules_stay():
    task = load_task(CASES)
    assert list(task.labels) == LABELS and task.positive_label is None
    assert task.verbalizers == LABELS
    with pytest.raises(ConfigError, match="positive_label is for two labels"):
        task.with_overrides(positive_label="fraud")
    risk = load_task("risk")
    with pytest.raises(ConfigError, match="name the one the calibrated threshold decides"):
        risk.with_overrides(positive_label=None)
    snippets = load_task("snippets")
    assert list(snippets.labels) == ["positive", "negative", "plot"]


@pytest.mark.e2e
def test_a_four_label_user_task_runs_through_eval(capsys):
    """eval on the four-label task: its calibrated decision over four labels, metrics and rates."""
    assert main(["eval", "--task", CASES, "--split", "test", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 16 and report["valid"]
    rule = report["decision"]
    assert rule["kind"] == "calibrated" and rule["labels"] == LABELS and len(rule["offsets"]) == 4
    assert {"accuracy", "balanced_accuracy", "macro_f1", "roc_auc"} <= set(report["metrics"])
    assert 0.0 <= report["metrics"]["roc_auc"] <= 1.0
    assert report["rates"]["instruction_following"]["of"] == 16
    assert all(s["decision"] in LABELS for s in report["samples"])


@pytest.mark.slow
def test_a_four_label_user_task_runs_through_tuning_the_store_and_predict(tmp_path, capsys, ray_session):
    """A tuning run on the four-label task, its version in the store, and predict serving it (slow: one more real run;
    the default tier's end-to-end run is tests/test_tuning.py's)."""
    run_dir, store = tmp_path / "run", f"sqlite:///{tmp_path / 'store.sqlite'}"
    code = main(["--task", CASES, "--steps", "1", "--dev-examples", "0", "--run-dir", str(run_dir), "--store", store])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out test split" in out and "under the calibrated decision" in out
    tuned = json.loads((run_dir / "report.json").read_text())
    assert tuned["steps"] == 1 and tuned["test"][0]["template_name"] == "seed"
    assert all(0.0 <= row["balanced_accuracy"] <= 1.0 for row in tuned["test"])

    texts = ["Someone used my card in Madrid for 800 EUR while I was at home.", "What does a transfer to Brazil cost?"]
    assert main(["predict", "--task", CASES, "--store", store, "--json", "--text", texts[0], "--text", texts[1]]) == 0
    served = json.loads(capsys.readouterr().out)
    assert [p["label"] in LABELS for p in served] == [True, True]
    assert all(set(p["logprobs"]) == set(LABELS) for p in served)
    assert main(["store", "show", "case-queues@production", "--store", store]) == 0
    assert "highest log-prob + offset" in capsys.readouterr().out
