"""Benchmark: does PPO tuning beat the seed template, and does it beat best-of-N sampling?

For each task (risk, sentiment), at an equal number of target-model calls:
  * seed       the task's hand-written seed template;
  * best-of-N  N instructions sampled from the untrained policy with the seed meta-prompt (N = steps x
               candidates, the same number of candidates the PPO run scores), the best chosen as the PPO
               run chooses (`pipelines.loop.select_finalists`: the best 4 by step reward, re-ranked by
               their reward on the whole dev split);
  * PPO        the first finalist of a PPO run (`pipelines.loop.tune`, default settings).
Each chosen template is evaluated on the held-out test split (threshold fitted on train). Prints a table with
balanced accuracy, ROC-AUC, target-model calls and wall time.

    .venv/bin/python scripts/bench_tuning.py [--tasks risk sentiment] [--steps 4] [--seed 0]

Not a CI test: it takes about 15-20 minutes per task on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.cli import quiet_libraries, table  # noqa: E402


def best_of_n(task, n: int, options, pool) -> tuple[dict, int, float]:
    from pipelines.engine.models import load_causal_lm
    from pipelines.generation import candidate_text, meta_prompt
    from pipelines.loop import select_finalists
    from pipelines.rl import ppo as rl

    started = time.perf_counter()
    policy = load_causal_lm(options.policy_model)
    prompt = meta_prompt(task, task.template.seed_instruction, {})
    texts: list[str] = []
    gen = task.generation
    for step in range(0, n, gen.candidates_per_step):  # the same sampling settings and seeds as the PPO run's steps
        sampled = rl.sample(policy.model, policy.tokenizer, [prompt] * gen.candidates_per_step,
                            task.template.max_instruction_tokens, gen.temperature, gen.top_p,
                            seed=task.ppo.seed * 100_003 + step // gen.candidates_per_step)
        texts += [candidate_text(task, reply) for reply in sampled.texts]
    scored = pool.measure(texts)
    calls = sum(s.target_calls for s in scored)
    rewards = {s.measured.template: s.reward.total for s in scored if s.measured.valid}
    ranked = sorted(rewards, key=lambda text: -rewards[text])
    finalists, shortlist, _ = select_finalists(task, pool, ranked, options.finalists)
    calls += sum(row["target_calls"] for row in shortlist)
    (ev,) = pool.evaluate(finalists[:1], "test", latency=False)
    return ev, calls, time.perf_counter() - started


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["risk", "sentiment"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()

    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.config import RunOptions
    from pipelines.loop import tune
    from pipelines.ray_scoring import ScoringPool, init_ray

    rows = []
    for name in args.tasks:
        task = load_task(name).with_overrides(**{"ppo.seed": args.seed})
        with tempfile.TemporaryDirectory() as tmp:
            options = RunOptions(steps=args.steps, run_dir=str(Path(tmp) / "run"), wandb_mode="disabled", progress=True)
            started = time.perf_counter()
            report = tune(task, options, log=lambda *a: print(*a, file=sys.stderr))
            ppo_s = time.perf_counter() - started
        seed_row = report["test"][0]
        ppo_row = report["test"][1]  # the first finalist, chosen by whole-dev reward, never on test
        splits = load_splits(task)
        init_ray()
        pool = ScoringPool(task, splits, target=options.target, num_workers=options.num_scorers,
                           reward_examples=options.dev_examples)
        n = args.steps * task.generation.candidates_per_step
        ev, calls, bon_s = best_of_n(task, n, options, pool)
        pool.shutdown()
        metric = task.scoring.metric
        rows.append({"task": name, "method": "seed", metric: seed_row[metric], "roc_auc": seed_row["roc_auc"],
                     "target_calls": 0, "wall_s": 0.0, "instruction": seed_row["instruction"]})
        rows.append({"task": name, "method": f"best-of-{n} (untrained policy)", metric: ev.measured.metrics[metric],
                     "roc_auc": ev.measured.metrics["roc_auc"], "target_calls": calls, "wall_s": round(bon_s, 1),
                     "instruction": ev.measured.template.split("\n")[0]})
        rows.append({"task": name, "method": f"PPO ({args.steps} steps x {task.generation.candidates_per_step})",
                     metric: ppo_row[metric], "roc_auc": ppo_row["roc_auc"], "target_calls": report["target_calls"]
                     - report["usage"]["phases"].get("test", {}).get("target", {}).get("calls", 0),  # as best-of-N's
                     "wall_s": round(ppo_s, 1), "instruction": ppo_row["instruction"]})
        print(table([r for r in rows if r["task"] == name], ["task", "method", metric, "roc_auc", "target_calls", "wall_s"]),
              flush=True)
    print("\nheld-out test split, threshold fitted on train; target_calls = calls to the target for rewards and selection (pipelines/engine/usage.py)")
    print(table(rows, ["task", "method", "balanced_accuracy", "roc_auc", "target_calls", "wall_s"]))
    for r in rows:
        print(f"  {r['task']:<9} {r['method']:<32} {r['instruction'][:110]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
