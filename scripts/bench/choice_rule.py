"""Benchmark: would a seed guard on the choice have shipped better templates? Read from the bench's ledger.

Every method of `scripts/bench/tuning.py` ships its dev-only choice: the best of some 24 candidates by a noisy
dev reward, so the winner's dev figure is biased up (the winner's curse), and on sentiment every choice lands
under the seed template on the test split. The guard keeps the seed unless the choice beats it on dev with
one-sided 95% confidence: a paired bootstrap, over the examples of the selection sample (the whole-dev sample
the former `pipelines.loop.select_finalists` ranked on, before `pipelines.choice`), of the difference in the task's reward metric (ROC-AUC of the label
log-odds). It reads dev only, like the choice itself.

For each task, seed and method the ledger holds a finished search for (same fingerprint as `bench.tuning`
with the same options), this scores the seed and the choice on that dev sample with the target model in this
process (no search is run again), applies the guard, and reads the held-out test figure of what each rule ships
from the ledger's test records (no test call is made). Per (task, method): the mean over seeds and its 95%
bootstrap interval (over seeds), without and with the guard, and how often the guard kept the seed.

    .venv/bin/python -m bench.choice_rule --ledger scripts/bench/results/bench_tuning.jsonl [--tasks risk sentiment]
        [--alpha 0.05 0.2 0.5]   # the guard's level (0.05, chosen before any figure was seen); more: sensitivity
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench import tuning as bench
from pipelines.cli import quiet_libraries
from pipelines.cli_output import table


def paired_gain(seed_lp, chosen_lp, gold: list[str], labels: list[str], resamples: int = 2000,
                rng_seed: int = 0) -> tuple[float, float]:
    """(gain, p): the chosen template's ROC-AUC minus the seed's on these examples, and the share of bootstrap
    resamples of the examples (the same ones for both, paired) in which the gain is not positive."""
    from rewards.promptbench_metrics import roc_auc_ovr

    seed_lp, chosen_lp, gold_arr = np.asarray(seed_lp), np.asarray(chosen_lp), np.asarray(gold)
    gain = roc_auc_ovr(chosen_lp, gold, labels) - roc_auc_ovr(seed_lp, gold, labels)
    rng = np.random.default_rng(rng_seed)
    not_positive = 0
    for _ in range(resamples):
        idx = rng.integers(0, len(gold), len(gold))
        g = gold_arr[idx].tolist()
        diff = roc_auc_ovr(chosen_lp[idx], g, labels) - roc_auc_ovr(seed_lp[idx], g, labels)
        not_positive += not diff > 0  # a resample with one label only (nan) counts against the choice
    return float(gain), not_positive / resamples


def guarded(gain: float, p: float, alpha: float) -> bool:
    """The guard's verdict: True keeps the seed (the choice did not beat it on dev with confidence 1 - alpha)."""
    return not (gain > 0 and p < alpha)


def analyse(name: str, seeds: list[int], options, test_examples: int, ledger_path: str,
            alphas: list[float], log=print) -> list[dict]:
    from pipelines.budget import estimate, scoring_tokenizer
    from pipelines.config import ConfigError, load_task
    from pipelines.scoring import build_scorer

    base, splits, _ = bench.load_bench_splits(load_task(name), test_examples)
    if base.is_generation:
        raise ConfigError(f"{name} is a generation task; the guard compares label log-odds. "
                          "Fix: pass classification tasks with --tasks")
    plan = estimate(base, options, splits, scoring_tokenizer(options.target))
    budget = bench.default_budget(plan, options)
    ledger, searches = bench.open_ledgers(ledger_path, base, options, budget, splits, plan)
    metric = base.scoring.metric
    seed_text = base.seed_template().text
    seed_test = ledger.get(bench.test_key(base.name, seed_text))
    choices = {(s, m): searches[m].get(f"{base.name}/seed {s}/{m}") for s in seeds for m in bench.METHODS[1:]}
    choices = {k: r["template"] for k, r in choices.items() if r and ledger.get(bench.test_key(base.name, r["template"]))}
    if seed_test is None or not choices:
        log(f"{name}: no finished searches with test figures in {ledger_path} for fingerprint {ledger.fingerprint}")
        return []
    scorer = build_scorer(base, splits, options.target, options.judge, reward_examples=options.dev_examples)
    examples = scorer.selection
    gold, labels = [e.label for e in examples], list(base.labels)
    log(f"{name}: the seed and {len(set(choices.values()))} choice(s) on the {len(examples)}-example selection sample ...")
    logprobs = {text: scorer.label_logprobs(scorer.validate(text).template, examples)
                for text in dict.fromkeys([seed_text, *choices.values()])}
    per = {}
    for (s, m), text in choices.items():
        gain, p = paired_gain(logprobs[seed_text], logprobs[text], gold, labels, rng_seed=s)
        per.setdefault(m, []).append({"seed": s, "dev_gain": round(gain, 4), "p": p,
                                      "test": ledger.get(bench.test_key(base.name, text))[metric]})
    rows = []
    for alpha in alphas:
        for m, runs in per.items():
            kept = [guarded(r["dev_gain"], r["p"], alpha) for r in runs]
            mean, low, high = bench.bootstrap([r["test"] for r in runs])
            g_mean, g_low, g_high = bench.bootstrap([seed_test[metric] if k else r["test"] for r, k in zip(runs, kept)])
            rows.append({"task": base.name, "method": m, "alpha": alpha, "seeds": len(runs),
                         f"seed_{metric}": round(seed_test[metric], 3), metric: round(mean, 3),
                         f"{metric}_95": f"[{low:.3f}, {high:.3f}]", f"guarded_{metric}": round(g_mean, 3),
                         f"guarded_{metric}_95": f"[{g_low:.3f}, {g_high:.3f}]",
                         "kept_seed": f"{sum(kept)}/{len(runs)}", "per_seed": runs})
    return rows


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ledger", required=True, help="the ledger bench.tuning wrote (--ledger there)")
    bench.add_run_options(parser, help_suffix="; as bench.tuning was run (its fingerprint)")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.05],
                        help="the guard's one-sided level; several give one row each (default 0.05)")
    parser.add_argument("--out", help="also write the rows, with every seed's dev gain and p, as JSON here")
    args = parser.parse_args()
    if not Path(args.ledger).is_file():
        print(f"error: no ledger at {args.ledger}. Fix: pass the file bench.tuning --ledger wrote", file=sys.stderr)
        return 2
    bad = [a for a in args.alpha if not 0 < a < 1]
    if bad:
        print(f"error: --alpha {bad[0]} is not a level. Fix: pass a number between 0 and 1, e.g. 0.05",
              file=sys.stderr)
        return 2

    from pipelines.config import ConfigError, RunOptions

    options = RunOptions(steps=args.steps, wandb_mode="disabled", progress=False, dev_examples=args.dev_examples)
    rows = []
    try:
        for name in args.tasks:
            rows += analyse(name, args.seeds, options, args.test_examples, args.ledger, args.alpha,
                            log=lambda *a: print(*a, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print("error: nothing to compare. Fix: run bench.tuning with --ledger and the same options first",
              file=sys.stderr)
        return 2
    print("held-out test figure of what ships, without and with the seed guard at each alpha; "
          "mean and 95% bootstrap interval over seeds")
    print(table(rows, [k for k in rows[0] if k != "per_seed"]))
    for r in rows:
        if r["alpha"] == args.alpha[0]:
            for s in r["per_seed"]:
                print(f"  {r['task']:<10} {r['method']:<12} seed {s['seed']}: dev gain {s['dev_gain']:+.3f} "
                      f"(p {s['p']:.3f}), test {s['test']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
