"""A store written by older code still opens, serves and moves: tests/data/store_fixture_main.sqlite was made by
main at 567331d (tests/data/make_store_fixture.py says what it holds). Each test works on a copy."""

import argparse
import hashlib
import json
import math
import shutil
import sqlite3
from pathlib import Path

import pytest

from pipelines import cli_store
from templates.gate import Decision
from templates.routing import Canary, takes_canary
from templates.serving import TemplateReader
from templates.store import StoreError, TemplateStore
from templates.template import Template

FIXTURE = Path(__file__).parent / "data" / "store_fixture_main.sqlite"
PASSED = Decision(True, ("pass: test roc_auc 0.86 >= 0.70",))
V2_TEXT = "Transaction: {text}\nIs it risky?\nAnswer yes or no:"
V5_TEXT = "Transaction: {text}\nShould we hold this payment?\nAnswer yes or no:"


@pytest.fixture
def url(tmp_path):
    shutil.copyfile(FIXTURE, tmp_path / "store.sqlite")
    return f"sqlite:///{tmp_path / 'store.sqlite'}"


def schema(path) -> list[tuple]:
    conn = sqlite3.connect(path)  # a copy: even a read-only reader of a WAL file makes -wal and -shm beside it
    try:
        return (conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall()
                + conn.execute("SELECT key, value FROM meta ORDER BY key").fetchall()
                + conn.execute("PRAGMA journal_mode").fetchall())
    finally:
        conn.close()


def test_todays_code_creates_the_fixtures_schema(url, tmp_path):
    TemplateStore(f"sqlite:///{tmp_path / 'new.sqlite'}").close()
    assert schema(tmp_path / "new.sqlite") == schema(tmp_path / "store.sqlite")


def test_the_fixture_lists_as_it_was_written(url):
    with TemplateStore(url, create=False) as store:
        assert store.tasks() == ["risk", "spam"]
        versions = store.list_versions("risk")
        assert [(v.id, v.parent_id, v.run_id) for v in versions] == [
            (1, None, None), (2, 1, "run-fixture-1"), (3, 2, "run-fixture-2"), (4, 2, "run-fixture-3"),
            (5, 2, "run-fixture-4")]
        assert [v.decision.promote if v.decision else None for v in versions] == [None, True, True, False, True]
        assert versions[3].decision.reasons[0] == "fail: test roc_auc 0.64 < 0.70"
        assert versions[1].scores == {"dev": {"roc_auc": 0.8}, "test": {"roc_auc": 0.81}}
        assert versions[1].latency == {"template_tokens": 14, "latency_p95_ms": 41.0}
        assert versions[1].template.text == V2_TEXT and versions[1].template.decision.threshold == 0.5
        for v in versions:  # the content hash is still the hash of the record as today's code writes it
            record = json.dumps(v.template.to_dict(), sort_keys=True).encode()
            assert v.content_hash == hashlib.sha256(record).hexdigest()[:12]
        assert store.labels("risk") == {"production": 2, "staging": 3, "canary": 5}
        assert store.labels("spam") == {"production": 6}
        assert store.canary("risk") == Canary(5, 0.2, (0.05, 0.2, 1.0))
        assert store.generation() == 8
        assert store.check_rows() == []


def test_the_fixture_serves_its_production_and_canary(url):
    canary_key = next(f"user-{i}" for i in range(1000) if takes_canary("risk", f"user-{i}", 0.2))
    production_key = next(f"user-{i}" for i in range(1000) if not takes_canary("risk", f"user-{i}", 0.2))

    class Scorer:  # the target model's label log-probs, without a model: P(yes) = 0.9
        verbalizers = ("yes", "no")

        def score(self, template, texts):
            return [[math.log(0.9), math.log(0.1)] for _ in texts]

    reader = TemplateReader(url, watch=False)
    try:
        assert reader.get("risk").text == V2_TEXT
        assert reader.get("risk", "staging").text.endswith("Would a fraud analyst flag it?\nAnswer yes or no:")
        assert reader.for_caller("risk", canary_key).text == V5_TEXT
        assert reader.render("risk", {"text": "$9,000 at 3am"}, key=production_key) == V2_TEXT.format(
            text="$9,000 at 3am")
        prediction = reader.predict("risk", {"text": "$9,000 at 3am"}, Scorer())
        assert (prediction.label, prediction.version_id) == ("risky", 2)  # log-odds log(9) > the threshold 0.5
    finally:
        reader.close()


def test_the_fixture_takes_a_new_promotion_and_rolls_back(url):
    with TemplateStore(url, create=False) as store:
        with pytest.raises(StoreError, match="refused by the gate"):
            store.promote("risk", 4)
        v7 = store.add_version("risk", Template.from_text("Flag risky payments: {text}"), parent_id=5,
                               run_id="run-after-split", decision=PASSED)
        assert v7.id == 7
        promotion = store.promote("risk", v7.id)
        assert (promotion.id, promotion.previous_id, promotion.ended_canary_id) == (7, 2, 5)
        assert store.labels("risk") == {"production": 7, "staging": 3}
        reader = TemplateReader(url, watch=False)
        try:
            assert reader.get("risk").text == "Flag risky payments: {text}"
        finally:
            reader.close()
        assert store.rollback("risk").id == 2  # the history written before the split still stacks
        assert store.generation() == 11
        assert store.check_rows() == []


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tune-prompts")
    cli_store.register(parser.add_subparsers(dest="command"))
    return cli_store.run(parser.parse_args(list(argv)))


def test_the_fixture_through_the_cli(url, capsys):
    assert cli("store", "route", "risk", "--store", url, "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        "task": "risk", "production": 2, "canary": {"version": 5, "share": 0.2, "ramp": [0.05, 0.2, 1.0]}}
    assert cli("store", "doctor", "--store", url, "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"damaged": []}
    assert cli("store", "promote", "risk", "5", "--store", url, "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        "task": "risk", "production": 5, "previous": 2, "canary_ended": True, "forced": False}
    assert cli("store", "list", "--store", url, "--json") == 0
    assert [(t["task"], t["versions"], t["labels"]) for t in json.loads(capsys.readouterr().out)] == [
        ("risk", 5, {"production": 5, "staging": 3}), ("spam", 1, {"production": 6})]
