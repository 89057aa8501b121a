"""Tasks and data: built-ins load offline, user tasks from YAML + CSV/JSONL, and bad input fails clearly."""

import json
import textwrap
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.config import ConfigError, load_task
from pipelines.data import DataError, load_examples, load_splits, split_examples


def write_task(tmp_path: Path, data_rows=None, *, extra: str = "", data_file="cases.csv", label_values=None, header="label,text") -> Path:
    rows = data_rows if data_rows is not None else [("fraud", f"Send your PIN to claim prize {i}") for i in range(20)] + [
        ("ok", f"See you at lunch on day {i}") for i in range(20)
    ]
    if data_file.endswith(".jsonl"):
        (tmp_path / data_file).write_text("".join(json.dumps({"label": l, "text": t}) + "\n" for l, t in rows))
    else:
        (tmp_path / data_file).write_text(header + "\n" + "".join(f"{l},{t}\n" for l, t in rows))
    label_values = label_values or {"high": "fraud", "low": "ok"}
    task = tmp_path / "task.yaml"
    task.write_text(
        textwrap.dedent(
            f"""\
            name: cases
            description: Is an inbound case risky?
            data:
              source: {data_file}
              format: {"jsonl" if data_file.endswith(".jsonl") else "csv"}
            labels:
              high: {{values: [{label_values["high"]}], verbalizer: "yes"}}
              low: {{values: [{label_values["low"]}], verbalizer: "no"}}
            positive_label: high
            split: {{seed: 3, train: 10, dev: 10, test: 10}}
            template:
              skeleton: "{{instruction}}\\nCase: {{text}}\\nIs this case risky? Answer yes or no."
              seed_instruction: "You screen cases for a bank."
            judge:
              rubrics: {{coherence: "Is the answer a clear yes or no?"}}
            reward:
              weights: {{task_metric: 1.0, instruction_following: 0.5}}
            """
        )
        + extra
    )
    return task


def test_builtin_tasks_load_their_packaged_data():
    for name, n_min in (("risk", 4000), ("sentiment", 4500)):
        task = load_task(name)
        examples = load_examples(task)
        assert len(examples) > n_min
        assert len({e.text for e in examples}) == len(examples)  # repeats dropped
        assert set(e.label for e in examples) == set(task.labels)


def test_splits_are_deterministic_stratified_and_disjoint():
    task = load_task("risk")
    a, b = load_splits(task), load_splits(task)
    assert a == b
    texts = {s: {e.text for e in a[s]} for s in ("train", "dev", "test")}
    assert not (texts["train"] & texts["test"]) and not (texts["dev"] & texts["test"]) and not (texts["train"] & texts["dev"])
    for s in ("train", "dev", "test"):
        labels = [e.label for e in a[s]]
        assert labels.count("high_risk") == labels.count("low_risk")  # balanced per label
    other_seed = split_examples(task.with_overrides(**{"split.seed": 99}), load_examples(task))
    assert {e.text for e in other_seed.test} != texts["test"]


def test_growing_dev_never_moves_examples_into_test():
    task = load_task("risk")
    base = load_splits(task)
    bigger = split_examples(task.with_overrides(**{"split.dev": 300}), load_examples(task))
    assert base.test == bigger.test


def test_user_task_from_yaml_and_csv_renders_end_to_end(tmp_path, capsys):
    task_file = write_task(tmp_path)
    assert main(["render", "--task", str(task_file), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "You screen cases for a bank.\nCase: " in out and "Is this case risky? Answer yes or no." in out
    assert main(["tasks", str(task_file), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[-1]["task"] == "cases" and rows[-1]["examples"] == 40


def test_user_task_from_jsonl(tmp_path):
    task = load_task(write_task(tmp_path, data_file="cases.jsonl"))
    splits = load_splits(task)
    assert len(splits.train) == len(splits.dev) == len(splits.test) == 10


def run_cli(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: ("nope",), "unknown task 'nope'"),
        (lambda p: (str(p / "missing.yaml"),), "does not exist"),
        (lambda p: ((p / "bad.yaml").write_text("name: [unclosed\n") and str(p / "bad.yaml"),), "not valid YAML"),
        (lambda p: (str(write_task(p, extra="surprise: 1\n")),), "1 unknown key(s) (the first: surprise)"),
        (lambda p: (str(write_task(p, header="label,body")),), "column 'text' not found"),
        (lambda p: (str(write_task(p, data_rows=[("maybe", "x")] * 4 + [("ok", "y")] * 4)),), "not mapped to any label"),
        (lambda p: (str(write_task(p, data_rows=[])),), "holds no rows"),
        (lambda p: (str(write_task(p, data_rows=[("ok", f"fine {i}") for i in range(40)])),), "have no examples"),
        (lambda p: (str(write_task(p, extra="positive_label: nobody\n")),), "positive_label"),
    ],
)
def test_bad_task_input_fails_with_a_clear_message(tmp_path, capsys, setup, message):
    (task_arg,) = setup(tmp_path)
    code, output = run_cli(["render", "--task", task_arg], capsys)
    assert code == 2
    assert message in output
    assert "Traceback" not in output


def test_bad_skeleton_is_rejected(tmp_path):
    task_file = write_task(tmp_path)
    task_file.write_text(task_file.read_text().replace("Case: {text}", "Case: {text} {text.__class__}"))
    with pytest.raises(ConfigError, match="template.skeleton"):
        load_task(task_file)


def test_too_small_data_names_the_split(tmp_path):
    task = load_task(write_task(tmp_path, data_rows=[("fraud", f"a {i}") for i in range(6)] + [("ok", f"b {i}") for i in range(6)]))
    with pytest.raises(DataError, match="split 'dev' needs 5 examples"):
        load_splits(task)
