"""scripts/bench/tuning.py --quick: every method at one budget on the small test task, the table's shape, and
that no method spent more than its budget (the script checks both and exits 2 otherwise; so does this test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
from bench import tuning as bench_tuning


def test_the_bootstrap_interval_holds_the_mean_and_is_the_value_for_one_seed():
    assert bench_tuning.bootstrap([0.7]) == (0.7, 0.7, 0.7)
    mean, low, high = bench_tuning.bootstrap([0.6, 0.7, 0.8, 0.75])
    assert low <= mean <= high and 0.6 <= low and high <= 0.8 and mean == pytest.approx(0.7125)


def test_check_names_a_missing_method_and_an_overrun():
    rows = [{"task": "t", "method": m, "calls": 10, "budget": 10, "within_budget": True} for m in bench_tuning.METHODS]
    assert bench_tuning.check(rows, ["t"]) == []
    rows[3] = {**rows[3], "calls": 11, "within_budget": False}
    assert bench_tuning.check(rows, ["t"]) == ["t PPO: 11 calls > budget 10"]
    assert "methods" in bench_tuning.check(rows[:-1], ["t"])[0]


def test_the_ledger_reads_back_only_its_own_fingerprint_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = bench_tuning.Ledger(str(path), "abc")
    ledger.add("risk/seed 0/PPO", kind="search", template="T", calls=5, wall_s=1.0, note="")
    bench_tuning.Ledger(str(path), "other").add("risk/seed 0/PPO", kind="search", template="U", calls=6)
    with path.open("a") as f:
        f.write('{"fingerprint": "abc", "key": "risk/se')  # a kill in the middle of a write
    again = bench_tuning.Ledger(str(path), "abc")
    assert again.get("risk/seed 0/PPO")["template"] == "T" and again.other == 2
    assert bench_tuning.Ledger(None, "abc").records == {}


@pytest.mark.slow  # a bench job: every method searches
def test_quick_bench_runs_every_method_within_one_budget(tmp_path):
    out, ledger = tmp_path / "rows.json", tmp_path / "ledger.jsonl"
    command = [sys.executable, "-m", "bench.tuning", "--quick", "--ledger", str(ledger)]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    # run again on the same ledger: every search and test is read back, nothing runs, the same table
    again = subprocess.run([*command, "--out", str(tmp_path / "again.json")], capture_output=True, text=True,
                           cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    not_run = {r["method"] for r in rows if r["note"].startswith("not run")}  # never recorded: tried again
    reran = [line for line in again.stderr.splitlines()
             if "seed 0: " in line and line.split("seed 0: ")[1].removesuffix(" ...") not in not_run]
    assert "read back" in again.stderr and reran == []
    assert json.loads((tmp_path / "again.json").read_text()) == rows
    assert [r["method"] for r in rows] == list(bench_tuning.METHODS)
    budget = rows[0]["budget"]
    assert budget > 0 and all(r["budget"] == budget and r["calls"] <= budget for r in rows)
    ran = {r["method"]: r for r in rows if not r["note"].startswith("not run")}
    assert set(ran) >= {"seed", "best-of-N", "OPRO", "PPO"}
    for name in ("best-of-N", "OPRO", "PPO"):  # each searched, and its choice has held-out figures
        assert 0 < ran[name]["calls"] and 0 <= ran[name]["balanced_accuracy"] <= 1 and ran[name]["roc_auc"] is not None
    assert ran["seed"]["calls"] == 0
    for row in ran.values():  # next to each choice: its contract rate and the judge's grade of its text
        assert 0 <= row["instruction_following"] <= 1 and 0 <= row["readability"] <= 1
    assert "held-out test split" in done.stdout and "PPO" in done.stdout


@pytest.fixture
def scripted(monkeypatch):
    """Scripted searches and test pool: each search returns "METHOD SEED" and is recorded in ``searches`` as
    (task, seed, method); each test is recorded in ``tested`` and has fixed figures (no ROC-AUC on a
    generation task)."""
    import pipelines.ray_scoring as ray_scoring

    done = SimpleNamespace(searches=[], tested=[])

    class Pool:
        def __init__(self, *args, **kwargs): ...

        def evaluate(self, texts, split, latency):
            done.tested.extend(texts)
            return texts

        def shutdown(self): ...

    monkeypatch.setattr(ray_scoring, "ScoringPool", Pool)
    monkeypatch.setattr(ray_scoring, "init_ray", lambda: None)
    def run_method(method, task, splits, budget, plan, seed, options):
        # expert iteration and no update run PPO's search with ppo.update changed (bench.tuning.VARIANTS);
        # PPO itself runs PPO, whatever the product's default
        method = {"expert_iteration": "expert iteration", "none": "no update"}.get(task.ppo.update, method) \
            if method == "PPO" else method
        done.searches.append((task, seed, method))
        return bench_tuning.Outcome(f"{method} {seed}", 1, 0.1)

    monkeypatch.setattr(bench_tuning, "run_method", run_method)
    monkeypatch.setattr(bench_tuning, "probe", lambda *a: ["the probe's outputs"])  # no model load
    monkeypatch.setattr(bench_tuning, "test_figures", lambda task, text: {
        task.scoring.metric: 0.5, "roc_auc": None if task.is_generation else 0.6, "instruction_following": 1.0,
        "readability": 0.4, "instruction": text})
    return done


def test_methods_left_out_are_not_run_and_a_later_run_reads_back_the_others(tmp_path, scripted):
    """``--methods``: a short session runs only some methods; the rest keep their rows ("not run") and a later
    run with every method runs only what the ledger lacks."""
    from pipelines.config import RunOptions

    options = RunOptions(steps=1, wandb_mode="disabled", progress=False, dev_examples=12)
    ledger = str(tmp_path / "ledger.jsonl")

    def bench(methods):
        return bench_tuning.bench_task(bench_tuning.QUICK_TASK, [0, 1], None, options, 0, ledger,
                                       log=lambda *a: None, methods=methods)

    ran = scripted.searches
    rows = bench(("best-of-N",))  # the seed runs too: it is free
    assert [(seed, m) for _, seed, m in ran] == [(0, "seed"), (0, "best-of-N"), (1, "seed"), (1, "best-of-N")]
    assert sorted(scripted.tested) == ["best-of-N 0", "best-of-N 1", "seed 0", "seed 1"]
    assert [r["method"] for r in rows] == list(bench_tuning.METHODS) and bench_tuning.check(rows, ["t"]) == []
    left = [r for r in rows if r["method"] not in ("seed", "best-of-N")]
    assert all(r["note"].startswith("not run") and r["roc_auc"] is None and r["seeds"] == 0 for r in left)
    assert {r["method"]: r["seeds"] for r in rows if r not in left} == {"seed": 2, "best-of-N": 2}
    ran.clear()
    rows = bench(bench_tuning.METHODS)
    left_out = [m for m in bench_tuning.METHODS if m not in ("seed", "best-of-N")]
    assert [(seed, m) for _, seed, m in ran] == [(s, m) for s in (0, 1) for m in left_out]
    updates = {"PPO": "ppo", "expert iteration": "expert_iteration", "no update": "none"}  # not the product's default
    assert {m: task.ppo.update for task, _, m in ran if m in updates} == updates
    assert all(r["roc_auc"] == 0.6 for r in rows)


def test_a_task_variant_is_a_fingerprint_of_its_own_and_its_rows_name_the_change(tmp_path, scripted):
    """``--set ppo.advantage_estimator=rloo``: the variant's searches are not the plain task's records (nor the
    other way round), and its rows say which setting changed."""
    from pipelines.config import RunOptions

    options = RunOptions(steps=1, wandb_mode="disabled", progress=False, dev_examples=12)
    ledger = str(tmp_path / "ledger.jsonl")

    def bench(overrides=None):
        return bench_tuning.bench_task(bench_tuning.QUICK_TASK, [0], None, options, 0, ledger, log=lambda *a: None,
                                       methods=("PPO",), overrides=overrides)

    plain = bench()
    variant = bench({"ppo.advantage_estimator": "rloo"})
    ran = [(task.ppo.advantage_estimator, m) for task, _, m in scripted.searches]
    assert ran == [("gae", "seed"), ("gae", "PPO"), ("rloo", "seed"), ("rloo", "PPO")]  # nothing read across
    assert {r["task"] for r in plain} == {"risk-small"}
    assert {r["task"] for r in variant} == {"risk-small ppo.advantage_estimator=rloo"}
    scripted.searches.clear()
    bench({"ppo.advantage_estimator": "rloo"})
    assert scripted.searches == []  # the variant's own records are read back


@pytest.mark.parametrize("setting, message", [("nope", "is not SECTION.KEY=VALUE"),
                                              ("ppo.nothing=1", "unknown setting 'ppo.nothing'"),
                                              ("ppo.advantage_estimator=bogus", "is invalid")])
def test_a_bad_set_exits_2_with_one_line_and_runs_nothing(setting, message, tmp_path, monkeypatch, capsys):
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench_tuning.py", "--quick", "--ledger", str(ledger), "--set", setting])
    monkeypatch.setattr(bench_tuning, "run_method", lambda *a: pytest.fail("a method ran"))
    assert bench_tuning.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0] and not ledger.exists()


EVERY_SEARCH = ["seed", "best-of-N", "OPRO", "PPO", "expert iteration", "no update", "dspy copro", "dspy miprov2",
                "dspy gepa"]


def test_each_method_has_a_fingerprint_of_its_own_and_a_change_to_its_code_reruns_only_its_searches(
        tmp_path, scripted, monkeypatch):
    """Searches are recorded under their method's fingerprint (the scorer's plus the method's own code), tests under
    the scorer's. DSPy on a generation task (JSON contract) runs through scripts/bench/peers/dspy_generation.py:
    a change to it runs only the DSPy searches again; a changed probe output runs everything again, once asked
    (``--new-scorer``: the ledger's records are all another scorer's)."""
    from bench import ledger as bench_ledger
    from bench import paired as bench_paired
    from pipelines.config import RunOptions

    monkeypatch.setattr(bench_tuning, "run_dspy_generation", lambda task, splits, method, budget, seed, target, policy:
                        scripted.searches.append((task, seed, f"dspy {method}")) or
                        bench_tuning.Outcome(f"dspy {method} {seed}", 1, 0.1))
    options = RunOptions(steps=1, wandb_mode="disabled", progress=False, dev_examples=8)
    ledger = tmp_path / "ledger.jsonl"

    def bench(new_scorer=False):
        scripted.searches.clear()
        bench_tuning.bench_task(str(REPO / "tests" / "data" / "transactions_json.yaml"), [0], None, options, 0,
                                str(ledger), log=lambda *a: None, new_scorer=new_scorer)
        return [m for _, _, m in scripted.searches]

    assert bench() == EVERY_SEARCH
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    searches = {r["key"].split("/")[-1]: r for r in records if r["kind"] == "search"}
    assert len({r["fingerprint"] for r in searches.values()}) == len(bench_tuning.METHODS)
    tests = {r["fingerprint"] for r in records if r["kind"] == "test"}
    assert len(tests) == 1 and {r["scorer"] for r in searches.values()} == tests
    # what reads the rows: the DSPy choices' tests, under the scorer's fingerprint, with them
    found = bench_paired.choices(bench_paired.read_ledgers([str(ledger)])[searches["DSPy COPRO"]["fingerprint"]],
                                 "DSPy COPRO")
    assert [t["instruction"] for t in found.values()] == ["dspy copro 0"]  # the stand-in figures name the template
    assert bench() == []  # everything read back

    code_of = bench_ledger.code_of
    monkeypatch.setattr(bench_ledger, "code_of", lambda unit, root=None: code_of(unit, root)
                        + ("changed" if unit == "bench.peers.dspy_generation" else ""))
    assert bench() == ["dspy copro", "dspy miprov2", "dspy gepa"]  # only the generation peer's rows run again
    monkeypatch.setattr(bench_ledger, "code_of", lambda unit, root=None: code_of(unit, root)
                        + ("changed" if unit == "pipelines.loop" else ""))
    assert bench() == ["PPO", "expert iteration", "no update"]
    monkeypatch.setattr(bench_tuning, "probe", lambda *a: ["another scorer output"])
    before = ledger.read_text()
    with pytest.raises(bench_ledger.ScorerMismatch, match="none under this machine's"):  # e.g. another dtype
        bench()
    assert scripted.searches == [] and ledger.read_text() == before  # stopped before anything ran or was written
    assert bench(new_scorer=True) == EVERY_SEARCH  # asked for: a new set beside the old one


def test_fingerprints_lists_the_scorers_and_each_methods_and_runs_nothing(scripted, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.tuning", "--quick", "--fingerprints"])
    assert bench_tuning.main() == 0
    out = capsys.readouterr().out
    assert "tests, dev" in out and all(f"{m} searches" in out for m in bench_tuning.METHODS)
    assert scripted.searches == [] and scripted.tested == []
