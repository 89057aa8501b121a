"""The drift check: the pure bar comparison (table-driven), and `tune-prompts check` end to end against a
scripted OpenAI-compatible server (no model: exit codes, the table, JSON, --tune-if-below, missing store/label)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from pipelines import cli, cli_production
from pipelines.config import load_task
from pipelines.drift import Bar, compare, held_out
from templates.store import TemplateStore

_spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
srv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, srv)
_spec.loader.exec_module(srv)


@pytest.mark.parametrize("values, minimums, expected", [
    ({"a": 0.9}, {"a": 0.8}, [Bar("a", 0.9, 0.8, True)]),
    ({"a": 0.8}, {"a": 0.8}, [Bar("a", 0.8, 0.8, True)]),  # the minimum itself holds
    ({"a": 0.79}, {"a": 0.8}, [Bar("a", 0.79, 0.8, False)]),
    ({}, {"a": 0.8}, [Bar("a", None, 0.8, False)]),  # not measured fails
    ({"a": None}, {"a": 0.8}, [Bar("a", None, 0.8, False)]),  # the judge abstained: fails
    ({"a": math.nan}, {"a": 0.8}, [Bar("a", None, 0.8, False)]),  # NaN never slips through
    ({"m": 0.7}, {"m": None}, [Bar("m", 0.7, None, None)]),  # no bar: reported, not checked
    ({"a": 0.9, "b": 0.1}, {"b": 0.5, "a": 0.5}, [Bar("b", 0.1, 0.5, False), Bar("a", 0.9, 0.5, True)]),  # bar order
])
def test_compare(values, minimums, expected):
    assert compare(values, minimums) == expected


@pytest.mark.parametrize("passed, holds", [
    ([True, True], True), ([True, False], False), ([None], True), ([None, False], False), ([], True),
])
def test_held_out_ignores_unchecked_rows(passed, holds):
    assert held_out([Bar("x", 1.0, None if p is None else 0.0, p) for p in passed]) is holds


# --- the CLI --------------------------------------------------------------------------------------
SPAMMY = ("free", "win", "prize", "call", "txt", "claim", "urgent", "cash", "£")


def rule(prompt: str) -> list[tuple[str, float]]:
    """The judge's questions get 'yes'; a message with a spammy word gets 'yes', others 'no'."""
    if "You review prompts" in prompt:
        return [("yes", -0.1), ("no", -2.5)]
    message = prompt.rsplit("Message:", 1)[-1].lower()
    return [("yes", -0.2), ("no", -1.8)] if any(w in message for w in SPAMMY) else [("no", -0.2), ("yes", -1.8)]


@pytest.fixture(scope="module")
def server():
    with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted") as s:
        yield s


@pytest.fixture
def small_task(write_small_risk_task) -> str:
    """The risk task with small splits, so a check takes seconds."""
    return write_small_risk_task(test=40, robustness_examples=10)


@pytest.fixture
def store(tmp_path, small_task) -> str:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with TemplateStore(url) as s:
        v = s.add_version("risk", load_task(small_task).seed_template(), scores={"test": {"balanced_accuracy": 0.8}})
        s.promote("risk", v.id, force=True)
    return url


def check(server, task, store, *extra):
    return cli.main(["check", "--task", task, "--store", store, "--target-url", server.base_url,
                     "--target-model", "scripted", *extra])


def test_check_passes_prints_each_bar_and_exits_0(server, small_task, store, capsys):
    assert check(server, small_task, store, "--min-metric", "0.5") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["bar", "value", "minimum", "result"]
    rows = {line.split()[0]: line.split() for line in lines[3:-1]}
    assert set(rows) == {"instruction_following", "entity_consistency", "readability", "balanced_accuracy"}
    assert rows["readability"][-1] == "pass"  # the seed instruction reads as one an analyst would sign
    assert rows["instruction_following"][2:] == ["0.820", "pass"] and rows["balanced_accuracy"][2:] == ["0.500", "pass"]
    assert lines[-1] == "check: production version 1 of risk holds on the test split (40 examples)"


def test_check_below_a_bar_exits_1_with_json(server, small_task, store, capsys):
    assert check(server, small_task, store, "--min-metric", "0.999", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["version"] == 1 and report["split"] == "test"
    bars = {b["name"]: b for b in report["bars"]}
    assert bars["balanced_accuracy"]["passed"] is False and bars["balanced_accuracy"]["minimum"] == 0.999
    assert bars["instruction_following"]["passed"] is True and bars["instruction_following"]["value"] > 0.82


def test_metric_bar_defaults_to_the_recorded_figure_minus_max_drop(server, small_task, store, capsys):
    check(server, small_task, store, "--max-drop", "0.1", "--json")
    bars = {b["name"]: b for b in json.loads(capsys.readouterr().out)["bars"]}
    assert bars["balanced_accuracy"]["minimum"] == pytest.approx(0.8 - 0.1)


def test_tune_if_below_starts_a_tuning_run_into_the_same_store(server, small_task, store, monkeypatch, capsys):
    seen = {}

    def fake_run_tuning(task, options, *, resume, json_output):
        seen.update(task=task, options=options, resume=resume, json_output=json_output)
        return {"steps": options.steps}

    monkeypatch.setattr(cli_production, "run_tuning", fake_run_tuning)
    assert cli.main(["--steps", "3", "--num-scorers", "2", "--seed", "5", "--max-concurrency", "6", "check", "--task",
                     small_task, "--store", store, "--min-metric", "0.999", "--tune-if-below", "--json",
                     "--target-url", server.base_url, "--target-model", "scripted"]) == 0  # the tuning run completed
    options = seen["options"]
    assert options.store_url == store and options.promote and seen["task"].name == "risk"
    # the run tunes the served model the check scored
    assert (options.target.url, options.target.model, options.target.max_concurrency) == (server.base_url, "scripted", 6)
    assert (options.steps, options.num_scorers, seen["task"].ppo.seed) == (3, 2, 5)  # the tuning flags reach the run
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["tuning"] == {"steps": 3}  # one JSON document with the run inside
    seen.clear()
    assert check(server, small_task, store, "--min-metric", "0.999", "--tune-if-below") == 0
    assert "tuning risk (--tune-if-below)" in capsys.readouterr().out
    seen.clear()
    assert check(server, small_task, store, "--min-metric", "0.5", "--tune-if-below") == 0
    assert not seen  # holds: no tuning


def test_missing_store_or_production_label_exits_2(tmp_path, capsys):
    assert cli.main(["check", "--task", "risk", "--store", f"sqlite:///{tmp_path / 'none.sqlite'}"]) == 2
    assert "no store at" in capsys.readouterr().err
    url = f"sqlite:///{tmp_path / 'other.sqlite'}"
    with TemplateStore(url) as s:
        s.add_version("risk", load_task("risk").seed_template())  # a version, but no production label
    assert cli.main(["check", "--task", "risk", "--store", url]) == 2
    assert "no production template" in capsys.readouterr().err


def test_unreachable_endpoint_exits_2(server, small_task, store, capsys):
    assert cli.main(["check", "--task", small_task, "--store", store, "--target-url", server.base_url,
                     "--target-model", "not-served"]) == 2
    assert "does not serve model 'not-served'" in capsys.readouterr().err

