"""Benchmark: tuning methods at an equal budget of target calls, on the held-out test split, over seeds.

For each task and seed, every method gets the same budget of calls to the target model for its search and
its choice (the final test is not part of it, and is the same for all), and the template it chooses is
evaluated on the task's test split, which no method reads, under the task's production decision:
  * seed       the task's hand-written template (no calls);
  * best-of-N  rounds of `candidates_per_step` instructions from the untrained policy with the seed meta-prompt,
               as many rounds as the budget pays for;
  * OPRO       the same rounds, but each meta-prompt shows the best instructions so far with their rewards
               (`pipelines.generation.history_meta_prompt`), the untrained policy writing;
  * PPO        `pipelines.loop.tune` with the budget (`--max-target-calls`): as many steps as it pays for;
  * DSPy COPRO, DSPy MIPROv2: the dspy library's optimizers as shipped, instruction only and zero demos, through
               `pipelines.dspy_peer` (an adapter to the in-process target model, prompted and parsed as here; the
               proposer is the same untrained policy model); their own choice, by their own search on train (and
               for MIPROv2 dev) examples. Without the optional extra (`pip install -e .[bench]`) their rows say
               "not run", so the table keeps its shape.
The project's methods score candidates through the same racing pool (`pipelines.racing`) and choose among them
the same way (`pipelines.loop.select_finalists`: the best by step reward re-measured on the whole dev split).

Per cell: the mean over seeds, a 95% bootstrap interval of that mean (resampling seeds; with one seed it is the
value itself), the calls each method spent (the largest over seeds) and its wall time. The script exits 2 when
a method spent more than its budget, or a row is missing.

    .venv/bin/python scripts/bench_tuning.py [--tasks risk sentiment] [--seeds 0 1 2] [--budget CALLS]
    .venv/bin/python scripts/bench_tuning.py --quick      # CI: the small test task, one seed, a tiny budget

The default budget is what the task's default run spends before its test (the seed, its steps, the selection),
as `--estimate` prices it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.cli import quiet_libraries, table  # noqa: E402

METHODS = ("seed", "best-of-N", "OPRO", "PPO", "DSPy COPRO", "DSPy MIPROv2")
QUICK_TASK = str(Path(__file__).resolve().parents[1] / "tests" / "data" / "risk_small.yaml")


@dataclass
class Outcome:
    template: str | None  # None: the method did not run
    calls: int  # target calls of the search and the choice
    wall_s: float
    note: str = ""


def search(task, pool, policy, prompt_for, budget: int, plan, seed: int, spent: int = 0,
           history: list | None = None) -> Outcome:
    """Rounds of candidates until the next round and the choice would overrun ``budget``; then the choice.
    ``prompt_for(history)`` is the meta-prompt of a round; history: (template, reward) of finished candidates."""
    from pipelines.generation import candidate_text
    from pipelines.loop import select_finalists
    from pipelines.racing import race_candidates
    from pipelines.rl import ppo as rl

    started = time.perf_counter()
    gen = task.generation
    round_cost = plan.phases["steps"]["target"].calls
    choice_cost = plan.phases["select"]["target"].calls
    history = list(history or [])
    r = 0
    while spent + round_cost + choice_cost <= budget:
        batch = rl.sample(policy.model, policy.tokenizer, [prompt_for(history)] * gen.candidates_per_step,
                          task.template.max_instruction_tokens, gen.temperature, gen.top_p, seed=seed * 100_003 + r)
        scored, finished = race_candidates(task, pool, [candidate_text(task, reply) for reply in batch.texts])
        spent += sum(s.target_calls for s in scored)
        history += [(s.measured.template, s.reward.total) for s, done in zip(scored, finished) if done and s.measured.valid]
        r += 1
    best: dict[str, float] = {}
    for text, reward in history:
        best[text] = max(reward, best.get(text, reward))
    ranked = sorted(best, key=lambda text: -best[text])
    finalists, _, usage = select_finalists(task, pool, ranked, 1)
    spent += usage["target"].calls if "target" in usage else 0
    return Outcome(finalists[0] if finalists else task.seed_template().text, spent, time.perf_counter() - started,
                   f"{r} rounds")


def run_ppo(task, budget: int, plan, options) -> Outcome:
    from dataclasses import replace

    from pipelines.loop import tune

    # tune's budget covers its test too: add what the test is priced at, and count the calls before it
    test_calls = plan.phases["test"]["target"].calls
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = tune(task, replace(options, steps=1000, max_target_calls=budget + test_calls,
                                    run_dir=str(Path(tmp) / "run"), store_url=None),
                      log=lambda *a: print(*a, file=sys.stderr))
    phases = report["usage"]["phases"]
    calls = sum(p.get("target", {}).get("calls", 0) for name, p in phases.items() if name != "test")
    tuned = report["test"][1]["template"] if len(report["test"]) > 1 else task.seed_template().text
    return Outcome(tuned, calls, time.perf_counter() - started, f"{report['steps']} steps")


def run_dspy(task, splits, method: str, budget: int, seed: int, target, proposer) -> Outcome:
    """DSPy's COPRO or MIPROv2 (``method``: "copro" or "miprov2") at ``budget`` target calls."""
    try:
        from pipelines.dspy_peer import optimize
    except ImportError:
        return Outcome(None, 0, 0.0, "not run: pip install -e .[bench]")
    if method == "miprov2" and importlib.util.find_spec("optuna") is None:
        return Outcome(None, 0, 0.0, "not run: pip install -e .[bench]")
    if not isinstance(target, str):
        return Outcome(None, 0, 0.0, "not run: the DSPy adapter needs an in-process target model, not an endpoint")
    from pipelines.engine.models import load_causal_lm

    started = time.perf_counter()
    result = optimize(task, splits, load_causal_lm(target), method, budget, seed, proposer=proposer)
    return Outcome(task.compose(result["instruction"]), result["target_calls"], time.perf_counter() - started,
                   result["note"])


def bootstrap(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): a 95% percentile bootstrap interval of the mean of ``values``."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, mean, mean
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return mean, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def bench_task(name: str, seeds: list[int], budget: int | None, options, dev_examples: int | None) -> list[dict]:
    from dataclasses import replace

    from pipelines.budget import estimate, scoring_tokenizer
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import load_causal_lm
    from pipelines.generation import history_meta_prompt, instruction_of, meta_prompt
    from pipelines.ray_scoring import ScoringPool, init_ray

    base = load_task(name)
    splits = load_splits(base)
    options = replace(options, dev_examples=dev_examples)
    plan = estimate(base, options, splits, scoring_tokenizer(options.target))
    if budget is None:  # the default run's search: the seed, its steps, the selection
        budget = sum(plan.phases[p]["target"].calls * (options.steps if p == "steps" else 1)
                     for p in ("seed", "steps", "select"))
    outcomes: dict[str, list[Outcome]] = {m: [] for m in METHODS}
    metric = base.scoring.metric
    figures: dict[str, list[dict]] = {m: [] for m in METHODS}
    for seed in seeds:
        task = base.with_overrides(**{"ppo.seed": seed})
        init_ray()
        pool = ScoringPool(task, splits, target=options.target, num_workers=options.num_scorers,
                           reward_examples=options.dev_examples)
        try:
            policy = load_causal_lm(options.policy_model)
            seed_prompt = meta_prompt(task, task.template.seed_instruction, {})
            outcomes["seed"].append(Outcome(task.seed_template().text, 0, 0.0))
            outcomes["best-of-N"].append(search(task, pool, policy, lambda h: seed_prompt, budget, plan, seed))
            (seed_scored,) = pool.measure([task.seed_template().text])  # OPRO's first score is the seed's
            opro_start = [(task.seed_template().text, seed_scored.reward.total)]
            outcomes["OPRO"].append(search(
                task, pool, policy,
                lambda h: history_meta_prompt(task, [(instruction_of(task, t), r) for t, r in h]),
                budget, plan, seed, spent=seed_scored.target_calls, history=opro_start))
            chosen = {m: outcomes[m][-1].template for m in ("seed", "best-of-N", "OPRO")}
        finally:
            pool.shutdown()
        outcomes["PPO"].append(run_ppo(task, budget, plan, options))
        chosen["PPO"] = outcomes["PPO"][-1].template
        for m, method in (("DSPy COPRO", "copro"), ("DSPy MIPROv2", "miprov2")):
            outcomes[m].append(run_dspy(task, splits, method, budget, seed, options.target, policy))
            if outcomes[m][-1].template is not None:
                chosen[m] = outcomes[m][-1].template
        pool = ScoringPool(task, splits, target=options.target, num_workers=options.num_scorers,
                           reward_examples=options.dev_examples)
        try:
            texts = list(dict.fromkeys(chosen.values()))
            evaluations = dict(zip(texts, pool.evaluate(texts, "test", latency=False)))
        finally:
            pool.shutdown()
        for m, text in chosen.items():
            ev = evaluations[text]
            figures[m].append({metric: ev.measured.metrics.get(metric), "roc_auc": ev.measured.metrics.get("roc_auc"),
                               "instruction": instruction_of(task, text)})
    rows = []
    for m in METHODS:
        runs = outcomes[m]
        row = {"task": base.name, "method": m, "seeds": len(seeds), "budget": budget,
               "calls": max(o.calls for o in runs), "within_budget": all(o.calls <= budget for o in runs),
               "wall_s": round(sum(o.wall_s for o in runs) / len(runs), 1), "note": runs[-1].note}
        for col in (metric, "roc_auc"):
            values = [f[col] for f in figures[m] if f[col] is not None]
            if values:
                mean, low, high = bootstrap(values)
                row[col], row[f"{col}_95"] = round(mean, 3), f"[{low:.3f}, {high:.3f}]"
            else:
                row[col], row[f"{col}_95"] = None, ""
        row["instruction"] = figures[m][-1]["instruction"] if figures[m] else ""
        rows.append(row)
    return rows


def check(rows: list[dict], tasks: list[str]) -> list[str]:
    """What is wrong with the table: a missing (task, method) row, or a method over its budget."""
    problems = []
    names = {r["task"] for r in rows}
    if len(names) != len(tasks):
        problems.append(f"{len(names)} tasks in the table, {len(tasks)} asked for")
    for task in names:
        methods = [r["method"] for r in rows if r["task"] == task]
        if tuple(methods) != METHODS:
            problems.append(f"{task}: methods {methods}, expected {list(METHODS)}")
    for r in rows:
        if not r["within_budget"]:
            problems.append(f"{r['task']} {r['method']}: {r['calls']} calls > budget {r['budget']}")
    return problems


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["risk", "sentiment"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, help="target calls per method (default: the default run's search)")
    parser.add_argument("--steps", type=int, default=4, help="steps of the default run the default budget is priced on")
    parser.add_argument("--dev-examples", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="the small test task, seed 0, a budget of two steps (CI)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()

    from pipelines.config import RunOptions

    if args.quick:
        args.tasks, args.seeds, args.steps, args.dev_examples = [QUICK_TASK], [0], 1, 12
    options = RunOptions(steps=args.steps, wandb_mode="disabled", progress=False)
    started = time.perf_counter()
    rows = []
    for name in args.tasks:
        rows += bench_task(name, args.seeds, args.budget, options, args.dev_examples)
        print(table([r for r in rows if r["task"] == rows[-1]["task"]],
                    [k for k in rows[-1] if k not in ("instruction", "note")]), flush=True)
    print(f"\nheld-out test split under each task's decision; seeds {args.seeds}; mean and 95% bootstrap interval "
          f"over seeds; calls = target calls of the search and the choice (the largest over seeds); "
          f"{time.perf_counter() - started:.0f} s in all")
    print(table(rows, [k for k in rows[0] if k not in ("instruction", "note")]))
    for r in rows:
        print(f"  {r['task']:<10} {r['method']:<13} {r['note']:<40} {r['instruction'][:90]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    problems = check(rows, args.tasks)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
