"""`tune-prompts store ...` through argparse and run(args): exit codes, tables, JSON, errors; on SQLite
and PostgreSQL (the ``backend`` fixture in conftest.py)."""

import argparse
import json

import pytest

from pipelines import cli_store
from templates.gate import Decision
from templates.routing import takes_canary
from templates.store import TemplateStore
from templates.template import Template

PASSED = Decision(True, ("pass: instruction_following 0.9 >= 0.82",))
REFUSED = Decision(False, ("fail: error_rate 0.5 > 0.02",))


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tune-prompts")
    sub = parser.add_subparsers(dest="command")
    cli_store.register(sub)
    return cli_store.run(parser.parse_args(list(argv)))


def fill(url: str) -> str:
    """risk: v1 in production, v2 a better child, v3 refused by the gate; summarize: v4."""
    with TemplateStore(url) as store:
        v1 = store.add_version("risk", Template.from_text("Classify {text}"), run_id="run-1", decision=PASSED,
                               scores={"test": {"balanced_accuracy": 0.70}}, latency={"latency_p95_ms": 120.0})
        store.add_version("risk", Template.from_text("Classify carefully {text}"), parent_id=v1.id, run_id="run-2",
                          decision=PASSED, scores={"test": {"balanced_accuracy": 0.75}}, latency={"latency_p95_ms": 110.0})
        store.add_version("risk", Template.from_text("Guess {text}"), run_id="run-2", decision=REFUSED)
        store.add_version("summarize", Template.from_text("Summarize {text}"), decision=PASSED)
        store.promote("risk", v1.id)
    return url


@pytest.fixture
def store_url(backend):
    return fill(backend.url)


def state(url: str) -> tuple:
    with TemplateStore(url) as store:
        return store.generation(), store.labels("risk"), store.canary("risk"), len(store.list_versions("risk"))


def test_list_tasks_and_versions(store_url, capsys):
    assert cli("store", "list", "--store", store_url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["TASK", "VERSIONS", "PRODUCTION", "CANARY", "LABELS"]
    assert lines[1].split() == ["risk", "3", "1", "-", "production=1"]
    assert lines[2].split() == ["summarize", "1", "-", "-"]

    assert cli("store", "list", "risk", "--store", store_url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["ID", "HASH", "PARENT", "RUN", "GATE", "LABELS"]
    assert lines[0].index("PARENT") == lines[1].index("-")  # columns line up
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[2], r[3], r[4], r[5]) for r in rows] == [
        ("1", "-", "run-1", "promote", "production"), ("2", "1", "run-2", "promote", "-"),
        ("3", "-", "run-2", "refuse", "-")]
    assert rows[1][-1] == "balanced_accuracy=0.75"


def test_list_json(store_url, capsys):
    assert cli("store", "list", "risk", "--json", "--store", store_url) == 0
    versions = json.loads(capsys.readouterr().out)
    assert [(v["id"], v["labels"], v["decision"]["promote"]) for v in versions] == [
        (1, ["production"], True), (2, [], True), (3, [], False)]
    assert versions[1]["template"]["text"] == "Classify carefully {text}"
    assert cli("store", "list", "--json", "--store", store_url) == 0
    assert json.loads(capsys.readouterr().out)[0] == {
        "task": "risk", "versions": 3, "labels": {"production": 1}, "canary_share": None}


def test_show_by_id_and_by_label(store_url, capsys):
    assert cli("store", "show", "risk@production", "--store", store_url) == 0
    out = capsys.readouterr().out
    assert "version      1 (" in out and "labels       production" in out
    assert "test scores  balanced_accuracy=0.7" in out
    assert "decision     - (stored without one: predict refuses it)" in out
    assert "pass: instruction_following 0.9 >= 0.82" in out
    assert out.rstrip().endswith("template:\n  Classify {text}")
    assert cli("store", "show", "3", "--json", "--store", store_url) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["decision"] == {"promote": False, "reasons": ["fail: error_rate 0.5 > 0.02"]}


def test_show_names_the_production_decision_a_version_ships_with(tmp_path, capsys):
    from templates.contract import OutputContract
    from templates.decision import DecisionRule

    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    calibrated = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), "high_risk", -1.5)
    contract = OutputContract("labels", ("high_risk", "low_risk"), ("yes", "no"))
    answer = DecisionRule("answer", ("high_risk", "low_risk"), ("yes", "no"), contract=contract, max_new_tokens=4)
    with TemplateStore(url) as store:
        for rule in (calibrated, answer):
            store.add_version("risk", Template("Scam? {text}", ("text",), decision=rule), decision=PASSED)
    assert cli("store", "show", "1", "--store", url) == 0
    assert "decision     calibrated: high_risk when its label log-odds > -1.5 (fitted on train)" in capsys.readouterr().out
    assert cli("store", "show", "2", "--store", url) == 0
    assert "decision     answer: greedy, at most 4 new tokens; first word is one of yes/no" in capsys.readouterr().out


def test_diff(store_url, capsys):
    assert cli("store", "diff", "risk@production", "2", "--store", store_url) == 0
    out = capsys.readouterr().out
    assert "-Classify {text}\n+Classify carefully {text}" in out
    assert ["test", "balanced_accuracy", "+0.05"] in [line.split() for line in out.splitlines()]
    assert ["latency", "latency_p95_ms", "-10"] in [line.split() for line in out.splitlines()]
    assert cli("store", "diff", "1", "2", "--json", "--store", store_url) == 0
    assert json.loads(capsys.readouterr().out)["latency_deltas"] == {"latency_p95_ms": -10.0}


def test_promote_and_rollback(store_url, capsys):
    assert cli("store", "promote", "risk", "2", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: production 1 -> 2"
    assert state(store_url)[1] == {"production": 2}
    assert cli("store", "rollback", "risk", "--json", "--store", store_url) == 0
    assert json.loads(capsys.readouterr().out) == {"task": "risk", "production": 1, "previous": 2}
    assert state(store_url)[1] == {"production": 1}


def test_promoting_a_refused_version_needs_force(store_url, capsys):
    before = state(store_url)
    assert cli("store", "promote", "risk", "3", "--store", store_url) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: version 3 was refused by the gate: fail: error_rate 0.5 > 0.02;")
    assert "--force" in err and err.count("\n") == 1
    assert state(store_url) == before
    assert cli("store", "promote", "risk", "3", "--force", "--store", store_url) == 0
    assert "forced past the gate" in capsys.readouterr().out
    assert state(store_url)[1] == {"production": 3}


def test_label(store_url, capsys):
    assert cli("store", "label", "risk", "staging", "2", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: staging -> 2"
    assert state(store_url)[1] == {"production": 1, "staging": 2}


def test_route_canary_lifecycle(store_url, capsys):
    assert cli("store", "route", "risk", "--canary", "2", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: production 1; canary 2 gets 5% (ramp 5%, 20%, 100%)"
    assert cli("store", "route", "risk", "--advance", "--json", "--store", store_url) == 0
    assert json.loads(capsys.readouterr().out)["canary"] == {"version": 2, "share": 0.2, "ramp": [0.05, 0.2, 1.0]}

    keys = [f"user-{i}" for i in range(200)]
    in_canary = next(k for k in keys if takes_canary("risk", k, 0.2))
    in_production = next(k for k in keys if not takes_canary("risk", k, 0.2))
    assert cli("store", "route", "risk", "--key", in_canary, "--json", "--store", store_url) == 0
    assert json.loads(capsys.readouterr().out) | {"bucket": None} == {
        "task": "risk", "production": 1, "canary": {"version": 2, "share": 0.2, "ramp": [0.05, 0.2, 1.0]},
        "key": in_canary, "bucket": None, "route": "canary", "version": 2}
    assert cli("store", "route", "risk", "--key", in_production, "--store", store_url) == 0
    assert capsys.readouterr().out.startswith(f"{in_production} -> production (version 1; bucket ")

    assert cli("store", "promote", "risk", "2", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: production 1 -> 2; canary 2 ended"
    assert cli("store", "route", "risk", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: production 2; no canary"


def test_route_with_own_share_and_ramp_then_end(store_url, capsys):
    assert cli("store", "route", "risk", "--canary", "2", "--share", "0.01", "--ramp", "0.01,0.5",
               "--store", store_url) == 0
    assert "canary 2 gets 1% (ramp 1%, 50%)" in capsys.readouterr().out
    assert cli("store", "route", "risk", "--end", "--store", store_url) == 0
    assert capsys.readouterr().out.strip() == "risk: production 1; no canary"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["show", "99"], "error: no version 99 in the store"),
        (["show", "seven"], "is not a version"),
        (["show", "risk@staging"], "task 'risk' has no label 'staging'; its labels are ['production']"),
        (["list", "rsik"], "error: unknown task 'rsik'; the store has risk, summarize"),
        (["rollback", "risk"], "production holds version 1 and no earlier version"),
        (["rollback", "nope"], "unknown task 'nope'"),
        (["promote", "risk", "4"], "version 4 belongs to task 'summarize', not 'risk'"),
        (["promote", "risk", "1"], "already production"),
        (["label", "risk", "production", "2"], "production moves only by promotion"),
        (["label", "risk", "Bad", "2"], "must match"),
        (["route", "risk", "--advance"], "no canary to advance"),
        (["route", "risk", "--share", "0.1"], "use them with --canary VERSION"),
        (["route", "risk", "--canary", "1"], "already production"),
    ],
)
def test_errors_print_one_line_exit_2_and_change_nothing(store_url, capsys, argv, message):
    before = state(store_url)
    assert cli("store", *argv, "--store", store_url) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == ""
    assert state(store_url) == before


def test_missing_or_foreign_store_files(tmp_path, capsys):
    assert cli("store", "list", "--store", f"sqlite:///{tmp_path / 'typo.sqlite'}") == 2
    assert "no store at" in capsys.readouterr().err
    assert not (tmp_path / "typo.sqlite").exists()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    assert cli("store", "list", "--store", str(junk)) == 2
    assert "is not a tune-prompts store (file is not a database)" in capsys.readouterr().err
    assert junk.read_bytes() == b"not a database at all" * 100
    assert cli("store", "list", "--store", "postgresql://user:s3cret@127.0.0.1:1/prompts") == 2
    assert capsys.readouterr().err == ("error: cannot connect to PostgreSQL for postgresql://user:***@127.0.0.1:1/prompts:"
                                       " connection refused; start the server or fix the host and port in the URL\n")


def test_a_missing_store_is_an_error_and_is_not_created(backend, capsys):
    assert cli("store", "list", "--store", backend.url) == 2
    assert capsys.readouterr().err.startswith("error: no store at ")
    assert backend.snapshot() == {}


def test_default_store_comes_from_tune_prompts_home(tmp_path, monkeypatch, capsys):
    fill(f"sqlite:///{tmp_path / 'store.sqlite'}")
    monkeypatch.setenv("TUNE_PROMPTS_HOME", str(tmp_path))
    assert cli("store", "list") == 0
    assert "risk" in capsys.readouterr().out


def test_store_without_a_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli("store")
    assert exc.value.code == 2
