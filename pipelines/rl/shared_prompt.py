"""Many responses to one prompt, with the prompt computed once.

The loop samples a group of responses to one meta-prompt: every row of a rollout batch has the same prompt
(about 150 tokens for risk) before its response (up to 48). The learner then scores the batch three times: the
old policy, the reference, and each minibatch with gradients. A whole-sequence forward, which is what openrlhf's
``Actor`` runs, repeats the prompt for every row and computes the vocabulary's logits at every position, prompt
included. Here the prompt runs once per forward. Its keys and values are repeated across the rows, so its
gradient is still exact. Logits are computed only where a response token is predicted.

The log-probs are openrlhf's (``log_probs_from_logits`` on temperature-scaled float32 logits, masked by the
action mask), with the same positions. tests/test_rl_shared_prompt.py checks, in float32, that they and their
gradients equal ``Actor``'s to float rounding. In bfloat16 they differ by the rounding of different matrix shapes.

``sample`` uses the same idea: the prompt's keys and values are computed once and handed to ``generate``.
"""

from __future__ import annotations

from typing import Any

import torch


def one_prompt(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> bool:
    """Whether every row has the same prompt, unpadded, in its first columns (then ``action_log_probs`` applies)."""
    width = sequences.size(1) - response_width
    return (width > 0 and bool(attention_mask[:, :width].all())
            and bool((sequences[:, :width] == sequences[:1, :width]).all()))


def prompt_cache(model, prompt_ids: torch.Tensor, rows: int, **kwargs) -> tuple[Any, Any]:
    """Run ``prompt_ids`` (1, P) once; return (its key/value cache repeated for ``rows`` rows, the model output)."""
    out = model(input_ids=prompt_ids, use_cache=True, **kwargs)
    cache = out.past_key_values
    cache.batch_repeat_interleave(rows)
    return cache, out


def action_log_probs(model, sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor,
                     temperature: float, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of each row's response tokens, masked by ``action_mask``, as ``Actor`` computes them;
    with ``hidden``, also the last layer's hidden state before each response token (B, R, H), float32, which
    is where the learner's critic reads its features. Every row must have the same prompt (``one_prompt``)."""
    from openrlhf.models.utils import log_probs_from_logits

    rows, total = sequences.shape
    responses = action_mask.size(1)
    width = total - responses
    cache, head = prompt_cache(model, sequences[:1, :width], rows, output_hidden_states=hidden)
    logits = [head.logits[:, -1:].expand(rows, 1, -1)]  # the prompt's last position predicts response token 0
    states = [head.hidden_states[-1][:, -1:].expand(rows, 1, -1)] if hidden else []
    if responses > 1:  # response token t is predicted at position t - 1; the last token predicts nothing
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as Actor's
        rest = model(input_ids=sequences[:, width:-1], attention_mask=attention_mask[:, :-1],
                     position_ids=positions[:, width:-1], past_key_values=cache, use_cache=True,
                     output_hidden_states=hidden)
        logits.append(rest.logits)
        if hidden:
            states.append(rest.hidden_states[-1])
    scaled = torch.cat(logits, dim=1).float()
    if temperature != 1.0:
        scaled = scaled / temperature
    log_probs = log_probs_from_logits(scaled, sequences[:, width:]) * action_mask.float()
    return log_probs, (torch.cat(states, dim=1).float() if hidden else None)
