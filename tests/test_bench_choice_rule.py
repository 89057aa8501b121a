"""scripts/bench/choice_rule.py: the seed guard's paired test on dev, from pure code (no model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
from bench import choice_rule as rule

LABELS = ["low", "high"]


def _logprobs(odds) -> np.ndarray:
    """Two-label log-probs with the given log-odds of "high" over "low"."""
    odds = np.asarray(odds, dtype=float)
    return np.stack([-np.logaddexp(0, odds), -np.logaddexp(0, -odds)], axis=1)


def test_a_choice_that_separates_the_labels_beats_a_blind_seed_and_ships():
    rng = np.random.default_rng(0)
    gold = ["high" if i % 2 else "low" for i in range(80)]
    seed = _logprobs(rng.normal(size=80))
    chosen = _logprobs([2.0 if g == "high" else -2.0 for g in gold] + rng.normal(scale=0.5, size=80))
    gain, p = rule.paired_gain(seed, chosen, gold, LABELS, resamples=300)
    assert gain > 0.3 and p < 0.01
    assert not rule.guarded(gain, p, alpha=0.05)


def test_the_same_template_or_a_small_noisy_gain_keeps_the_seed():
    rng = np.random.default_rng(1)
    gold = ["high" if i % 2 else "low" for i in range(60)]
    signal = np.array([0.5 if g == "high" else -0.5 for g in gold])
    seed = _logprobs(signal + rng.normal(size=60))
    gain, p = rule.paired_gain(seed, seed, gold, LABELS, resamples=200)
    assert gain == 0 and p == 1.0 and rule.guarded(gain, p, alpha=0.05)
    noisy = _logprobs(signal + rng.normal(size=60))  # as good in expectation: any gain is luck
    gain, p = rule.paired_gain(seed, noisy, gold, LABELS, resamples=300)
    assert p > 0.05 and rule.guarded(gain, p, alpha=0.05)
    assert rule.guarded(-0.1, 0.0, alpha=0.05)  # a loss never ships, whatever the resamples say
