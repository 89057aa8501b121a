"""The store checks what it reads (issue #41): rows written outside the store's code that break its schema (a NaN
score, a time that is not ISO 8601, control characters in a name) are named by version and field; `store show`
marks them, `predict` refuses to serve them, `store doctor` lists them all. A read-only store stays as it was."""

import dataclasses
import importlib.util
import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from pipelines import cli
from templates.decision import DecisionRule
from templates.store import TemplateStore

_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, srv)
_spec.loader.exec_module(srv)

SERVED_TASK = str(Path(__file__).parent / "data" / "risk_served.yaml")
TASK = "risk-served"


def seed_record() -> str:
    from pipelines.config import load_task

    rule = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), positive="high_risk", threshold=0.0)
    return json.dumps(dataclasses.replace(load_task(SERVED_TASK).seed_template(), decision=rule).to_dict())


def fill(path: Path) -> str:
    """A sound store: version 1 of risk-served in production."""
    from templates.template import Template

    url = f"sqlite:///{path}"
    with TemplateStore(url) as store:
        store.promote(TASK, store.add_version(TASK, Template.from_dict(json.loads(seed_record()))).id, force=True)
    return url


@pytest.fixture
def damaged(tmp_path) -> str:
    """Versions 2-4 and history row 2 written with raw sqlite3, each breaking its schema in one field."""
    url = fill(tmp_path / "store.sqlite")
    conn = sqlite3.connect(tmp_path / "store.sqlite", isolation_level=None)
    insert = ("INSERT INTO versions (task, content_hash, template, scores, latency, created_at) "
              "VALUES (?, 'abc', ?, ?, '{}', ?)")
    conn.execute(insert, (TASK, seed_record(), '{"test": {"roc_auc": NaN}}', "2026-01-01T00:00:00"))
    conn.execute(insert, (TASK, seed_record(), "{}", 1700000000))
    conn.execute(insert, ("risk\x1b[31m", seed_record(), '{"dev": {"f1": Infinity}}', "2026-01-01T00:00:00"))
    conn.execute("INSERT INTO label_history (task, label, version_id, action, moved_at) "
                 "VALUES (?, 'staging', 1, 'set', 'yesterday')", (TASK,))
    conn.close()
    return url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_show_and_list_mark_a_damaged_version_by_field(damaged, capsys):
    code, out, err = run(capsys, "store", "show", "2", "--store", damaged)
    assert code == 0 and err == ""
    assert out.startswith("DAMAGED      scores.test.roc_auc: nan is not a finite number (predict refuses it")
    code, out, _ = run(capsys, "store", "show", "3", "--store", damaged, "--json")
    assert code == 0 and json.loads(out)["damage"] == ["created_at: '1700000000' is not an ISO 8601 time"]
    code, out, _ = run(capsys, "store", "show", "1", "--store", damaged)
    assert code == 0 and "DAMAGED" not in out
    code, out, _ = run(capsys, "store", "list", TASK, "--store", damaged)
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["2"].startswith("2 DAMAGED(scores.test.roc_auc)") and rows["3"].startswith("3 DAMAGED(created_at)")
    assert "DAMAGED" not in rows["1"]


def test_doctor_lists_every_damaged_row_and_exits_2(damaged, capsys):
    code, out, err = run(capsys, "store", "doctor", "--store", damaged)
    assert code == 2 and err == "" and "\x1b" not in out
    assert "versions       2   scores.test.roc_auc: nan is not a finite number" in out
    assert "versions       3   created_at: '1700000000' is not an ISO 8601 time" in out
    assert "versions       4   task: 'risk\\x1b[31m' has control characters" in out
    assert "versions       4   scores.dev.f1: inf is not a finite number" in out
    assert "label_history  2   moved_at: 'yesterday' is not an ISO 8601 time" in out
    assert out.rstrip().endswith("5 damaged field(s) in 4 row(s): the rows were written outside tune-prompts or "
                                 "damaged on disk; restore the store from a backup")
    code, out, _ = run(capsys, "store", "doctor", "--store", damaged, "--json")
    assert code == 2 and {(r["table"], r["id"]) for r in json.loads(out)["damaged"]} == {
        ("versions", 2), ("versions", 3), ("versions", 4), ("label_history", 2)}


def test_doctor_names_a_record_that_does_not_decode(damaged, capsys):
    conn = sqlite3.connect(damaged.removeprefix("sqlite:///"), isolation_level=None)
    conn.execute("INSERT INTO versions (task, content_hash, template, scores, latency, created_at) "
                 "VALUES (?, 'abc', '{not json', '{}', '{}', '2026-01-01T00:00:00')", (TASK,))
    conn.close()
    code, out, _ = run(capsys, "store", "doctor", "--store", damaged)
    assert code == 2 and "versions       5   Expecting property name" in out


def test_doctor_passes_a_sound_store(tmp_path, capsys):
    assert run(capsys, "store", "doctor", "--store", fill(tmp_path / "store.sqlite")) == (0, "every row is sound\n", "")


@pytest.fixture
def server():
    with srv.OpenAICompatServer(srv.ScriptedBackend(lambda prompt: [("yes", -0.2), ("no", -1.8)]), "scripted") as s:
        yield s


def predict(server, url: str) -> list[str]:
    return ["predict", "--task", SERVED_TASK, "--store", url, "--target-url", server.base_url, "--target-model",
            "scripted", "--text", "WIN a prize now"]


def test_predict_refuses_a_damaged_version_and_serves_a_sound_one(damaged, server, capsys):
    code, out, _ = run(capsys, *predict(server, damaged))
    assert code == 0 and out.startswith("high_risk\tversion 1")
    with TemplateStore(damaged) as store:
        store.promote(TASK, 2, force=True)
    asked = server.completion_requests
    code, out, err = run(capsys, *predict(server, damaged))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: version 2 is damaged (scores.test.roc_auc: nan is not a finite number): predict "
                          "does not serve it; `tune-prompts store doctor` lists every damaged row")
    assert server.completion_requests == asked  # refused before the model was asked


def test_a_read_only_store_stays_byte_for_byte_after_show_doctor_and_predict(tmp_path, server, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    url = fill(folder / "store.sqlite")
    (folder / "store.sqlite").chmod(0o444)
    folder.chmod(0o555)  # read-only for everyone: root too is served read-only (mode=ro, nothing created)
    try:
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert list(before) == ["store.sqlite"]
        with TemplateStore(url, create=False) as store:  # held open while the commands run
            assert store.get_version(1).id == 1
            assert sorted(os.listdir(folder)) == ["store.sqlite"]
            for argv in (["store", "show", "1"], ["store", "list", TASK], ["store", "doctor"]):
                assert run(capsys, *argv, "--store", url)[0] == 0, argv
            assert run(capsys, *predict(server, url))[0] == 0
            assert sorted(os.listdir(folder)) == ["store.sqlite"]
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    finally:
        folder.chmod(0o755)
