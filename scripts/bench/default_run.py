"""Benchmark: the default tuning run, end to end, for several seeds: wall time and what it found.

Each seed runs `tune-prompts --task T --seed S --store <a fresh SQLite store> --wandb-mode disabled` in its own
process (the run a user starts, start-up included), one after the other, and the script reads each run's report.
It prints, per seed, the wall time, the target calls, whether the gate promoted, the held-out figures of the seed
template and of what was tested (the chosen candidate, or the seed when nothing was chosen: balanced accuracy
under the task's decision, ROC-AUC, the rates, readability), the choice's verdict and the gate's reasons; then
the mean of each and a 95% interval over the seeds (Student's t; with 3 seeds it is wide).

--code runs another checkout of this project (e.g. a `git worktree` of an earlier commit), so the same script
compares two versions of the default run on the same machine, one after the other:

    .venv/bin/python -m bench.default_run --task risk --seeds 0 1 2
    git worktree add --detach /tmp/before <commit>
    .venv/bin/python -m bench.default_run --task risk --seeds 0 1 2 --code /tmp/before
    .venv/bin/python -m bench.default_run --task /tmp/long/long_risk.yaml --seeds 0   # long inputs

Wall times are only comparable between runs on the same quiet machine; the figures are the held-out split's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO
from pipelines.cli_output import table

# Student's t, two-sided 95%, by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean (low = high = mean for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = _T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def machine() -> str:
    """The CPU and the dtype the embedded model runs in here (name them with every figure)."""
    from pipelines.engine.models import default_dtype

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "cpu")
    bf16 = "avx512_bf16" in info or "amx_bf16" in info
    return f"{name}, {os.cpu_count()} cores, {'AVX-512 BF16' if bf16 else 'no AVX-512 BF16'}, {default_dtype()}"


def run_once(code: Path, task: str, seed: int, extra: list[str], run_dir: Path) -> tuple[dict, float]:
    python = Path(sys.executable)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{run_dir.parent / (run_dir.name + '-store.sqlite')}"  # a fresh store per seed
    cmd = [str(python), "-m", "pipelines.cli", "--task", task, "--seed", str(seed), "--run-dir", str(run_dir),
           "--store", store, "--wandb-mode", "disabled", *extra]
    env = {**os.environ, "PYTHONPATH": str(code)}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: tune-prompts exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return json.loads((run_dir / "report.json").read_text()), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="risk", help="a built-in task or a task YAML (default risk)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--code", default=str(REPO),
                        help="the checkout whose tune-prompts runs (default: this one)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args, extra = parser.parse_known_args()
    code = Path(args.code).resolve()
    task = str(Path(args.task).resolve()) if Path(args.task).is_file() else args.task
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            report, wall = run_once(code, task, seed, extra, Path(tmp) / f"seed{seed}")
            seed_row, tuned = report["test"][0], (report["test"][1:] or report["test"])[0]
            metric = "balanced_accuracy" if "balanced_accuracy" in seed_row else "field_exact_match"
            promotion = report.get("promotion", {})
            rows.append({"seed": seed, "wall_s": round(wall, 1), "target_calls": report["target_calls"],
                         "promoted": bool(promotion.get("promoted")),
                         f"seed_{metric}": seed_row[metric], f"tuned_{metric}": tuned[metric],
                         "tuned_roc_auc": tuned.get("roc_auc"), "tuned_instruction_following": tuned.get("instruction_following_n"),
                         "tuned_entity_consistency": tuned.get("entity_consistency_n"),
                         "tuned_readability": tuned.get("readability"),
                         "instruction": tuned["instruction"], "choice": report["choice"]["verdict"],
                         "gate_reasons": promotion.get("reasons", tuned.get("gate_reasons")),
                         "machine": machine()})
            print(table([rows[-1]], [k for k in rows[-1] if k not in ("instruction", "choice", "gate_reasons", "machine")]),
                  flush=True)
    metric_cols = [k for k in rows[0] if k.startswith(("seed_", "tuned_")) and isinstance(rows[0][k], (int, float))
                   and not isinstance(rows[0][k], bool)]
    print(f"\n{task}, code at {commit} ({code}), {len(rows)} seed{'s' if len(rows) != 1 else ''}; extra arguments: "
          f"{' '.join(extra) or 'none'}")
    shown = [k for k in rows[0] if k not in ("instruction", "choice", "gate_reasons", "machine")]
    print(table(rows, shown))
    summary = []
    for col in ["wall_s", "target_calls", *metric_cols]:
        values = [float(r[col]) for r in rows if r[col] is not None]
        mean, low, high = interval(values)
        summary.append({"figure": col, "mean": mean, "95% interval": f"[{low:.3f}, {high:.3f}]",
                        "min": min(values), "max": max(values)})
    print(table(summary))
    for r in rows:
        print(f"  seed {r['seed']}: {'PROMOTED' if r['promoted'] else 'not promoted'}: {r['instruction']!r}; {r['choice']}")
    print(f"machine: {rows[0]['machine']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"task": task, "commit": commit, "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
