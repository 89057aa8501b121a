"""The local policy update: openrlhf's advantage estimators on tiny tensors, and PPO steps on the real
SmolLM2-135M-Instruct (marked e2e)."""

import dataclasses
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from pipelines.rl import ppo


@dataclasses.dataclass(frozen=True)
class Settings:
    """The fields the learner reads (ppo.PPO_CONFIG_FIELDS); a PPOConfig provides the same names."""

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lambd: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float | None = 0.5
    kl_coef: float = 0.05
    kl_target: float | None = None
    kl_horizon: int = 10000
    kl_estimator: str = "k1"
    ppo_epochs: int = 1
    minibatch_size: int = 4
    lr: float = 1e-3
    critic_lr: float = 1e-2
    max_grad_norm: float = 1.0
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    n_samples_per_prompt: int = 1
    reward_clip_range: tuple[float, float] = (-10.0, 10.0)
    seed: int = 0


def test_settings_cover_the_fields_the_learner_reads():
    assert {f.name for f in dataclasses.fields(Settings)} == set(ppo.PPO_CONFIG_FIELDS)


@pytest.mark.parametrize(
    "module, absent",
    [
        ("pipelines.rl.stand_ins", ("openrlhf", "vllm", "flash_attn", "peft")),
        ("pipelines.rl.ppo", ("openrlhf", "vllm", "flash_attn", "peft")),
        ("pipelines.rl.train_ppo_ray", ("openrlhf", "vllm", "flash_attn", "peft", "ray")),
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


def _estimate(estimator, rewards, kl=None, values=None, mask=None, kl_coef=0.0, **settings):
    from openrlhf.trainer.ppo_utils import FixedKLController

    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), 3, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    kl = torch.zeros(mask.shape) if kl is None else torch.tensor(kl, dtype=torch.float32)
    values = None if values is None else torch.tensor(values, dtype=torch.float32)
    config = Settings(advantage_estimator=estimator, **settings)
    return ppo.compute_advantages_and_returns(
        config, FixedKLController(kl_coef), rewards=rewards, kl=kl, values=values, action_mask=mask
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
    advantages, _, _ = _estimate(estimator, [1.0, 0.0, 2.0, 0.0], n_samples_per_prompt=4)
    # one scalar per sample, broadcast over its tokens (gamma = 1), not whitened
    torch.testing.assert_close(advantages, torch.tensor(expected).unsqueeze(1).expand(4, 3), atol=1e-5, rtol=1e-5)


def test_group_baselines_use_consecutive_rows_as_groups():
    advantages, _, _ = _estimate("dr_grpo", [1.0, 3.0, 10.0, 20.0], n_samples_per_prompt=2)
    assert advantages[:, 0].tolist() == [-1.0, 1.0, -5.0, 5.0]


def test_reinforce_baseline_subtracts_the_group_mean_then_whitens():
    advantages, _, _ = _estimate("reinforce_baseline", [1.0, 0.0, 2.0, 0.0], n_samples_per_prompt=4)
    centred = torch.tensor([0.25, -0.75, 1.25, -0.75]).unsqueeze(1).expand(4, 3)
    torch.testing.assert_close(advantages, _whiten(centred, torch.ones(4, 3, dtype=torch.bool)))


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"advantage_estimator": "ppo2"}, ValueError, "advantage_estimator"),
        ({"advantage_estimator": "rloo", "n_samples_per_prompt": 1}, ValueError, "n_samples_per_prompt >= 2"),
        ({"advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "gamma": 0.9}, ValueError, "gamma"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator"),
        ({"ppo_epochs": 0}, ValueError, "ppo_epochs"),
    ],
)
def test_a_bad_config_is_refused_at_construction(change, error, message):
    with pytest.raises(error, match=message):
        ppo.PPOLearner(model=None, config=Settings(**change))


def test_a_config_missing_fields_names_them():
    with pytest.raises(TypeError, match="lacks .*critic_lr"):
        ppo.PPOLearner(model=None, config=types.SimpleNamespace(advantage_estimator="gae"))


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
    learner = ppo.PPOLearner(model, Settings(n_samples_per_prompt=BATCH, minibatch_size=4))
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
    assert {p.dtype for n, p in params.items() if n not in trained.lora} == {torch.bfloat16}  # bf16 base
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
        assert metrics["train/kl_coef"] == Settings.kl_coef  # a fixed controller
        assert metrics["train/response_tokens_mean"] == batch.action_mask.sum(1).float().mean().item()
    assert first["train/return_mean"] == pytest.approx(first["train/reward_mean"])  # no KL charge yet
    assert trained.learner.steps_done == STEPS


@pytest.mark.e2e
def test_save_and_load_restore_the_policy_value_head_and_optimizers(trained, tmp_path):
    learner = trained.learner
    learner.save_adapter(tmp_path / "ckpt")
    model, _ = _load_policy_base()
    resumed = ppo.PPOLearner(model, Settings(n_samples_per_prompt=BATCH, minibatch_size=4))
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
def test_a_critic_free_estimator_runs_one_step_without_a_value_loss():
    model, tokenizer = _load_policy_base()
    learner = ppo.PPOLearner(model, Settings(advantage_estimator="rloo", n_samples_per_prompt=4, minibatch_size=8))
    batch = ppo.sample(learner.policy, tokenizer, [META_PROMPT] * 8, 16, 1.0, 1.0, seed=7)
    metrics = learner.step(batch.with_rewards(_reward(batch.texts)))
    assert "train/value_loss" not in metrics
    assert math.isfinite(metrics["train/policy_loss"]) and metrics["train/kl"] == 0.0
