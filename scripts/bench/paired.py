#!/usr/bin/env python
"""Two methods of scripts/bench/tuning.py compared seed by seed, from its ledger (nothing runs again).

Each bench seed is one unit: both methods searched with it, at the same budget, and were tested on the same
held-out split. So the difference on that seed is one paired observation, and the mean difference over seeds,
with a 95% bootstrap interval that resamples seeds, is what the comparison can claim. Several runs (a ledger
fingerprint each: other code, another dtype, a task variant such as ``--set ppo.advantage_estimator=rloo``)
add their seeds as further units.

An arm is ``METHOD@FP[,FP...]``: the method's choices under those fingerprints (a unique prefix of each is
enough). The i-th fingerprint of --a is paired with the i-th of --b, seed by seed, within each task:

    # PPO against best-of-N, in two runs of risk and sentiment (4 fingerprints)
    .venv/bin/python -m bench.paired --ledger scripts/bench/results/bench_tuning.jsonl scripts/bench/results/bench_tuning_bf16.jsonl \
        --a PPO@b933,8871,9d25,264f --b best-of-N@b933,8871,9d25,264f
    # RLOO against GAE: the variant's fingerprint against the plain task's
    .venv/bin/python -m bench.paired --a PPO@34090fb4 --b PPO@b933b43b   # the float32 ledger, the default

Per task: the pairs, each arm's mean, the mean difference A - B and its interval; then the mean over tasks of
the per-task mean differences, with an interval that resamples seeds within each task.

``--gate`` compares what production would receive after the promotion gate instead of the choice itself: each
task's bars, read from its task file, that a test record can be held to (instruction following and readability
at their thresholds, and the minimum gain over the seed template on the task's metric). A choice that misses one
is not promoted, so the seed template of the same run stays and its figure counts for that seed. The ledger holds
no entity-consistency rate or latency, so this is the most the gate could pass.

``--seed-ranked`` compares what each method would ship with the seed template in its choice's ranking: a choice whose
whole-dev reward does not beat the seed template's counts as the seed template. The rewards are the ledger's ``dev``
records, written by ``scripts/bench/seed_in_ranking.py``. With ``--gate`` too, the ranking comes first.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench import REPO
from bench import seed_in_ranking as bench_seed_in_ranking
from bench import tuning as bench
from pipelines.cli_output import table
from pipelines.task_files import builtin_tasks, load_task

METRICS = ("task", "balanced_accuracy", "roc_auc")
# what a test record holds besides the task's own metric (bench_tuning.test_figures and the ledger's bookkeeping)
NOT_THE_TASK_METRIC = {"fingerprint", "scorer", "key", "kind", "wall_s", "roc_auc", "instruction_following", "readability",
                       "instruction"}


def figure(test: dict, metric: str) -> tuple[str, float | None]:
    """(the metric's name, its value) in one test record; ``task`` is the task's own metric under its production
    decision (balanced accuracy for a classification task, e.g. field exact match for a generation one)."""
    if metric == "task":
        names = [k for k in test if k not in NOT_THE_TASK_METRIC]
        if len(names) != 1:
            return "task", None  # not a record bench_tuning wrote: left out, never guessed
        metric = names[0]
    return metric, test.get(metric)


class InputError(ValueError):
    """Bad input, said in one line that names the problem and the fix."""


def read_ledgers(paths: list[str]) -> dict[str, dict[str, dict]]:
    """fingerprint -> key -> record, over every ledger given (a later record of a key wins, as in bench.tuning); a
    method's fingerprint also holds the records of the scorer's it names (``bench.ledger``)."""
    records: dict[str, dict[str, dict]] = {}
    scorers: dict[str, str] = {}  # a method's fingerprint -> the scorer's its searches were made under
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            raise InputError(f"cannot read ledger {path}: {error.strerror}; pass a file written by "
                             "bench.tuning --ledger") from None
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run: bench_tuning skips it too
            if isinstance(record, dict) and {"fingerprint", "key"} <= record.keys():
                records.setdefault(record["fingerprint"], {})[record["key"]] = record
                if record.get("scorer"):
                    scorers[record["fingerprint"]] = record["scorer"]
                    if record["key"].endswith("/seed") and record.get("kind") == "search":
                        # the seed runs no code of its own (bench.ledger.METHOD_CODE): every method's searches
                        # under the same scorer fall back on it (the gate)
                        records.setdefault(record["scorer"], {})[record["key"]] = record
    for fingerprint, scorer in scorers.items():  # a method's searches see the scorer's records (seed, tests, dev)
        records[fingerprint] = {**records.get(scorer, {}), **records[fingerprint]}
    return records


def parse_arm(text: str, fingerprints: list[str]) -> tuple[str, list[str]]:
    """``METHOD@FP[,FP...]`` -> (method, full fingerprints), each prefix matching exactly one in the ledgers."""
    method, at, prints = text.rpartition("@")
    if not at or not method or not prints:
        raise InputError(f"arm {text!r} is not METHOD@FINGERPRINT[,FINGERPRINT...]; e.g. PPO@b933b43b")
    full = []
    for prefix in prints.split(","):
        matches = [f for f in fingerprints if f.startswith(prefix.strip())] if prefix.strip() else []
        if len(matches) != 1:
            known = ", ".join(sorted(f[:8] for f in fingerprints)) or "none"
            raise InputError(f"fingerprint {prefix!r} of arm {text!r} matches {len(matches)} in the ledgers "
                             f"(they hold: {known}); give a unique prefix")
        full.append(matches[0])
    return method, full


def choices(records: dict[str, dict], method: str) -> dict[tuple[str, int], dict]:
    """(task, seed) -> the test record of the method's choice, for every finished search and test."""
    found = {}
    for key, record in records.items():
        parts = key.split("/")
        if record.get("kind") != "search" or len(parts) != 3 or parts[2] != method or not parts[1].startswith("seed "):
            continue
        test = records.get(bench.test_key(parts[0], record["template"]))
        if test is not None:
            found[(parts[0], int(parts[1].removeprefix("seed ")))] = test
    return found


def seed_ranked(records: dict[str, dict], found: dict[tuple[str, int], dict],
                seeds: dict[tuple[str, int], dict]) -> dict[tuple[str, int], dict]:
    """Each choice, or the seed template's test record where the choice's whole-dev reward does not beat the seed
    template's (the choice step, with the seed in its ranking, would keep the seed)."""
    kept = {}
    for cell, test in found.items():
        if cell not in seeds:
            continue
        rewards = [records.get(dev_key_of(record)) for record in (test, seeds[cell])]
        if any(r is None for r in rewards):
            raise InputError(f"no whole-dev reward in the ledger for the {cell[0]} seed-{cell[1]} choice or the seed "
                             "template; run scripts/bench/seed_in_ranking.py --ledger on this ledger first")
        kept[cell] = test if bench_seed_in_ranking.ships(rewards[0]["total_reward"], rewards[1]["total_reward"]) \
            else seeds[cell]
    return kept


def dev_key_of(test: dict) -> str:
    """The key of the ``dev`` record of the template a test record measured (same hash, ``dev`` for ``test``)."""
    task, _, digest = test["key"].split("/")
    return f"{task}/dev/{digest}"


GATE_RATES = ("instruction_following", "readability")  # the gate's thresholds a test record holds


def gate_bars(task: str) -> dict[str, float]:
    """The promotion bars of a built-in task's file that a test record can be held to: its thresholds on
    ``GATE_RATES`` and, as ``min_improvement``, the gain over the seed template its metric needs."""
    if task not in builtin_tasks():
        raise InputError(f"--gate reads the promotion bars of task {task!r} from its task file, and it is not a "
                         f"built-in ({', '.join(builtin_tasks())}); compare without --gate")
    promotion = load_task(task).promotion
    bars = {name: promotion.thresholds[name] for name in GATE_RATES if name in promotion.thresholds}
    return {**bars, "min_improvement": promotion.min_improvement}


def passes_gate(test: dict, seed: dict, bars: dict[str, float]) -> bool:
    """Whether the gate would promote the choice measured in ``test`` over the seed template measured in ``seed``,
    on what the ledger holds (a missing figure fails, as in ``templates.gate.decide``)."""
    if test["key"] == seed["key"]:  # the choice is the seed template
        return True
    rates = [(test.get(name), bar) for name, bar in bars.items() if name in GATE_RATES]
    (_, value), (_, incumbent) = figure(test, "task"), figure(seed, "task")
    gain = None if value is None or incumbent is None else value - incumbent
    return all(v is not None and v >= bar for v, bar in [*rates, (gain, bars["min_improvement"])])


def gated(found: dict[tuple[str, int], dict], seeds: dict[tuple[str, int], dict],
          gate: bool) -> dict[tuple[str, int], dict]:
    """Each choice, or the seed template's test record where the gate would not promote the choice
    (``passes_gate``); a choice with no seed record to fall back on is left out."""
    if not gate:
        return found
    bars = {task: gate_bars(task) for task in {task for task, _ in found}}
    return {cell: test if passes_gate(test, seeds[cell], bars[cell[0]]) else seeds[cell]
            for cell, test in found.items() if cell in seeds}


def paired(records: dict[str, dict[str, dict]], arm_a: tuple[str, list[str]], arm_b: tuple[str, list[str]],
           metric: str, gate: bool = False, seed_rank: bool = False) -> dict[str, list[dict]]:
    """task -> the paired units: one per (fingerprint pair, seed) where both arms finished."""
    (method_a, prints_a), (method_b, prints_b) = arm_a, arm_b
    if len(prints_a) != len(prints_b):
        raise InputError(f"--a has {len(prints_a)} fingerprint(s) and --b {len(prints_b)}; the i-th of each is "
                         "paired, so give as many to both")
    units: dict[str, list[dict]] = {}
    for fa, fb in zip(prints_a, prints_b):
        arms = []
        for fp, method in ((fa, method_a), (fb, method_b)):
            found, seeds = choices(records[fp], method), choices(records[fp], "seed")
            if seed_rank:
                found = seed_ranked(records[fp], found, seeds)
            arms.append(gated(found, seeds, gate))
        a, b = arms
        for task, seed in sorted(a.keys() & b.keys()):
            (name, value_a), (_, value_b) = figure(a[task, seed], metric), figure(b[task, seed], metric)
            if value_a is None or value_b is None:
                continue  # e.g. ROC-AUC on a generation task: nothing to compare
            units.setdefault(task, []).append({"run": fa[:8] if fa == fb else f"{fa[:8]}/{fb[:8]}", "seed": seed,
                                               "metric": name, "a": value_a, "b": value_b})
    return units


def mean_over_tasks(units: dict[str, list[dict]], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The mean over tasks of each task's mean difference, and a 95% interval resampling seeds within each task."""
    diffs = [[u["a"] - u["b"] for u in task_units] for task_units in units.values()]
    mean = sum(sum(d) / len(d) for d in diffs) / len(diffs)
    rng = random.Random(seed)
    draws = sorted(sum(sum(rng.choices(d, k=len(d))) / len(d) for d in diffs) / len(diffs) for _ in range(resamples))
    return mean, draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def summary(units: dict[str, list[dict]], label_a: str, label_b: str) -> list[dict]:
    rows = []
    for task, task_units in units.items():
        diff = bench.bootstrap([u["a"] - u["b"] for u in task_units])
        rows.append({"task": task, "metric": task_units[0]["metric"], "pairs": len(task_units),
                     label_a: round(sum(u["a"] for u in task_units) / len(task_units), 3),
                     label_b: round(sum(u["b"] for u in task_units) / len(task_units), 3),
                     "A - B": round(diff[0], 3), "A - B 95%": f"[{diff[1]:.3f}, {diff[2]:.3f}]",
                     "per pair (run/seed: A - B)": ", ".join(f"{u['run']}/{u['seed']}: {u['a'] - u['b']:+.3f}"
                                                             for u in task_units)})
    if len(units) > 1:
        mean, low, high = mean_over_tasks(units)
        rows.append({"task": "mean over tasks", "metric": "", "pairs": sum(len(u) for u in units.values()),
                     label_a: "", label_b: "",
                     "A - B": round(mean, 3), "A - B 95%": f"[{low:.3f}, {high:.3f}]",
                     "per pair (run/seed: A - B)": ""})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="METHOD@FP[,FP...]: the first arm, e.g. PPO@b933b43b")
    parser.add_argument("--b", required=True, help="METHOD@FP[,FP...]: the second arm, paired fingerprint by fingerprint")
    parser.add_argument("--ledger", nargs="+", default=[str(REPO / "scripts/bench/results/bench_tuning.jsonl")],
                        help="ledger file(s) written by bench.tuning --ledger (default: the committed one)")
    parser.add_argument("--metric", choices=METRICS, default="task",
                        help="the held-out figure compared (default: task, each task's own metric under its decision: "
                             "balanced accuracy for a classification task, field exact match for callback); a "
                             "task without the figure (roc_auc on generation) is left out")
    parser.add_argument("--gate", action="store_true",
                        help="compare what the gate lets through: a choice under one of its task's promotion bars "
                             "the ledger holds (instruction following, readability, the gain over the seed) counts "
                             "as the seed template")
    parser.add_argument("--seed-ranked", action="store_true",
                        help="compare what would ship with the seed template in the choice's ranking: a choice whose "
                             "whole-dev reward does not beat the seed's counts as the seed (needs the ledger's dev "
                             "records: run scripts/bench/seed_in_ranking.py first)")
    parser.add_argument("--out", help="write the pairs and the summary as JSON here")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    try:
        records = read_ledgers(args.ledger)
        arm_a, arm_b = parse_arm(args.a, list(records)), parse_arm(args.b, list(records))
        units = paired(records, arm_a, arm_b, args.metric, args.gate, args.seed_ranked)
        if not units:
            raise InputError(f"no seed on which both {args.a} and {args.b} finished a search and its test with a "
                             f"{args.metric} figure; check the method names (e.g. best-of-N, PPO), fingerprints "
                             "and --metric")
    except InputError as error:
        if args.debug:
            raise
        print(f"bench_paired: {error}", file=sys.stderr)
        return 2
    rows = summary(units, f"A: {args.a}", f"B: {args.b}")
    what = "each task's own metric" if args.metric == "task" else args.metric
    gate = ", after the gate's bars the ledger holds (a choice under one: the seed)" if args.gate else ""
    if args.seed_ranked:
        gate = ", with the seed template in the choice's ranking (a choice not beating its dev reward: the seed)" + gate
    print(f"{what} on each task's held-out split{gate}, A - B paired by seed; 95% bootstrap intervals resample seeds")
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"metric": args.metric, "gate": args.gate, "a": args.a, "b": args.b,
                                              "units": units,
                                              "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
