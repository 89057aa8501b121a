"""The model loader: the real embedded model, its on-disk cache, and clear errors."""

import json
import math
import shutil
from pathlib import Path

import pytest

from pipelines.engine import models
from pipelines.engine.models import ModelLoadError, load_causal_lm


@pytest.mark.e2e
def test_embedded_model_loads_offline_and_answers():
    import torch

    lm = load_causal_lm()
    flags = set(Path("/proc/cpuinfo").read_text().split())
    native_bf16 = torch.cuda.is_available() or bool({"avx512_bf16", "amx_bf16"} & flags)
    # bfloat16 only where the hardware computes it (emulated bfloat16 ran 40x slower than float32 on AVX2), and
    # there only where it measured faster (choose_cpu_dtype)
    assert lm.model.dtype == getattr(torch, models.default_dtype())
    assert native_bf16 or lm.model.dtype == torch.float32
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.shape[0] == lm.model.config.vocab_size


def test_cache_manifest_detects_partial_and_corrupt_copies(tmp_path):
    folder = models.embedded_model_dir()  # built once per machine; later calls are a manifest check
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    source = json.loads((copy / models._MANIFEST).read_text())["source"]
    assert models._cache_is_complete(copy, source)
    with open(copy / "model.safetensors", "r+b") as fh:  # a partial write
        fh.truncate(1000)
    assert not models._cache_is_complete(copy, source)
    shutil.rmtree(copy)
    shutil.copytree(folder, copy)
    (copy / models._MANIFEST).write_text("{not json")
    assert not models._cache_is_complete(copy, source)
    assert not models._cache_is_complete(tmp_path / "absent", source)


@pytest.mark.slow
def test_corrupt_cache_is_rebuilt(tmp_path):
    folder = models.embedded_model_dir(tmp_path)
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    lm = load_causal_lm(cache_dir=tmp_path)
    source = json.loads((folder / models._MANIFEST).read_text())["source"]
    assert lm.model is not None and models._cache_is_complete(folder, source)


def test_local_folder_loads_like_any_hf_model(tmp_path):
    folder = tmp_path / "my-model"
    shutil.copytree(models.embedded_model_dir(), folder)
    (folder / models._MANIFEST).unlink()
    lm = load_causal_lm(str(folder))
    assert lm.name == str(folder) and lm.model.config.model_type == "llama"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("embedded:gpt-17", "unknown embedded model"),
        ("/nonexistent/model/dir", "cannot load model"),
    ],
)
def test_unloadable_models_name_the_problem(spec, message):
    with pytest.raises(ModelLoadError, match=message):
        load_causal_lm(spec)


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_causal_lm(str(tmp_path))


def test_unreadable_model_path_gives_exit_code_2(tmp_path, capsys):
    from pipelines.cli import main

    (tmp_path / "config.json").write_text("{broken")
    assert main(["eval", "--task", "risk", "--model", str(tmp_path)]) == 2
    assert "cannot load model" in capsys.readouterr().err


FLAGS = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"


def test_cpu_dtype_is_measured_once_per_machine_and_kept_beside_the_model_cache(tmp_path):
    calls = []

    def measured(speedup):
        def measure():
            calls.append(speedup)
            return speedup
        return measure

    record = tmp_path / "models" / "dtype-choice.json"
    avx2 = "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n"
    assert models.choose_cpu_dtype(avx2, record, measured(9.0)) == "float32" and calls == []  # emulated: never
    slow = "model name\t: Intel(R) Xeon(R) Processor\n" + FLAGS  # AVX-512 BF16 without AMX
    assert models.choose_cpu_dtype(slow, record, measured(0.56)) == "float32" and calls == [0.56]
    # another process on the same machine reads the verdict instead of measuring (a run's Ray actors, the gateway)
    models.choose_cpu_dtype.cache_clear()
    assert models.choose_cpu_dtype(slow, record, measured(4.0)) == "float32" and calls == [0.56]
    fast = "model name\t: AMD EPYC 9R14\n" + FLAGS
    assert models.choose_cpu_dtype(fast, record, measured(4.0)) == "bfloat16" and calls == [0.56, 4.0]
    kept = json.loads(record.read_text())
    assert sorted(v["dtype"] for v in kept.values()) == ["bfloat16", "float32"]
    assert sorted(v["bf16_speedup"] for v in kept.values()) == [0.56, 4.0]
    # a speedup just under the bar is float32: bfloat16 has to earn its rounding
    near = "model name\t: Other\n" + FLAGS
    assert models.choose_cpu_dtype(near, record, measured(models.BF16_MIN_SPEEDUP - 0.01)) == "float32"
    record.write_text("{not json")  # a damaged record is measured again, not a crash
    models.choose_cpu_dtype.cache_clear()
    assert models.choose_cpu_dtype(fast, record, measured(4.0)) == "bfloat16" and calls[-1] == 4.0


def test_dtype_can_be_forced_and_a_wrong_value_names_the_fix(monkeypatch):
    monkeypatch.setenv(models.DTYPE_ENV, "float32")
    assert models.default_dtype() == "float32"
    monkeypatch.setenv(models.DTYPE_ENV, "fp8")
    with pytest.raises(ModelLoadError, match="set it to bfloat16 or float32"):
        models.default_dtype()


def test_bf16_speedup_is_measured_on_one_thread_and_leaves_the_thread_count_as_it_was():
    import torch

    threads = torch.get_num_threads()
    speedup = models.cpu_bf16_speedup(seconds=0.06)
    assert math.isfinite(speedup) and speedup > 0
    assert torch.get_num_threads() == threads
