"""Benchmark: how well rewards/readability.py tells hand-written instructions from degraded ones.

Reads the calibration fixture (tests/data/readability_fixture.yaml), scores every item with the embedded model
(in chunks of 16 per task, as the tuning loop asks), and prints:

* ROC-AUC (hand-written positive, all degraded negative) of each feature alone and of the combined measure, on the
  whole fixture, on the fitting half (even-indexed items) and on the held-out half (odd-indexed), with 95%
  bootstrap intervals; per degraded kind;
* the hand-written items' score quantiles, how many items of each kind pass ``READABILITY_FLOOR``, and the
  four built-in seed instructions' scores;
* the time to score 16 instructions (median of 5) and the dtype and CPU it ran on.

    .venv/bin/python -m bench.readability          # report the module's frozen coefficients
    .venv/bin/python -m bench.readability --fit    # also refit on the even half and print the constants
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

from bench import REPO
from rewards import readability as R
from rewards.promptbench_metrics import roc_auc

FIXTURE = REPO / "tests" / "data" / "readability_fixture.yaml"
TASKS = ("risk", "sentiment", "snippets", "callback")
CHUNK = 16
L2 = 1.0  # on standardized features


def task_file(task: str) -> dict:
    return yaml.safe_load((REPO / "pipelines" / "tasks" / f"{task}.yaml").read_text())


def fixture_features(scorer: R.ReadabilityScorer, items: list[dict]) -> np.ndarray:
    """One row of ``R.FEATURES`` per fixture item, in fixture order."""
    rows: list[dict | None] = [None] * len(items)
    for task in TASKS:
        description = task_file(task)["description"]
        idx = [i for i, it in enumerate(items) if it["task"] == task]
        for start in range(0, len(idx), CHUNK):
            part = idx[start : start + CHUNK]
            for i, f in zip(part, scorer.features([items[i]["text"] for i in part], description)):
                rows[i] = f
    return np.array([[row[name] for name in R.FEATURES] for row in rows])


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = L2, steps: int = 50) -> tuple[np.ndarray, float]:
    """L2-regularised logistic regression on standardized features by Newton steps; coefficients in raw units."""
    mu, sd = x.mean(0), x.std(0) + 1e-12
    z = np.hstack([(x - mu) / sd, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    penalty = np.diag([l2] * (z.shape[1] - 1) + [0.0])  # the intercept is not penalised
    for _ in range(steps):
        p = 1 / (1 + np.exp(-z @ w))
        grad = z.T @ (p - y) + penalty @ w
        hess = (z * (p * (1 - p))[:, None]).T @ z + penalty
        w -= np.linalg.solve(hess, grad)
    coef = w[:-1] / sd
    return coef, float(w[-1] - coef @ mu)


def interval(scores: np.ndarray, positive: np.ndarray, resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the ROC-AUC, resampling positives and negatives separately."""
    rng = np.random.default_rng(0)
    pos, neg = scores[positive], scores[~positive]
    aucs = []
    for _ in range(resamples):
        p, n = rng.choice(pos, len(pos)), rng.choice(neg, len(neg))
        aucs.append(roc_auc(np.concatenate([p, n]), [True] * len(p) + [False] * len(n)))
    return float(np.percentile(aucs, 2.5)), float(np.percentile(aucs, 97.5))


def auc_line(scores: np.ndarray, positive: np.ndarray, halves: dict[str, np.ndarray]) -> str:
    parts = []
    for name, mask in halves.items():
        a = roc_auc(scores[mask], positive[mask])
        lo, hi = interval(scores[mask], positive[mask])
        parts.append(f"{name} {a:.3f} [{lo:.3f}, {hi:.3f}]")
    return "  ".join(parts)


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    isa = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    import torch

    return f"{model}, {torch.get_num_threads()} threads, {isa}"


def matmul_gflops() -> float:
    """This machine's bf16 matrix-product rate, for comparing timings across machines."""
    import torch

    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ a
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    return 2 * 2048**3 * 10 / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the coefficients on the even half and print them")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the model's dtype (default: what load_causal_lm picks for this machine)")
    args = parser.parse_args(argv)

    from pipelines.engine.models import load_causal_lm

    lm = load_causal_lm(dtype=args.dtype)
    scorer = R.ReadabilityScorer(lm)
    items = yaml.safe_load(FIXTURE.read_text())["items"]
    positive = np.array([it["kind"] == "handwritten" for it in items])
    kinds = np.array([it["kind"] for it in items])
    fit_half = np.arange(len(items)) % 2 == 0
    halves = {"all": np.ones(len(items), bool), "fit half": fit_half, "held-out half": ~fit_half}
    x = fixture_features(scorer, items)
    print(f"model {lm.name} in {lm.model.dtype}, {cpu_name()}")
    print(f"fixture: {positive.sum()} hand-written, {(~positive).sum()} degraded "
          f"({', '.join(f'{k} {(kinds == k).sum()}' for k in ('past_winner', 'word_salad', 'shuffled', 'markup'))})")

    if args.fit:
        coef, intercept = fit_logistic(x[fit_half], positive[fit_half].astype(float))
        print("\nfitted on the even half (paste into rewards/readability.py):")
        print("COEFFICIENTS = {" + ", ".join(f'"{n}": {c:.3f}' for n, c in zip(R.FEATURES, coef)) + "}")
        print(f"INTERCEPT = {intercept:.3f}")
        R.COEFFICIENTS = {n: round(float(c), 3) for n, c in zip(R.FEATURES, coef)}
        R.INTERCEPT = round(intercept, 3)

    print("\nROC-AUC, hand-written vs all degraded [95% bootstrap interval]; each feature alone (signed as it enters):")
    for j, name in enumerate(R.FEATURES):
        sign = 1.0 if R.COEFFICIENTS[name] >= 0 else -1.0
        print(f"  {name:10s} {'+' if sign > 0 else '-'}  {auc_line(sign * x[:, j], positive, halves)}")
    score = np.array([R.combine(dict(zip(R.FEATURES, row))) for row in x])
    print(f"  {'combined':13s} {auc_line(score, positive, halves)}")
    held = ~fit_half
    for kind in ("past_winner", "word_salad", "shuffled", "markup"):
        mask = positive | (kinds == kind)
        print(f"  combined vs {kind:12s} all {roc_auc(score[mask], positive[mask]):.3f}"
              f"  held-out half {roc_auc(score[mask & held], positive[mask & held]):.3f}")

    hand = np.sort(score[positive])
    print("\nhand-written scores: min %.3f, 5%% %.3f, 10%% %.3f, median %.3f" %
          (hand[0], np.percentile(hand, 5), np.percentile(hand, 10), np.median(hand)))
    print("candidate floors: hand-written / past winners / other degraded at or above it")
    for floor in np.arange(0.30, 0.651, 0.05):
        print(f"  {floor:.2f}: {(score[positive] >= floor).sum()} of {positive.sum()} / "
              f"{(score[kinds == 'past_winner'] >= floor).sum()} of {(kinds == 'past_winner').sum()} / "
              f"{(score[~positive & (kinds != 'past_winner')] >= floor).sum()}")
    print(f"READABILITY_FLOOR {R.READABILITY_FLOOR}: items at or above it")
    for kind in ("handwritten", "past_winner", "word_salad", "shuffled", "markup"):
        mask = kinds == kind
        print(f"  {kind:12s} {(score[mask] >= R.READABILITY_FLOOR).sum():3d} of {mask.sum()}")
    print("\nhighest-scoring degraded items:")
    for i in np.argsort(-np.where(positive, -1, score))[:8]:
        print(f"  {score[i]:.3f} {kinds[i]:11s} {items[i]['text'][:90]!r}")
    print("lowest-scoring hand-written items:")
    for i in np.argsort(np.where(positive, score, 2))[:5]:
        print(f"  {score[i]:.3f} {items[i]['text'][:90]!r}")

    print("\nseed instructions:")
    for task in TASKS:
        spec = task_file(task)
        (s,) = scorer.score([spec["template"]["seed_instruction"]], spec["description"])
        print(f"  {task:10s} {s:.3f} {spec['template']['seed_instruction']!r}"
              f" ({'passes' if s >= R.READABILITY_FLOOR else 'FAILS'} the floor)")

    # Time, 16 risk items of each mix: on a fresh scorer (it runs its two prefixes first), on a scorer that has
    # read other instructions of the task before (the loop's case), and the same 16 again (its memo answers).
    description = task_file("risk")["description"]
    risk = [it["text"] for it in items if it["task"] == "risk"]
    mixes = {"hand-written": risk[:CHUNK],
             "longest past winners": sorted((it["text"] for it in items if it["task"] == "risk"
                                             and it["kind"] == "past_winner"), key=len)[-CHUNK:]}
    print(f"\ntime to score 16 instructions ({lm.model.dtype}, {cpu_name()}; bf16 2048x2048 matmul "
          f"{matmul_gflops():.0f} GFLOP/s here), median of 5 after a warm-up:")
    for name, texts in mixes.items():
        fresh, warm = [], []
        for _ in range(6):
            scorer = R.ReadabilityScorer(lm)
            t0 = time.perf_counter()
            scorer.score(texts, description)
            fresh.append(time.perf_counter() - t0)
            scorer = R.ReadabilityScorer(lm)
            scorer.score(["Read the message."], description)
            t0 = time.perf_counter()
            scorer.score(texts, description)
            warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        scorer.score(texts, description)
        again_ms = (time.perf_counter() - t0) * 1000
        n_tokens = [min(R.MAX_TOKENS, len(lm.tokenizer(" " + t, add_special_tokens=False).input_ids)) for t in texts]
        print(f"  {name} ({sum(n_tokens)} tokens read, longest {max(n_tokens)}): fresh scorer "
              f"{statistics.median(fresh[1:]) * 1000:.0f} ms, warm scorer {statistics.median(warm[1:]) * 1000:.0f} ms, "
              f"the same 16 again {again_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
