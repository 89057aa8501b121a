"""Does the policy learn? The mean sampled reward and the feasible fraction, first step against last, over seeds.

    .venv/bin/python -m bench.learning --tasks risk sentiment --seeds 0 1 2 --steps 8
    .venv/bin/python -m bench.learning --update expert_iteration   # the same runs with expert iteration

Each (task, seed) is one tuning run of ``--steps`` steps with the task's own settings (``tune`` with
``stop_after="steps"``: the steps only, no choice, test, gate or store), recorded as one JSON line in ``--ledger`` (a rerun skips what the
ledger holds). Per step, every sample's reward is the one the policy was updated with (the race's screening
rung: ``pipelines.racing.first_rung_reward``) and "feasible" is whether that sample met every promotion threshold
measured on it (readability, and the rates where the screen measured them).

The figure: last step minus first step, the mean over seeds of each run's difference of sample means, with a 95%
bootstrap interval that resamples the samples within each (seed, step). With ``--plot`` (matplotlib) the curves
of every seed go to ``scripts/bench/results/learning_<task>.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import RESULTS


def machine() -> str:
    """The CPU and the dtype the embedded model runs in here (name them with every figure)."""
    from pipelines.engine.models import default_dtype

    name, bf16 = platform.processor() or "cpu", False
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        bf16 = "avx512_bf16" in info or "amx_bf16" in info
    except (OSError, StopIteration):
        pass
    import os

    return f"{name}, {os.cpu_count()} cores{', AVX-512 BF16' if bf16 else ', no AVX-512 BF16'}, {default_dtype()}"


def run(task_name: str, seed: int, steps: int, update: str = "ppo") -> dict:
    from pipelines.config import RunOptions, load_task
    from pipelines.loop import tune

    task = load_task(task_name)
    task = task.with_overrides(**{"ppo.seed": seed, "ppo.update": update})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = tune(task, RunOptions(steps=steps, run_dir=str(Path(tmp) / "run"), store_url=None, progress=False,
                                       stop_after="steps"), log=lambda *a: print(*a, file=sys.stderr))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"task": task_name, "seed": seed, "steps": steps, "update": update,
            "wall_s": round(time.perf_counter() - started, 1),
            "machine": machine(), "commit": commit, "learning": report["learning"]}


def difference(records: list[dict], key: str, n_boot: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    """Last step minus first step of the per-sample ``key`` ("rewards" or "feasible"), the mean over runs, and a
    95% bootstrap interval resampling samples within each (run, step)."""
    rng = np.random.default_rng(seed)
    firsts = [np.asarray(r["learning"][0]["samples"][key], dtype=float) for r in records]
    lasts = [np.asarray(r["learning"][-1]["samples"][key], dtype=float) for r in records]
    point = float(np.mean([b.mean() - a.mean() for a, b in zip(firsts, lasts)]))
    boots = np.zeros(n_boot)
    for a, b in zip(firsts, lasts):
        boots += rng.choice(b, (n_boot, len(b))).mean(1) - rng.choice(a, (n_boot, len(a))).mean(1)
    boots /= len(records)
    return point, float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def plot(task: str, records: list[dict], update: str = "ppo") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in records:
        steps = [row["step"] for row in r["learning"]]
        axes[0].plot(steps, [row["mean_reward"] for row in r["learning"]], marker="o", label=f"seed {r['seed']}")
        axes[1].plot(steps, [row["feasible_fraction"] for row in r["learning"]], marker="o", label=f"seed {r['seed']}")
    axes[0].set(title=f"{task} ({update}): mean sampled reward", xlabel="step")
    axes[1].set(title=f"{task}: feasible fraction of the samples", xlabel="step", ylim=(-0.02, 1.02))
    axes[0].legend()
    fig.suptitle(records[0]["machine"], fontsize=8)
    fig.tight_layout()
    path = RESULTS / f"learning{records[0]['steps']}_{task}{'' if update == 'ppo' else '_' + update}.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tasks", nargs="+", default=["risk", "sentiment"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ledger", type=Path, default=RESULTS / "bench_learning.jsonl")
    parser.add_argument("--update", default="ppo", choices=["ppo", "expert_iteration", "expert_iteration+ppo"],
                        help="the policy update (the task's ppo.update): PPO, expert iteration, or both")
    parser.add_argument("--plot", action="store_true", help="draw the curves (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        print("bench_learning: --steps must be at least 2 (first against last)", file=sys.stderr)
        return 2
    done = []
    if args.ledger.exists():
        done = [json.loads(line) for line in args.ledger.read_text().splitlines() if line.strip()]
    for task in args.tasks:
        for seed in args.seeds:
            if any(r["task"] == task and r["seed"] == seed and r["steps"] == args.steps
                   and r.get("update", "ppo") == args.update for r in done):
                continue
            record = run(task, seed, args.steps, args.update)
            with args.ledger.open("a") as f:
                f.write(json.dumps(record) + "\n")
            done.append(record)
    print(f"last step minus first step, mean over seeds [95% interval over samples]; {args.steps} steps, "
          f"update {args.update}")
    for task in args.tasks:
        records = [r for r in done if r["task"] == task and r["steps"] == args.steps and r["seed"] in args.seeds
                   and r.get("update", "ppo") == args.update]
        if not records:
            continue
        reward = difference(records, "rewards")
        feasible = difference(records, "feasible")
        walls = ", ".join(f"{r['wall_s']:.0f}" for r in records)
        print(f"  {task}: mean sampled reward {reward[0]:+.3f} [{reward[1]:+.3f}, {reward[2]:+.3f}], feasible fraction "
              f"{feasible[0]:+.3f} [{feasible[1]:+.3f}, {feasible[2]:+.3f}]; seeds {[r['seed'] for r in records]}, "
              f"wall {walls} s; {records[0]['machine']}")
        for r in records:
            curve = " ".join(f"{row['mean_reward']:.2f}" for row in r["learning"])
            feas = " ".join(f"{row['feasible_fraction']:.2f}" for row in r["learning"])
            print(f"    seed {r['seed']}: reward by step {curve}; feasible {feas}")
        if args.plot:
            path = plot(task, records, args.update)
            if path:
                print(f"    plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
