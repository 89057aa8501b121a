"""CPU import stand-ins for flash_attn and vllm, so that openrlhf 0.11.2 imports on a machine without CUDA.

openrlhf imports ``flash_attn`` (``openrlhf/models/ring_attn_utils.py``) and ``vllm`` (its Ray trainer,
experience maker and CLI) at module level, and neither installs on a CPU machine. ``install_cpu_stand_ins``
registers minimal modules for them in ``sys.modules``, only where the real package is missing, before
openrlhf is imported. The padding helpers are real (pure torch, flash-attn 2.8's signatures); everything
that needs a GPU raises ``StandInError``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

log = logging.getLogger(__name__)


class StandInError(RuntimeError):
    """Raised when code reaches a part of flash_attn or vllm that the CPU stand-ins do not provide."""


def _needs_gpu(qualname: str, package: str):
    def unavailable(*args: Any, **kwargs: Any):
        raise StandInError(
            f"{qualname} needs the real {package} package on a CUDA GPU; this process has only the CPU "
            f"import stand-in from pipelines.rl.stand_ins. Run this path on a GPU machine with {package} installed."
        )

    unavailable.__name__ = unavailable.__qualname__ = qualname.rsplit(".", 1)[-1]
    return unavailable


def _index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """flash_attn.bert_padding.index_first_axis: rows ``indices`` of ``tensor`` (autograd by plain indexing)."""
    return tensor[indices]


def _unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """flash_attn 2.8's unpad_input: (tokens, indices, cu_seqlens, max_seqlen, used_seqlens), pure torch."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), used_seqlens


def _pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """flash_attn.bert_padding.pad_input: scatter unpadded tokens back to (batch, seqlen, ...), zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def _stand_in(name: str, doc: str, attrs: dict[str, Any], package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    # A real spec keeps importlib.util.find_spec() working; an empty __path__ makes any submodule we
    # do not define an ImportError, so optional imports (flash_attn.ops.triton...) take their fallback.
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    module.__cpu_stand_in__ = True
    module.__dict__.update(attrs)
    return module


def _stand_in_modules() -> dict[str, types.ModuleType]:
    from einops import rearrange  # what flash_attn.bert_padding re-exports; an openrlhf dependency

    fa, vl = "flash-attn", "vllm"
    return {
        # openrlhf/models/ring_attn_utils.py imports these at module level; they are used only for packed
        # samples and ring attention, which need flash-attn kernels anyway.
        "flash_attn": _stand_in("flash_attn", "CPU import stand-in for flash-attn.", {}, package=True),
        "flash_attn.bert_padding": _stand_in(
            "flash_attn.bert_padding",
            "Pure-torch padding helpers with flash-attn 2.8's signatures.",
            {
                "index_first_axis": _index_first_axis,
                "pad_input": _pad_input,
                "unpad_input": _unpad_input,
                "rearrange": rearrange,
            },
        ),
        "flash_attn.utils": _stand_in("flash_attn.utils", "CPU import stand-in.", {}, package=True),
        "flash_attn.utils.distributed": _stand_in(
            "flash_attn.utils.distributed",
            "CPU import stand-in: collective ops need flash-attn on GPUs.",
            {"all_gather": _needs_gpu("flash_attn.utils.distributed.all_gather", fa)},
        ),
        # openrlhf's Ray trainer, experience maker and CLI import vllm at module level; generation with
        # vLLM engines is the GPU path. Every name they import exists here and raises when called.
        "vllm": _stand_in(
            "vllm",
            "CPU import stand-in for vllm; every use raises.",
            {
                "SamplingParams": _needs_gpu("vllm.SamplingParams", vl),
                "AsyncEngineArgs": _needs_gpu("vllm.AsyncEngineArgs", vl),
                "AsyncLLMEngine": _needs_gpu("vllm.AsyncLLMEngine", vl),
                "LLM": _needs_gpu("vllm.LLM", vl),
            },
            package=True,
        ),
        "vllm.inputs": _stand_in(
            "vllm.inputs", "CPU import stand-in.", {"TokensPrompt": _needs_gpu("vllm.inputs.TokensPrompt", vl)}
        ),
        "vllm.utils": _stand_in(
            "vllm.utils", "CPU import stand-in.", {"random_uuid": _needs_gpu("vllm.utils.random_uuid", vl)}
        ),
    }


def install_cpu_stand_ins() -> list[str]:
    """Register the flash_attn / vllm stand-ins for each top-level package that is not installed.

    Idempotent; a real installation is never shadowed. Returns the module names registered by this call.
    """
    installed = []
    for top in ("flash_attn", "vllm"):
        if importlib.util.find_spec(top) is not None:  # the real package, or our stand-in from an earlier call
            continue
        for name, module in _stand_in_modules().items():
            if name == top or name.startswith(top + "."):
                sys.modules[name] = module
                installed.append(name)
    if installed:
        log.info("CPU import stand-ins registered for: %s", ", ".join(installed))
    return installed
