"""The CPU import stand-ins for flash_attn and vllm: clear errors on GPU-only use, openrlhf's torch fallbacks,
pure-torch padding, and a real installation left alone."""

import sys
import types
from importlib.machinery import ModuleSpec

import pytest
import torch

from pipelines.rl.stand_ins import StandInError, install_cpu_stand_ins


@pytest.fixture
def stand_ins():
    install_cpu_stand_ins()
    if not getattr(sys.modules.get("flash_attn"), "__cpu_stand_in__", False):
        pytest.skip("the real flash_attn is installed here")
    if not getattr(sys.modules.get("vllm"), "__cpu_stand_in__", False):
        pytest.skip("the real vllm is installed here")


def test_stand_ins_raise_a_clear_error_on_gpu_only_use(stand_ins):
    import vllm
    from flash_attn.utils.distributed import all_gather
    from vllm.utils import random_uuid

    with pytest.raises(StandInError, match="needs the real flash-attn package on a CUDA GPU"):
        all_gather(torch.zeros(2), None)
    with pytest.raises(StandInError, match="needs the real vllm package"):
        vllm.SamplingParams(temperature=1.0)
    with pytest.raises(StandInError, match="vllm"):
        vllm.AsyncEngineArgs(model="x")
    with pytest.raises(StandInError):
        random_uuid()
    with pytest.raises(StandInError, match=r"CPU import stand-in from pipelines\.rl\.stand_ins\."):
        vllm.LLM(model="x")


def test_a_kernel_the_stand_in_lacks_is_an_import_error_so_openrlhf_takes_its_torch_fallback(stand_ins):
    with pytest.raises(ImportError):
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    from openrlhf.models.utils import log_probs_from_logits

    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[0, 1, 2], [3, 4, 0]])
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_probs_from_logits(logits, labels), expected)


def test_openrlhfs_unpad_and_pad_round_trip_through_the_pure_torch_stand_in(stand_ins):
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

    sequences = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    packed, position_ids, rolled, pad_len, indices = unpad_and_slice_tensor(sequences, mask, None)
    assert packed.tolist() == [[5, 6, 7, 8, 9]]
    assert position_ids.tolist() == [[0, 1, 0, 1, 2]]
    back = gather_and_pad_tensor(packed.float(), None, pad_len, indices, 2, 4)
    assert back.tolist() == (sequences * mask).float().tolist()
    with pytest.raises(StandInError):  # ring attention gathers across GPUs
        gather_and_pad_tensor(packed.float(), object(), 0, indices, 2, 4)


def test_a_real_installation_is_never_shadowed(monkeypatch):
    real = types.ModuleType("vllm")
    real.__spec__ = ModuleSpec("vllm", loader=None)
    monkeypatch.setitem(sys.modules, "vllm", real)
    assert not any(name.startswith("vllm") for name in install_cpu_stand_ins())
    assert sys.modules["vllm"] is real
