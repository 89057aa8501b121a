"""Benchmark: bfloat16 against float32 matrix products on this CPU, at the embedded model's shapes, and the dtype
``default_dtype`` chose here.

    .venv/bin/python -m bench.dtype            # 1 and 2 threads
    .venv/bin/python -m bench.dtype --threads 2

Per shape and thread count it prints the GFLOP/s of each dtype (the best of 3 alternating rounds) and their
ratio; then ``cpu_bf16_speedup`` (the figure ``default_dtype`` measured once and kept) and the verdict. bfloat16
is chosen only where the ratio is at least ``BF16_MIN_SPEEDUP``: the flags alone (AVX-512 BF16, AMX) do not say
whether it is faster. Run it on a quiet machine; compare only figures from one run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# (rows, in, out): 128 token rows through the MLP's up and down projections and attention's 576-wide ones, and 16
# sequences through the 49k-word head (pipelines.engine.packed_llama's TOKEN_ROWS and SEQUENCE_ROWS)
SHAPES = ((128, 576, 1536), (128, 1536, 576), (128, 576, 576), (16, 576, 49152))


def gflops(rows: int, inner: int, out: int, dtype, seconds: float = 0.3) -> float:
    import torch

    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, out, dtype=dtype)
    x @ w
    best = float("inf")
    for _ in range(3):
        runs, start = 0, time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds / 3:
            x @ w
            runs += 1
        best = min(best, (time.perf_counter() - start) / runs)
    return 2 * rows * inner * out / best / 1e9


def main() -> int:
    import torch

    from pipelines.cli_output import table
    from pipelines.engine import models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "cpu")
    flags = set(info.split())
    print(f"{name}; {', '.join(sorted(f for f in flags if f in ('avx2', 'avx512_bf16', 'amx_bf16'))) or 'none'}; "
          f"torch {torch.__version__}")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            fp32, bf16 = gflops(*shape, torch.float32), gflops(*shape, torch.bfloat16)
            rows.append({"threads": threads, "shape": "x".join(map(str, shape)), "float32_gflops": fp32,
                         "bfloat16_gflops": bf16, "bf16_over_fp32": bf16 / fp32})
    print(table(rows))
    speedup = models.cpu_bf16_speedup()
    print(f"cpu_bf16_speedup (1 thread, 128x576x1536): {speedup:.2f}; bfloat16 needs >= {models.BF16_MIN_SPEEDUP}")
    dtype = models.default_dtype()
    record = models.default_cache_dir() / models._DTYPE_RECORD
    kept = record.read_text() if record.exists() else "nothing (no measurement needed)"
    print(f"default_dtype here: {dtype}; the verdict kept in {record}: {' '.join(kept.split())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
