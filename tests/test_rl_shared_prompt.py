"""The learner and the sampler run a group's one prompt once (pipelines/rl/shared_prompt.py): in float32 the
log-probs, the critic's features, the gradients and the samples equal those of whole sequences through openrlhf's
``Actor`` and plain ``generate``. Real embedded model, real openrlhf and peft."""

from __future__ import annotations

import pytest
import torch

from pipelines.config import PPOConfig
from pipelines.rl import ppo as rl
from pipelines.rl import shared_prompt

PROMPT = "Rewrite this instruction so that a model labels SMS messages more accurately: Read the SMS message below."


@pytest.fixture(scope="module")
def learner_and_tokenizer():
    from pipelines.engine.models import load_causal_lm

    loaded = load_causal_lm(dtype="float32")
    config = PPOConfig(update="ppo", advantage_estimator="gae", minibatch_size=3, ppo_epochs=1)
    return rl.PPOLearner(loaded.model, config, group_size=1), loaded.tokenizer


def _whole_sequences(monkeypatch):
    monkeypatch.setattr(shared_prompt, "one_prompt", lambda *args: False)


def _batch(learner, tokenizer, prompts=(PROMPT,) * 6):
    return rl.sample(learner.policy, tokenizer, list(prompts), 20, 1.0, 1.0, seed=7)


def test_one_prompt_is_told_apart_from_several_and_from_padding():
    seq = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8]])
    ones = torch.ones_like(seq)
    assert shared_prompt.one_prompt(seq, ones, 1)
    assert not shared_prompt.one_prompt(seq, ones, 0)  # the last column differs
    assert not shared_prompt.one_prompt(torch.tensor([[1, 2, 3, 9], [0, 2, 3, 8]]), ones, 1)
    padded = ones.clone()
    padded[1, 0] = 0
    assert not shared_prompt.one_prompt(seq, padded, 1)
    assert not shared_prompt.one_prompt(seq, ones, 4)  # no prompt at all


def test_a_group_samples_the_same_responses_with_its_prompt_run_once(learner_and_tokenizer, monkeypatch):
    learner, tokenizer = learner_and_tokenizer
    shared = _batch(learner, tokenizer)
    _whole_sequences(monkeypatch)
    whole = _batch(learner, tokenizer)
    assert shared.texts == whole.texts
    assert torch.equal(shared.sequences, whole.sequences)
    assert len(set(shared.texts)) > 1  # sampled, not one greedy answer six times


def test_log_probs_features_and_gradients_equal_the_actors_on_whole_sequences(learner_and_tokenizer, monkeypatch):
    learner, tokenizer = learner_and_tokenizer
    batch = _batch(learner, tokenizer)
    seq, amask, attn = batch.sequences, batch.action_mask.bool(), batch.attention_mask
    assert shared_prompt.one_prompt(seq, attn, amask.size(1))
    assert (~amask).any()  # some responses stopped early: padding after the stop token is covered
    learner.actor.temperature = 0.7
    weights = torch.randn(amask.shape, generator=torch.Generator().manual_seed(0))

    def run():
        learner.policy.zero_grad(set_to_none=True)
        logp, features = learner._log_probs(seq, amask, attn, hidden=True)
        (logp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.requires_grad}
        with torch.no_grad(), learner.policy.disable_adapter():
            ref, _ = learner._log_probs(seq, amask, attn)
        return logp.detach(), features, grads, ref

    shared = run()
    _whole_sequences(monkeypatch)
    whole = run()
    assert shared[0].shape == whole[0].shape == amask.shape
    torch.testing.assert_close(shared[0], whole[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(shared[1], whole[1], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(shared[3], whole[3], atol=2e-4, rtol=1e-4)
    assert (shared[0][~amask] == 0).all()
    assert shared[2].keys() == whole[2].keys() and shared[2]
    for name in whole[2]:
        torch.testing.assert_close(shared[2][name], whole[2][name], atol=1e-4, rtol=1e-3, msg=name)
    assert any(g.abs().sum() > 0 for g in shared[2].values())
