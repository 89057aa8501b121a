"""scripts/bench/paired.py: seed-by-seed differences read from a bench ledger (pure logic, a written ledger)."""
import json
import sys

import pytest

from bench import paired as bench_paired
from bench import tuning as bench_tuning


def write_ledger(path, fingerprint, task, figures, metric="balanced_accuracy", kept=None, scorer=None, readable=None):
    """figures: {(method, seed): the task's metric} -> search and test records as bench.tuning writes them
    (a generation task's test record has its own metric and no ROC-AUC); kept: {(method, seed): contract rate};
    readable: {(method, seed): readability};
    scorer: the searches are a method's (``fingerprint``) made under this scorer's, which holds the tests (as
    bench.ledger writes them); None: one fingerprint for both, as the ledgers written before it."""
    with path.open("a") as f:
        for (method, seed), value in figures.items():
            template = f"{method} {seed} {value}\n{{text}}"
            auc = value + 0.1 if metric == "balanced_accuracy" else None
            f.write(json.dumps({"fingerprint": fingerprint, **({"scorer": scorer} if scorer else {}),
                                "key": f"{task}/seed {seed}/{method}", "kind": "search",
                                "template": template, "calls": 10}) + "\n")
            f.write(json.dumps({"fingerprint": scorer or fingerprint, "key": bench_tuning.test_key(task, template),
                                "kind": "test", "wall_s": 1.0, metric: value, "roc_auc": auc,
                                "instruction_following": (kept or {}).get((method, seed), 0.9),
                                "readability": (readable or {}).get((method, seed), 0.9),
                                "instruction": "Read."}) + "\n")


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_ledger(path, "aaaa1111", "risk", {("PPO", 0): 0.8, ("PPO", 1): 0.7, ("best-of-N", 0): 0.75,
                                            ("best-of-N", 1): 0.72, ("PPO", 2): 0.9})  # seed 2: PPO only
    write_ledger(path, "bbbb2222", "sentiment", {("PPO", 0): 0.5, ("best-of-N", 0): 0.6})
    write_ledger(path, "cccc3333", "risk", {("PPO", 0): 0.85})  # a variant: PPO alone
    path.write_text(path.read_text() + '{"cut short\n')  # a killed run's last line is skipped
    return path


def test_pairs_are_the_seeds_both_arms_finished_and_the_mean_over_tasks_weighs_tasks_equally(ledger, tmp_path):
    out = tmp_path / "pairs.json"
    assert bench_paired.main(["--ledger", str(ledger), "--a", "PPO@aaaa,bbbb", "--b", "best-of-N@aaaa,bbbb",
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(u["seed"], round(u["a"] - u["b"], 3)) for u in result["units"]["risk"]] == [(0, 0.05), (1, -0.02)]
    assert [round(u["a"] - u["b"], 3) for u in result["units"]["sentiment"]] == [-0.1]
    risk, sentiment, overall = result["summary"]
    assert risk["A - B"] == 0.015 and sentiment["A - B"] == -0.1
    assert overall["task"] == "mean over tasks" and overall["A - B"] == pytest.approx((0.015 - 0.1) / 2, abs=1e-3)
    low, high = (float(x) for x in overall["A - B 95%"].strip("[]").split(", "))
    assert low <= overall["A - B"] <= high


def test_a_variant_is_paired_with_the_plain_task_by_fingerprint(ledger, tmp_path):
    out = tmp_path / "pairs.json"
    assert bench_paired.main(["--ledger", str(ledger), "--a", "PPO@cccc", "--b", "PPO@aaaa", "--metric", "roc_auc",
                              "--out", str(out)]) == 0
    (unit,) = json.loads(out.read_text())["units"]["risk"]
    assert unit["run"] == "cccc3333/aaaa1111" and round(unit["a"] - unit["b"], 3) == 0.05


def test_a_generation_task_is_compared_on_its_own_metric_and_left_out_of_roc_auc(ledger, tmp_path):
    write_ledger(ledger, "dddd4444", "callback", {("PPO", 0): 0.70, ("best-of-N", 0): 0.65}, metric="field_exact_match")
    out = tmp_path / "pairs.json"
    assert bench_paired.main(["--ledger", str(ledger), "--a", "PPO@aaaa,dddd", "--b", "best-of-N@aaaa,dddd",
                              "--out", str(out)]) == 0
    units = json.loads(out.read_text())["units"]
    assert [u["metric"] for u in units["risk"]] == ["balanced_accuracy"] * 2
    assert [(u["metric"], round(u["a"] - u["b"], 3)) for u in units["callback"]] == [("field_exact_match", 0.05)]
    assert bench_paired.main(["--ledger", str(ledger), "--a", "PPO@aaaa,dddd", "--b", "best-of-N@aaaa,dddd",
                              "--metric", "roc_auc", "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["units"]) == ["risk"]


def test_the_gate_puts_the_seed_in_place_of_a_choice_that_misses_one_of_its_bars(tmp_path):
    """The bars are the task file's (snippets: instruction following 0.82, readability 0.45, a gain of 0.01)."""
    ledger, out = tmp_path / "ledger.jsonl", tmp_path / "pairs.json"
    write_ledger(ledger, "eeee5555", "snippets", {("seed", s): 0.42 for s in range(4)} | {
        ("PPO", 0): 0.58, ("PPO", 1): 0.55, ("PPO", 2): 0.60, ("PPO", 3): 0.425,
        ("best-of-N", 0): 0.49, ("best-of-N", 1): 0.50, ("best-of-N", 2): 0.44, ("best-of-N", 3): 0.435},
                 kept={("PPO", 0): 0.04, ("best-of-N", 1): 0.70}, readable={("PPO", 2): 0.2})
    args = ["--ledger", str(ledger), "--a", "PPO@eeee", "--b", "best-of-N@eeee", "--out", str(out)]
    assert bench_paired.main(args) == 0
    units = json.loads(out.read_text())["units"]["snippets"]
    assert [round(u["a"] - u["b"], 3) for u in units] == [0.09, 0.05, 0.16, -0.01]
    assert bench_paired.main([*args, "--gate"]) == 0
    units = json.loads(out.read_text())["units"]["snippets"]
    # PPO: seed 0 breaks the contract, seed 2 reads badly, seed 3 gains 0.005 < 0.01; best-of-N: seed 1's contract
    assert [(u["a"], u["b"]) for u in units] == [(0.42, 0.49), (0.55, 0.42), (0.42, 0.44), (0.42, 0.435)]


def add_dev_rewards(path, fingerprint, task, rewards):
    """rewards: {(method, seed, metric value): whole-dev reward} -> dev records as bench_seed_in_ranking writes them."""
    with path.open("a") as f:
        for (method, seed, value), reward in rewards.items():
            key = bench_tuning.test_key(task, f"{method} {seed} {value}\n{{text}}").replace("/test/", "/dev/")
            f.write(json.dumps({"fingerprint": fingerprint, "key": key, "kind": "dev", "total_reward": reward}) + "\n")


def test_with_the_seed_ranked_a_choice_ships_only_if_its_dev_reward_beats_the_seeds(tmp_path, capsys):
    ledger, out = tmp_path / "ledger.jsonl", tmp_path / "pairs.json"
    write_ledger(ledger, "ffff6666", "snippets", {("seed", 0): 0.42, ("seed", 1): 0.42, ("PPO", 0): 0.58,
                                                  ("PPO", 1): 0.55, ("best-of-N", 0): 0.49, ("best-of-N", 1): 0.50})
    args = ["--ledger", str(ledger), "--a", "PPO@ffff", "--b", "best-of-N@ffff", "--seed-ranked", "--out", str(out)]
    assert bench_paired.main(args) == 2  # no dev records yet: says which script writes them
    err = capsys.readouterr().err
    assert "seed_in_ranking" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    add_dev_rewards(ledger, "ffff6666", "snippets", {
        ("seed", 0, 0.42): -0.9, ("seed", 1, 0.42): -0.9,
        ("PPO", 0, 0.58): -2.5,        # under the seed on dev: the seed ships
        ("PPO", 1, 0.55): 1.7,         # over it: the choice ships
        ("best-of-N", 0, 0.49): -0.9,  # a tie keeps the seed
        ("best-of-N", 1, 0.50): 0.1})
    assert bench_paired.main(args) == 0
    units = json.loads(out.read_text())["units"]["snippets"]
    assert [(u["a"], u["b"]) for u in units] == [(0.42, 0.42), (0.55, 0.50)]


@pytest.mark.parametrize("args, says", [
    (["--a", "PPO", "--b", "PPO@aaaa"], "is not METHOD@FINGERPRINT"),
    (["--a", "PPO@zz", "--b", "PPO@aaaa"], "matches 0"),
    (["--a", "PPO@aaaa", "--b", "PPO@aaaa,bbbb"], "as many to both"),
    (["--a", "PPX@aaaa", "--b", "PPO@aaaa"], "no seed on which both"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(ledger, tmp_path, capsys, args, says):
    out = tmp_path / "pairs.json"
    assert bench_paired.main(["--ledger", str(ledger), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_the_gate_on_a_task_without_a_built_in_task_file_exits_2(tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    write_ledger(ledger, "aaaa1111", "loans", {("seed", 0): 0.6, ("PPO", 0): 0.7, ("best-of-N", 0): 0.65})
    assert bench_paired.main(["--ledger", str(ledger), "--a", "PPO@aaaa", "--b", "best-of-N@aaaa", "--gate"]) == 2
    err = capsys.readouterr().err
    assert "'loans'" in err and "not a built-in" in err and len(err.strip().splitlines()) == 1


def test_a_missing_ledger_exits_2(tmp_path, capsys):
    assert bench_paired.main(["--ledger", str(tmp_path / "none.jsonl"), "--a", "PPO@a", "--b", "PPO@a"]) == 2
    assert "cannot read ledger" in capsys.readouterr().err


def test_a_methods_searches_see_the_scorers_records(tmp_path):
    """A method's searches are recorded under a fingerprint of its own (bench.ledger.method_fingerprint), its
    tests under the scorer's; the gate still finds the seed template, searched under another method's."""
    ledger, out = tmp_path / "ledger.jsonl", tmp_path / "pairs.json"
    base, peer = "ffff6666aaaa0000", "eeee5555bbbb1111"
    write_ledger(ledger, base, "callback", {("seed", 0): 0.70, ("seed", 1): 0.70, ("PPO", 0): 0.72, ("PPO", 1): 0.66},
                 metric="field_exact_match")
    write_ledger(ledger, peer, "callback", {("DSPy COPRO", 0): 0.60, ("DSPy COPRO", 1): 0.68},
                 metric="field_exact_match", kept={("DSPy COPRO", 0): 0.5}, scorer=base)
    args = ["--ledger", str(ledger), "--a", "PPO@ffff", "--b", f"DSPy COPRO@{peer[:8]}", "--out", str(out)]
    assert bench_paired.main(args) == 0
    units = json.loads(out.read_text())["units"]["callback"]
    assert [round(u["a"] - u["b"], 3) for u in units] == [0.12, -0.02]
    # under the gate the seed ships for seed 0's COPRO choice (its contract rate) and for both seed 1 choices
    # (PPO's loses to the seed, COPRO's too)
    assert bench_paired.main([*args, "--gate"]) == 0
    units = json.loads(out.read_text())["units"]["callback"]
    assert [round(u["a"] - u["b"], 3) for u in units] == [0.02, 0.0]


def test_the_gate_finds_the_seed_searched_under_a_fingerprint_of_its_own(tmp_path):
    """Every method's searches have their own fingerprint, the seed's too (bench.ledger.METHOD_CODE); the seed runs
    no code of its own, so each method under the same scorer falls back on it."""
    ledger, out = tmp_path / "ledger.jsonl", tmp_path / "pairs.json"
    scorer = "ffff6666aaaa0000"
    write_ledger(ledger, "5eed0000", "risk", {("seed", 0): 0.70, ("seed", 1): 0.70}, scorer=scorer)
    write_ledger(ledger, "1111aaaa", "risk", {("PPO", 0): 0.75, ("PPO", 1): 0.78}, scorer=scorer,
                 kept={("PPO", 1): 0.5})
    write_ledger(ledger, "2222bbbb", "risk", {("best-of-N", 0): 0.705, ("best-of-N", 1): 0.72}, scorer=scorer)
    args = ["--ledger", str(ledger), "--a", "PPO@1111", "--b", "best-of-N@2222", "--gate", "--out", str(out)]
    assert bench_paired.main(args) == 0
    units = json.loads(out.read_text())["units"]["risk"]
    assert [(u["a"], u["b"]) for u in units] == [(0.75, 0.70), (0.70, 0.72)]


def test_seed_in_ranking_finds_each_methods_choices_in_its_own_ledger(tmp_path):
    from bench import seed_in_ranking as bench_seed_in_ranking

    path = tmp_path / "ledger.jsonl"
    base, ppo, copro = "ffff6666aaaa0000", "1111", "2222"
    write_ledger(path, base, "callback", {("PPO", 0): 0.1, ("DSPy COPRO", 0): 0.1}, metric="field_exact_match")
    write_ledger(path, ppo, "callback", {("PPO", 0): 0.72}, metric="field_exact_match", scorer=base)
    write_ledger(path, copro, "callback", {("DSPy COPRO", 0): 0.60}, metric="field_exact_match", scorer=base)
    ledger = bench_tuning.Ledger(str(path), base)
    searches = {m: bench_tuning.Ledger(str(path), {"PPO": ppo, "DSPy COPRO": copro}.get(m, "none"), scorer=base)
                for m in bench_tuning.METHODS}
    found = bench_seed_in_ranking.choices_in(ledger, searches, "callback", [0])
    assert {m: t.split()[-2] for (_, m), t in found.items()} == {"PPO": "0.72", "DSPy COPRO": "0.6"}
