"""The choice on dev (pipelines/choice.py): the gate's bars with margins, the seed in the race, a paired test.
Scripted evaluations: what the scorer would have measured on the same dev examples."""

import numpy as np
import pytest

from pipelines.choice import NO_WINNER, choose, latency_bound, paired_gain, pareto_front
from pipelines.config import load_task
from pipelines.loop import meets_bars, shortlist_of
from pipelines.scoring import Evaluation, Latency
from rewards.components import Measured
from rewards.weighting import Reward


@pytest.fixture(scope="module")
def task():
    return load_task("risk")


def timed(per_request, p95=None, render=5.0) -> Latency:
    """What ``CandidateScorer.latencies`` returns for requests that took ``per_request`` ms (NaN: failed)."""
    ok = [t for t in per_request if np.isfinite(t)]
    return Latency(float(np.median(ok)), p95 or float(np.percentile(ok, 95)), 0.0, render, tuple(per_request))


# 12 dev inputs of different lengths: what the seed's requests took, in ms
SEED_MS = [80.0, 95.0, 100.0, 104.0, 110.0, 121.0, 90.0, 99.0, 130.0, 87.0, 102.0, 115.0]


def evaluation(task, text, correct, *, rates=(0.95, 0.95), tokens=30, p95=100.0, readability=0.9, slower=1.0):
    """A dev evaluation whose decision is right on the examples where ``correct`` is True (half of them scams);
    its requests take ``slower`` times the seed's, with a little noise."""
    n = len(correct)
    gold = ["high_risk" if i % 2 == 0 else "low_risk" for i in range(n)]
    other = {"high_risk": "low_risk", "low_risk": "high_risk"}
    decided = [g if ok else other[g] for g, ok in zip(gold, correct)]
    pos = [d == g for d, g in zip(decided, gold) if g == "high_risk"]
    neg = [d == g for d, g in zip(decided, gold) if g == "low_risk"]
    ba = (sum(pos) / len(pos) + sum(neg) / len(neg)) / 2
    components = {"instruction_following": rates[0], "entity_consistency": rates[1], "readability": readability}
    m = Measured(template=task.compose(text), valid=True, tokens=tokens, max_tokens=160,
                 metrics={"balanced_accuracy": ba, "roc_auc": ba}, rates={},
                 outcomes={"gold": gold, "decided": decided})
    noise = np.random.default_rng(len(text)).normal(1.0, 0.02, len(SEED_MS))
    return Evaluation(m, Reward(1.0, components, True), "dev", n, None,
                      timed([t * slower * e for t, e in zip(SEED_MS, noise)]))


def right(n, k, seed=0):
    """``n`` outcomes, ``k`` of them right, spread at random."""
    rng = np.random.default_rng(seed)
    out = np.zeros(n, dtype=bool)
    out[rng.choice(n, k, replace=False)] = True
    return list(out)


def test_a_top_candidate_that_fails_dev_instruction_following_is_not_chosen(task):
    seed = evaluation(task, "Read the SMS message below.", right(200, 130))
    best = evaluation(task, "Best by far.", right(200, 190, 1), rates=(0.765, 0.95))  # fails IF 0.82 (+margin)
    good = evaluation(task, "Good and compliant.", right(200, 170, 2))
    choice = choose(task, seed, [best, good])
    assert choice.chosen == good.measured.template
    rows = {r["instruction"]: r for r in choice.rows}
    assert rows["Best by far."]["feasible"] is False and not rows["Best by far."]["chosen"]
    assert any(b.startswith("fail: instruction_following 0.765 < 0.85") for b in rows["Best by far."]["bars"])
    assert rows["Good and compliant."]["chosen"] and rows["Good and compliant."]["beats_seed"]
    assert choice.rows[0]["chosen"]  # ranked: the chosen first, the seed always in the ranking
    assert [r["name"] for r in choice.rows].count("seed") == 1


def test_a_rate_right_at_the_bar_fails_the_margin(task):
    seed = evaluation(task, "Read the SMS message below.", right(200, 130))
    edge = evaluation(task, "Right at the bar.", right(200, 190, 1), rates=(0.83, 0.95))  # >= 0.82, < 0.82 + 0.03
    choice = choose(task, seed, [edge])
    assert choice.chosen is None and choice.verdict.startswith(NO_WINNER)
    assert "instruction_following 0.83 < 0.85" in choice.verdict


def test_latency_and_readability_are_bars_on_dev_too(task):
    seed = evaluation(task, "Read the SMS message below.", right(200, 130))
    slow = evaluation(task, "Slow.", right(200, 190, 1), slower=1.30)  # over the gate's +25 %
    unreadable = evaluation(task, "Word salad.", right(200, 190, 2), readability=0.1)
    choice = choose(task, seed, [slow, unreadable])
    assert choice.chosen is None
    rows = {r["instruction"]: r for r in choice.rows}
    assert any(b.startswith("fail: latency: upper 95% bound of the median per-request ratio") and "> 1.25" in b
               for b in rows["Slow."]["bars"])
    assert rows["Slow."]["latency_ratio"] == pytest.approx(1.30, abs=0.03)
    assert any(b.startswith("fail: readability") for b in rows["Word salad."]["bars"])


def test_latency_is_bounded_from_paired_requests_against_the_gates_own_ceiling(task):
    """The seed-2 case of the default run: a candidate about 16 % slower passes the gate's +25 % on test, so the
    choice must not refuse it on dev; one whose bound reaches the ceiling is refused; one not timed beside the
    seed (no paired requests) fails the bar rather than passing unseen."""
    seed = evaluation(task, "Read the SMS message below.", right(200, 130))
    ok = evaluation(task, "A bit longer.", right(200, 175, 1), slower=1.16)
    bound = latency_bound(task, ok, seed)
    assert bound.pairs == 12 and bound.ratio == pytest.approx(1.16, abs=0.03) and bound.ratio < bound.upper < 1.25
    assert choose(task, seed, [ok]).chosen == ok.measured.template
    edge = evaluation(task, "At the ceiling.", right(200, 175, 1), slower=1.24)
    assert latency_bound(task, edge, seed).upper > 1.24  # the bound, not the estimate, meets the bar
    assert choose(task, seed, [edge]).chosen is None
    untimed = evaluation(task, "Untimed.", right(200, 175, 1))
    untimed.latency = Latency(100.0, 110.0, 0.0, 5.0)
    verdict = choose(task, seed, [untimed]).verdict
    assert verdict.startswith(NO_WINNER) and "latency: not timed beside the seed on dev" in verdict
    failed = evaluation(task, "Failed requests.", right(200, 175, 1))
    failed.latency = timed([float("nan")] * 6 + SEED_MS[6:])  # the failed pairs are left out, the rest bounded
    assert latency_bound(task, failed, seed).pairs == 6


def test_the_noisier_the_pairs_the_wider_the_bound(task):
    seed = evaluation(task, "Seed.", right(200, 130))
    steady = evaluation(task, "Steady.", right(200, 175, 1), slower=1.1)
    jumpy = evaluation(task, "Steady.", right(200, 175, 1), slower=1.1)
    spikes = np.random.default_rng(0).choice([0.85, 1.0, 1.3], size=12)
    jumpy.latency = timed([t * s for t, s in zip(jumpy.latency.samples_ms, spikes)])
    a, b = latency_bound(task, steady, seed), latency_bound(task, jumpy, seed)
    assert b.upper - b.ratio > a.upper - a.ratio


def test_when_no_candidate_beats_the_seed_on_dev_the_seed_stays(task):
    seed = evaluation(task, "Read the SMS message below.", right(200, 150))
    same = evaluation(task, "About as good.", right(200, 152, 3))  # +0.01: not significant on 200 examples
    choice = choose(task, seed, [same])
    assert choice.chosen is None
    assert choice.verdict.startswith("no candidate beat the seed on dev; production unchanged")
    row = next(r for r in choice.rows if r["name"] != "seed")
    assert row["feasible"] and not row["beats_seed"] and row["p_value"] >= 0.05
    assert choose(task, seed, []).chosen is None


def test_the_paired_bootstrap_sees_a_clear_gain_and_not_a_tie(task):
    seed = evaluation(task, "Seed.", right(200, 130))
    better = evaluation(task, "Better.", right(200, 170, 5))
    paired = paired_gain(task, better, seed)
    assert paired.gain == pytest.approx(0.2) and paired.p_value < 0.01 and paired.lower > 0.1
    assert paired_gain(task, seed, seed).p_value == 1.0  # no gain at all: never "beats"


def test_among_candidates_tied_with_the_best_the_shortest_is_chosen(task):
    seed = evaluation(task, "Seed.", right(200, 120))
    long = evaluation(task, "A long and careful instruction.", right(200, 172, 6), tokens=80)
    short = evaluation(task, "Short.", right(200, 170, 7), tokens=30)
    choice = choose(task, seed, [long, short])
    assert choice.chosen == short.measured.template
    assert "shortest" in choice.verdict
    assert [p["name"] for p in choice.as_dict()["front"]][0] in ("candidate 2", "seed")
    strict = task.with_overrides(selection={"prefer_shorter": False})
    assert choose(strict, seed, [long, short]).chosen == long.measured.template


def test_the_front_keeps_what_nothing_beats_on_both_metric_and_tokens():
    rows = [{"name": "a", "valid": True, "tokens": 10, "balanced_accuracy": 0.7},
            {"name": "b", "valid": True, "tokens": 20, "balanced_accuracy": 0.8},
            {"name": "c", "valid": True, "tokens": 30, "balanced_accuracy": 0.75}]
    assert [p["name"] for p in pareto_front(rows, "balanced_accuracy")] == ["a", "b"]


def test_the_shortlist_puts_candidates_that_met_the_bars_in_their_step_first(task):
    seed = task.seed_template().text
    board = [{"template": "x", "valid": True, "total_reward": 3.0, "instruction_following": 0.70,
              "entity_consistency": 0.9, "readability": 0.9},
             {"template": seed, "valid": True, "total_reward": 2.5, "instruction_following": 0.9,
              "entity_consistency": 0.9, "readability": 0.9},
             {"template": "y", "valid": True, "total_reward": 2.0, "instruction_following": 0.90,
              "entity_consistency": 0.9, "readability": 0.9}]
    assert meets_bars(task, board[2]) and not meets_bars(task, board[0])
    assert shortlist_of(task, board, seed, 2) == ["y", "x"]
    assert shortlist_of(task, board, seed, 1) == ["y"]


def test_a_step_row_whose_prompts_are_predicted_too_slow_does_not_meet_the_bars(task):
    row = {"template": "x", "valid": True, "total_reward": 3.0, "instruction_following": 0.90,
           "entity_consistency": 0.9, "readability": 0.9}
    assert meets_bars(task, {**row, "prompt_ratio": task.latency_ceiling() - 0.01})
    assert not meets_bars(task, {**row, "prompt_ratio": task.latency_ceiling() + 0.01})
    assert meets_bars(task, row)  # a row from before prompt_ratio existed (a resumed run): not judged on it
