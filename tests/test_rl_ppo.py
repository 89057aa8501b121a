"""The local policy update: openrlhf's advantage estimators on tiny tensors, and PPO steps on the real
SmolLM2-135M-Instruct (marked e2e)."""

import math
import sys
import types
from pathlib import Path

import pytest
import torch

from pipelines.config import PPOConfig
from pipelines.engine.models import default_dtype
from pipelines.rl import ppo


# Larger steps than PPOConfig's defaults, so that a few steps on a few samples move every trained weight.
# update ppo: these tests are of the learner's updates, and a task's default is none (no update, best-of-N)
TEST_SETTINGS = {"update": "ppo", "value_clip_eps": 0.5, "kl_coef": 0.05, "ppo_epochs": 1, "lr": 1e-3, "critic_lr": 1e-2}


def _config(**change) -> PPOConfig:
    return PPOConfig(**{**TEST_SETTINGS, **change})


@pytest.mark.parametrize(
    "module, absent",
    [
        ("pipelines.rl.stand_ins", ("openrlhf", "vllm", "flash_attn", "peft")),
        ("pipelines.rl.ppo", ("openrlhf", "vllm", "flash_attn", "peft")),
        ("pipelines.rl.train_ppo_ray", ("openrlhf", "vllm", "flash_attn", "peft", "ray", "torch")),
        ("pipelines.rl.cluster_job", ("openrlhf", "vllm", "flash_attn", "peft", "ray", "torch")),
    ],
)
def test_importing_an_rl_module_imports_no_dependency_it_needs_only_later(module, absent):
    import subprocess

    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


# --- openrlhf's advantage estimators on tiny tensors ------------------------------------------------


def _estimate(estimator, rewards, kl=None, values=None, mask=None, kl_coef=0.0, group_size=1, **settings):
    from openrlhf.trainer.ppo_utils import FixedKLController

    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), 3, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    kl = torch.zeros(mask.shape) if kl is None else torch.tensor(kl, dtype=torch.float32)
    values = None if values is None else torch.tensor(values, dtype=torch.float32)
    return ppo.compute_advantages_and_returns(
        _config(advantage_estimator=estimator, **settings),
        FixedKLController(kl_coef),
        group_size=group_size,
        rewards=rewards,
        kl=kl,
        values=values,
        action_mask=mask,
    )


def _whiten(x, mask):
    mean = x[mask].mean()
    return (x - mean) / x[mask].var(unbiased=False).sqrt()


def test_gae_puts_the_reward_on_the_last_token_and_whitens_advantages():
    mask = [[1, 1, 0], [1, 1, 1]]
    advantages, returns, episode = _estimate("gae", [1.0, -1.0], mask=mask, values=[[0.0] * 3] * 2, lambd=1.0)
    m = torch.tensor(mask, dtype=torch.bool)
    assert returns.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]  # gamma = lambda = 1, zero values
    torch.testing.assert_close(advantages[m], _whiten(returns, m)[m])
    assert episode.tolist() == [1.0, -1.0]


def test_gae_with_values_and_lambda():
    values = [[0.5, 0.25, 0.0]]
    advantages, returns, _ = _estimate("gae", [1.0], values=values, lambd=0.5, gamma=1.0)
    # deltas: r_t + V(t+1) - V(t) = [-0.25, -0.25, 1.0]; A_t = delta_t + 0.5 A_{t+1}
    raw = torch.tensor([[-0.25 + 0.5 * (-0.25 + 0.5 * 1.0), -0.25 + 0.5 * 1.0, 1.0]])
    torch.testing.assert_close(returns, raw + torch.tensor(values))
    torch.testing.assert_close(advantages, _whiten(raw, torch.ones_like(raw, dtype=torch.bool)))


def test_the_kl_penalty_is_charged_on_every_token_with_the_controllers_coefficient():
    kl = [[0.1, 0.2, 0.3]]
    _, returns, episode = _estimate("reinforce", [1.0], kl=kl, kl_coef=0.5)
    # rewards per token: -0.05, -0.1, 1 - 0.15; returns are suffix sums
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.75, 0.85]]))
    torch.testing.assert_close(episode, torch.tensor([0.7]))


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("rloo", [1.0 - 2.0 / 3, 0.0 - 3.0 / 3, 2.0 - 1.0 / 3, 0.0 - 3.0 / 3]),  # leave-one-out mean
        ("group_norm", [(r - 0.75) / torch.tensor([1.0, 0.0, 2.0, 0.0]).std().item() for r in (1.0, 0.0, 2.0, 0.0)]),
        ("dr_grpo", [1.0 - 0.75, -0.75, 2.0 - 0.75, -0.75]),
    ],
)
def test_group_baselines_over_one_group(estimator, expected):
    advantages, _, _ = _estimate(estimator, [1.0, 0.0, 2.0, 0.0], group_size=4)
    # one scalar per sample, broadcast over its tokens (gamma = 1), not whitened
    torch.testing.assert_close(advantages, torch.tensor(expected).unsqueeze(1).expand(4, 3), atol=1e-5, rtol=1e-5)


def test_group_baselines_use_consecutive_rows_as_groups():
    advantages, _, _ = _estimate("dr_grpo", [1.0, 3.0, 10.0, 20.0], group_size=2)
    assert advantages[:, 0].tolist() == [-1.0, 1.0, -5.0, 5.0]


def test_flash_reinforce_subtracts_the_batch_mean_without_groups_or_whitening():
    advantages, returns, _ = _estimate("flash_reinforce", [1.0, 3.0, 5.0, 7.0], group_size=2)
    expected = torch.tensor([-3.0, -1.0, 1.0, 3.0]).unsqueeze(1).expand(4, 3)  # batch mean 4, not pair means
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_reinforce_baseline_subtracts_the_group_mean_then_whitens():
    advantages, _, _ = _estimate("reinforce_baseline", [1.0, 0.0, 2.0, 0.0], group_size=4)
    centred = torch.tensor([0.25, -0.75, 1.25, -0.75]).unsqueeze(1).expand(4, 3)
    torch.testing.assert_close(advantages, _whiten(centred, torch.ones(4, 3, dtype=torch.bool)))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"advantage_estimator": "ppo2"}, "advantage_estimator"),
        ({"advantage_estimator": "group_norm", "gamma": 0.9}, "gamma is 0.9, .* set ppo.gamma to 1.0"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"reward_clip_range": (1.0, -1.0)}, r"reward_clip_range .* low < high"),
        ({"lr": float("nan")}, "lr\n.*finite number"),
        ({"reward_clip_range": (-10.0, float("inf"))}, "reward_clip_range.*\n.*finite number"),
    ],
)
def test_a_bad_ppo_config_is_refused_with_the_field_and_the_fix(change, message):
    with pytest.raises(ValueError, match=message):
        _config(**change)


def test_a_bad_ppo_setting_in_a_task_fails_when_the_task_is_loaded():
    from pipelines.config import ConfigError, load_task

    with pytest.raises(ConfigError, match="ppo: .*gamma is 0.5, but advantage_estimator 'rloo' needs gamma 1.0"):
        load_task("risk").with_overrides(**{"ppo.advantage_estimator": "rloo", "ppo.gamma": 0.5})


@pytest.mark.parametrize("estimator, group_size", [("rloo", 1), ("group_norm", 1), ("gae", 0)])
def test_the_learner_refuses_a_group_too_small_for_its_estimator(estimator, group_size):
    with pytest.raises(ValueError, match=f"group_size is {group_size}, .*needs group_size >= "):
        ppo.PPOLearner(model=None, config=_config(advantage_estimator=estimator), group_size=group_size)


def test_the_policy_starts_from_the_same_adapter_for_the_same_seed():
    """LoRA's random start comes from ppo.seed, not from torch's per-process random seed, and the caller's RNG
    is left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def adapter(seed: int) -> list:
        config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
        torch.manual_seed(123)  # the same base weights every time
        model = LlamaForCausalLM(config).eval()
        torch.manual_seed(999)  # whatever the caller's generator holds ...
        before = torch.random.get_rng_state()
        learner = ppo.PPOLearner(model, _config(seed=seed), group_size=8)
        assert torch.equal(torch.random.get_rng_state(), before)  # ... it is untouched
        return [p.detach().clone() for p in learner.lora_params]

    first, again, other = adapter(0), adapter(0), adapter(1)
    assert len(first) == 2 * 2 * 4  # A and B of q, k, v and o in two layers
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


# --- PPO on the real SmolLM2-135M-Instruct ------------------------------------------------------------

META_PROMPT = (
    "Write one instruction, one to three sentences, that tells an assistant how to decide whether an SMS "
    "message is a scam. Reply with the instruction only."
)
BATCH, MAX_NEW_TOKENS, STEPS = 8, 24, 3


def _load_policy_base():
    from pipelines.engine.models import load_causal_lm

    loaded = load_causal_lm()
    return loaded.model, loaded.tokenizer


def _reward(texts):
    """Shorter instructions score higher: a real reward computed from the sampled text."""
    return [-len(text) / 100.0 for text in texts]


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model, tokenizer = _load_policy_base()
    learner = ppo.PPOLearner(model, _config(minibatch_size=4), group_size=BATCH)
    lora = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if not p.requires_grad}
    head = {n: p.detach().clone() for n, p in learner.value_head.named_parameters()}
    rollouts, history = [], []
    for step in range(STEPS):
        batch = ppo.sample(learner.policy, tokenizer, [META_PROMPT] * BATCH, MAX_NEW_TOKENS, 1.0, 1.0, seed=step)
        batch = batch.with_rewards(_reward(batch.texts))
        rollouts.append(batch)
        history.append(learner.step(batch))
    return types.SimpleNamespace(
        learner=learner, tokenizer=tokenizer, lora=lora, base=base, head=head, rollouts=rollouts, history=history
    )


@pytest.mark.e2e
def test_rollouts_mark_exactly_the_sampled_response_tokens(trained):
    stop_ids = ppo._stop_token_ids(trained.learner.policy, trained.tokenizer)
    for batch in trained.rollouts:
        n, length = batch.sequences.shape
        responses = batch.action_mask.size(1)
        assert batch.attention_mask.shape == (n, length) and 1 <= responses <= MAX_NEW_TOKENS
        assert torch.equal(batch.attention_mask[:, -responses:].bool(), batch.action_mask)
        for row, mask, truncated in zip(batch.sequences[:, -responses:], batch.action_mask, batch.truncated):
            sampled = row[mask].tolist()
            assert mask.tolist() == sorted(mask.tolist(), reverse=True)  # a prefix of the response slots
            stops = [i for i, t in enumerate(sampled) if t in stop_ids]
            assert stops == ([] if truncated else [len(sampled) - 1])  # ends at its first stop token
        assert all(isinstance(text, str) for text in batch.texts)


@pytest.mark.e2e
def test_ppo_steps_train_every_lora_weight_and_the_value_head_but_no_base_weight(trained):
    learner = trained.learner
    params = dict(learner.policy.named_parameters())
    assert trained.lora and all(params[n].dtype == torch.float32 for n in trained.lora)  # fp32 adapter
    base_dtype = getattr(torch, default_dtype())  # bf16 where the CPU has it natively
    assert {p.dtype for n, p in params.items() if n not in trained.lora} == {base_dtype}  # the base stays as loaded
    unchanged = [n for n, before in trained.lora.items() if torch.equal(before, params[n])]
    assert not unchanged, f"LoRA weights that did not move: {unchanged[:5]}"
    for name, before in trained.head.items():
        assert not torch.equal(before, dict(learner.value_head.named_parameters())[name]), name
    moved = [n for n, before in trained.base.items() if not torch.equal(before, params[n])]
    assert not moved, f"base weights changed: {moved[:5]}"


@pytest.mark.e2e
def test_ppo_metrics_are_finite_and_come_from_the_rollouts(trained):
    first, *later = trained.history
    assert first["train/kl"] == 0.0  # the policy is the reference until its first update
    assert all(m["train/kl"] != 0.0 for m in later)
    for metrics, batch in zip(trained.history, trained.rollouts):
        expected = {
            "train/policy_loss", "train/value_loss", "train/kl", "train/kl_coef", "train/reward_mean",
            "train/advantage_mean", "train/clipfrac", "timing/update_s",
        }
        assert expected <= metrics.keys()
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["train/reward_mean"] == pytest.approx(sum(_reward(batch.texts)) / BATCH)
        assert metrics["train/kl_coef"] == TEST_SETTINGS["kl_coef"]  # a fixed controller
        assert metrics["train/response_tokens_mean"] == batch.action_mask.sum(1).float().mean().item()
    assert first["train/return_mean"] == pytest.approx(first["train/reward_mean"])  # no KL charge yet
    assert trained.learner.steps_done == STEPS


@pytest.mark.e2e
def test_save_and_load_restore_the_policy_value_head_and_optimizers(trained, tmp_path):
    learner = trained.learner
    learner.save_adapter(tmp_path / "ckpt")
    model, _ = _load_policy_base()
    resumed = ppo.PPOLearner(model, _config(minibatch_size=4), group_size=BATCH)
    resumed.load_adapter(tmp_path / "ckpt")

    batch = trained.rollouts[-1]
    with torch.no_grad():
        expected = learner.actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
        got = resumed.actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
    assert torch.equal(expected, got)
    for (name, a), (_, b) in zip(learner.value_head.state_dict().items(), resumed.value_head.state_dict().items()):
        assert torch.equal(a, b), name
    assert resumed.actor_optim.state_dict()["state"].keys() == learner.actor_optim.state_dict()["state"].keys()
    assert resumed.steps_done == learner.steps_done and resumed.kl_ctl.value == learner.kl_ctl.value


@pytest.mark.e2e
def test_a_deferred_update_survives_the_checkpoint_and_runs_before_the_next_step(trained, tmp_path):
    """A run's last step defers its update (``PPOLearner.defer``); a run resumed for more steps owes it first."""
    learner = trained.learner
    rewarded = trained.rollouts[-1].with_rewards(_reward(trained.rollouts[-1].texts))
    learner.defer(rewarded)
    learner.save_adapter(tmp_path / "ckpt")
    learner.pending = None  # the fixture's learner stays as the other tests expect it
    model, _ = _load_policy_base()
    resumed = ppo.PPOLearner(model, _config(minibatch_size=4), group_size=BATCH)
    resumed.load_adapter(tmp_path / "ckpt")
    assert resumed.pending is not None and torch.equal(resumed.pending.sequences, rewarded.sequences)
    assert torch.equal(resumed.pending.rewards, rewarded.rewards) and resumed.pending.texts == rewarded.texts
    before = resumed.steps_done
    resumed.step(rewarded)
    assert resumed.steps_done == before + 2 and resumed.pending is None  # the owed update, then this one


@pytest.mark.e2e
# flash_reinforce runs the same learner code as rloo but for openrlhf's baseline (tested above on tiny
# tensors), so its full step is marked slow to keep the default suite's time.
@pytest.mark.parametrize("estimator", ["rloo", pytest.param("flash_reinforce", marks=pytest.mark.slow)])
def test_a_critic_free_estimator_runs_one_step_without_a_value_loss(estimator):
    model, tokenizer = _load_policy_base()
    learner = ppo.PPOLearner(model, _config(advantage_estimator=estimator, minibatch_size=8), group_size=4)
    batch = ppo.sample(learner.policy, tokenizer, [META_PROMPT] * 8, 16, 1.0, 1.0, seed=7)
    metrics = learner.step(batch.with_rewards(_reward(batch.texts)))
    assert "train/value_loss" not in metrics
    assert math.isfinite(metrics["train/policy_loss"]) and metrics["train/kl"] == 0.0


# --- expert iteration (ppo.update) on a tiny random model ---------------------------------------------


def _tiny_learner(**change):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(123)
    return ppo.PPOLearner(LlamaForCausalLM(config).eval(), _config(**change), group_size=4)


def _tiny_batch(rewards, truncated=None):
    """Rows of one 3-token prompt and 4 sampled tokens each, as ``sample`` lays them out (groups of 4)."""
    n = len(rewards)
    generator = torch.Generator().manual_seed(5)
    sequences = torch.cat([torch.tensor([[1, 2, 3]] * n), torch.randint(4, 64, (n, 4), generator=generator)], dim=1)
    return ppo.RolloutBatch(
        prompts=["p"] * n, texts=[f"t{i}" for i in range(n)], sequences=sequences,
        attention_mask=torch.ones_like(sequences), action_mask=torch.ones(n, 4, dtype=torch.bool),
        truncated=torch.tensor(truncated or [False] * n), temperature=1.0,
    ).with_rewards(rewards)


def _token_logp(learner, batch):
    with torch.no_grad():
        logp, _ = learner._log_probs(batch.sequences, batch.action_mask, batch.attention_mask)
    return logp.mean(dim=1)


def test_expert_iteration_imitates_each_groups_best_samples_above_its_mean_and_nothing_else():
    learner = _tiny_learner(update="expert_iteration", expert_top_k=2, lr=1e-2, expert_epochs=3)
    # group 1: mean 1.5, the best two above it are rows 0 and 2; row 1 is above the mean too but third;
    # group 2: all alike, nothing to learn from; group 3: the best (row 8) ran out of tokens, so row 10 alone
    batch = _tiny_batch([3, 1.6, 2, 0, 0, 0, 0, 0, 9, 1, 5, 1], truncated=[False] * 8 + [True] + [False] * 3)
    head = [p.detach().clone() for p in learner.value_head.parameters()]
    before = _token_logp(learner, batch)
    metrics = learner.step(batch)
    gain = _token_logp(learner, batch) - before
    assert metrics["train/imitated"] == 3.0 and metrics["train/imitated_reward_mean"] == pytest.approx(10 / 3)
    assert math.isfinite(metrics["train/sft_loss"]) and "train/kl" not in metrics  # no PPO part
    imitated = [0, 2, 10]
    assert all(gain[i] > 0 for i in imitated), gain
    assert gain[imitated].min() > gain[[i for i in range(12) if i not in imitated]].max()
    assert all(torch.equal(a, b) for a, b in zip(head, learner.value_head.parameters()))  # no critic
    assert learner.steps_done == 1


def test_expert_iteration_with_nothing_above_the_mean_leaves_the_policy_as_it_was():
    learner = _tiny_learner(update="expert_iteration")
    lora = [p.detach().clone() for p in learner.lora_params]
    metrics = learner.step(_tiny_batch([1.0] * 4))
    assert metrics["train/imitated"] == 0.0 and math.isnan(metrics["train/sft_loss"])
    assert all(torch.equal(a, b) for a, b in zip(lora, learner.lora_params))


def test_expert_iteration_then_ppo_runs_both_parts_in_one_step():
    learner = _tiny_learner(update="expert_iteration+ppo", advantage_estimator="rloo")
    metrics = learner.step(_tiny_batch([3, 1, 2, 0]))
    assert metrics["train/imitated"] == 2.0 and math.isfinite(metrics["train/policy_loss"])
    assert learner.steps_done == 1


def test_no_update_leaves_the_policy_and_the_critic_as_they_started_and_still_reports_the_step():
    """ppo.update none, the default: best-of-N, every sample from the untrained policy; the step is still counted
    (a resumed run knows where it is) and its rewards still logged."""
    learner = _tiny_learner(update="none")
    assert learner.config.update == PPOConfig().update == "none"
    weights = [p.detach().clone() for p in [*learner.lora_params, *learner.value_head.parameters()]]
    batch = _tiny_batch([3, 1, 2, 0])
    before = _token_logp(learner, batch)
    metrics = learner.step(batch)
    assert torch.equal(_token_logp(learner, batch), before)
    assert all(torch.equal(a, b) for a, b in zip(weights, [*learner.lora_params, *learner.value_head.parameters()]))
    assert metrics["train/reward_mean"] == 1.5 and "train/policy_loss" not in metrics and "train/imitated" not in metrics
    assert learner.steps_done == 1


def test_expert_iteration_needs_groups_of_two_or_more():
    with pytest.raises(ValueError, match="ppo.update 'expert_iteration' imitates .* group_size >= 2"):
        ppo.PPOLearner(model=None, config=_config(update="expert_iteration"), group_size=1)
