#!/usr/bin/env python
"""Benchmark: what would each method ship if the seed template stayed in the choice's ranking? From the ledger.

The former choice step (`pipelines.loop.select_finalists`, replaced by `pipelines.choice`, and the bench's `search`) measures the best candidates again on
the whole dev selection sample and takes the best by total reward, but never ranks the seed template with them: when
no candidate of a search beats the seed, it still ships the best candidate, one its own reward ranks under the seed
(PPO's snippets choices, whose answers leave the format). With the seed in that ranking, the choice would be the seed
whenever its whole-dev reward is at least the best candidate's. Scoring is greedy and deterministic, so that rule
can be applied after the fact: this measures the seed and every method's choice in the ledger on the same selection
sample with the same reward (one `Scorer.measure(..., whole_dev=True)` each, no search runs again) and appends a
``dev`` record per template to the ledger, under the bench's fingerprint. `scripts/bench/paired.py --seed-ranked`
then compares what each method would ship under the rule, seed by seed, from the ledger's test records.

    .venv/bin/python -m bench.seed_in_ranking --ledger scripts/bench/results/bench_tuning_bf16.jsonl \\
        --tasks risk sentiment snippets callback
    .venv/bin/python -m bench.paired --ledger scripts/bench/results/bench_tuning_bf16.jsonl --seed-ranked \\
        --a PPO@9d25,264f,7d00,3b0d --b best-of-N@9d25,264f,7d00,3b0d

Options as `bench.tuning` was run (they make its fingerprint); a template already measured is read back.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import tuning as bench
from pipelines.cli import quiet_libraries
from pipelines.cli_output import table


def dev_key(task_name: str, text: str) -> str:
    """The ledger key of one template's whole-dev reward (shared by every method that chose it)."""
    return bench.test_key(task_name, text).replace("/test/", "/dev/", 1)


def ships(choice_reward: float | None, seed_reward: float | None) -> bool:
    """True when the choice would still ship with the seed in the ranking: its whole-dev reward beats the seed's
    (a tie keeps the seed, as a stable sort with the seed listed first would). Unmeasured: no verdict, so False."""
    return choice_reward is not None and seed_reward is not None and choice_reward > seed_reward


def choices_in(ledger, searches, task_name: str, seeds: list[int]) -> dict[tuple[int, str], str]:
    """(seed, method) -> the template each finished search chose, where its test record exists too: ``searches``
    holds each method's ledger of searches, ``ledger`` the scorer's, with the tests (``bench.tuning.open_ledgers``)."""
    found = {}
    for seed in seeds:
        for method in bench.METHODS[1:]:
            record = searches[method].get(f"{task_name}/seed {seed}/{method}")
            if record and record.get("template") and ledger.get(bench.test_key(task_name, record["template"])):
                found[seed, method] = record["template"]
    return found


def measure_task(name: str, seeds: list[int], options, test_examples: int, ledger_path: str, log=print) -> list[dict]:
    from pipelines.budget import estimate, scoring_tokenizer
    from pipelines.config import load_task
    from pipelines.scoring import build_scorer

    base, splits, _ = bench.load_bench_splits(load_task(name), test_examples)
    plan = estimate(base, options, splits, scoring_tokenizer(options.target))
    ledger, searches = bench.open_ledgers(ledger_path, base, options, bench.default_budget(plan, options), splits,
                                        plan)
    seed_text = base.seed_template().text
    found = choices_in(ledger, searches, base.name, seeds)
    if not found or ledger.get(bench.test_key(base.name, seed_text)) is None:
        log(f"{name}: no finished searches with test figures in {ledger_path} for fingerprint {ledger.fingerprint}")
        return []
    todo = [t for t in dict.fromkeys([seed_text, *found.values()]) if ledger.get(dev_key(base.name, t)) is None]
    if todo:
        scorer = build_scorer(base, splits, options.target, options.judge, reward_examples=options.dev_examples)
        log(f"{name}: {len(todo)} template(s) on the {len(scorer.selection)}-example selection sample "
            f"(fingerprint {ledger.fingerprint[:8]}) ...")
        for i, text in enumerate(todo, 1):
            started = time.perf_counter()
            (scored,) = scorer.measure([text], whole_dev=True)
            ledger.add(dev_key(base.name, text), kind="dev", total_reward=scored.reward.total,
                       valid=scored.measured.valid, examples=len(scorer.selection),
                       components=dict(scored.reward.components), wall_s=time.perf_counter() - started)
            log(f"  {i}/{len(todo)}: reward {scored.reward.total:+.3f} ({time.perf_counter() - started:.0f} s)")
    metric = base.scoring.metric
    seed_reward = ledger.get(dev_key(base.name, seed_text))["total_reward"]
    seed_test = ledger.get(bench.test_key(base.name, seed_text))[metric]
    rows = []
    for method in bench.METHODS[1:]:
        runs = [(s, found[s, m]) for (s, m) in sorted(found) if m == method]
        if not runs:
            continue
        rewards = [ledger.get(dev_key(base.name, t))["total_reward"] for _, t in runs]
        shipped = [ships(r, seed_reward) for r in rewards]
        tests = [ledger.get(bench.test_key(base.name, t))[metric] for _, t in runs]
        rows.append({"task": base.name, "method": method, "seeds": len(runs),
                     "seed's dev reward": round(seed_reward, 3),
                     "choices' dev reward": ", ".join(f"{r:+.3f}" for r in rewards),
                     "choice ships": f"{sum(shipped)}/{len(runs)}", "held-out metric": metric,
                     "choice": round(sum(tests) / len(tests), 3),
                     "seed ranked": round(sum(t if s else seed_test for t, s in zip(tests, shipped))
                                                     / len(tests), 3)})
    return rows


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ledger", required=True, help="the ledger bench.tuning wrote (--ledger there); the "
                                                        "dev records are appended to it")
    bench.add_run_options(parser, help_suffix="; as bench.tuning was run (its fingerprint)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args()
    if not Path(args.ledger).is_file():
        print(f"error: no ledger at {args.ledger}. Fix: pass the file bench.tuning --ledger wrote", file=sys.stderr)
        return 2

    from pipelines.config import ConfigError, RunOptions

    options = RunOptions(steps=args.steps, wandb_mode="disabled", progress=False, dev_examples=args.dev_examples)
    rows = []
    try:
        for name in args.tasks:
            rows += measure_task(name, args.seeds, options, args.test_examples, args.ledger,
                                 log=lambda *a: print(*a, file=sys.stderr, flush=True))
    except ConfigError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print("error: nothing to measure. Fix: run bench.tuning with --ledger and the same options first",
              file=sys.stderr)
        return 2
    print("whole-dev reward of the seed and of each choice (seeds in order); the held-out figure of the choice, and "
          "of what would ship with the seed in the ranking (means over seeds)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
