"""The local policy update: sampling from the policy and PPO on a LoRA adapter, with openrlhf's own code, or
expert iteration (``ppo.update``): a supervised step on each group's best samples, alone or before PPO.

What runs here, and whose code it is:

* openrlhf's own code, used for real: ``Actor`` (log-probs of the response tokens, temperature-scaled like
  the sampler), ``compute_approx_kl``, ``PolicyLoss`` (clipped PPO), ``ValueLoss`` (clipped value loss),
  ``masked_mean``, ``AdaptiveKLController`` / ``FixedKLController``, and
  ``RemoteExperienceMaker.compute_advantages_and_returns`` for every advantage estimator openrlhf offers
  (GAE, REINFORCE, the group baselines and FlashREINFORCE's batch baseline), which itself calls openrlhf's
  ``compute_reward`` (reward on the last response token, minus the KL penalty on every token).
* Written here because openrlhf's versions need CUDA, DeepSpeed or Ray on every step: the LoRA policy with
  its reference (the same weights with the adapter switched off), the value head, sampling with HF
  ``generate``, the minibatch loop with plain AdamW, and checkpoints.
* A group's responses to one prompt (the loop's batches) are scored with the prompt run once
  (``pipelines.rl.shared_prompt``: ``Actor``'s log-probs, equal in float32), and sampled from its cached keys
  and values. For risk's 24 samples (a 152-token prompt, up to 48 response tokens), in bfloat16 on 2 cores, an
  update took 10.3 s instead of 35.9 s and sampling 10.3 s instead of 16.1 s. Any other batch goes through
  ``Actor`` whole.

Nothing here runs on import: openrlhf (after the CPU stand-ins of ``pipelines.rl.stand_ins``), peft and
transformers are imported on first use. The module is longer than 400 lines because the sampler, the
rollout record and the learner share one tensor layout (left-padded prompts, the response in the last R
columns), which is easier to keep right when they sit together.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import types
from pathlib import Path
from typing import Sequence

import torch

from pipelines.config import PPOConfig
from pipelines.engine.usage import Usage
from pipelines.rl import shared_prompt
from pipelines.rl.stand_ins import install_cpu_stand_ins

# These subtract a baseline computed over the samples of one prompt (consecutive rows of a batch), so they
# need at least two samples per prompt; the learner checks its group_size against them. flash_reinforce is
# not one of them: its baseline is the mean over the whole batch.
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def _openrlhf() -> types.SimpleNamespace:
    """The openrlhf pieces the learner uses, imported once the stand-ins are in place."""
    install_cpu_stand_ins()
    from openrlhf.models import Actor, PolicyLoss, ValueLoss
    from openrlhf.models.utils import compute_approx_kl, masked_mean
    from openrlhf.trainer.ppo_utils import AdaptiveKLController, Experience, FixedKLController
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.utils.config import hierarchize

    return types.SimpleNamespace(
        Actor=Actor,
        PolicyLoss=PolicyLoss,
        ValueLoss=ValueLoss,
        compute_approx_kl=compute_approx_kl,
        masked_mean=masked_mean,
        AdaptiveKLController=AdaptiveKLController,
        FixedKLController=FixedKLController,
        Experience=Experience,
        RemoteExperienceMaker=RemoteExperienceMaker,
        hierarchize=hierarchize,
    )


# --------------------------------------------------------------------------------------------------
# Rollouts
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Sampled responses and the tensors the learner needs; B samples, T = P + R tokens.

    ``sequences`` holds each prompt left-padded to P tokens, then R response slots; a response ends at its
    first stop token (kept) and the slots after it hold the pad id. So the response tokens are always the
    last R columns, which is where openrlhf's ``Actor`` reads action log-probs.
    """

    prompts: list[str]
    texts: list[str]  # decoded responses, special tokens dropped
    sequences: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64: 1 on prompt tokens and on response tokens up to the stop token
    action_mask: torch.Tensor  # (B, R) bool: the response tokens that were sampled (stop token included)
    truncated: torch.Tensor  # (B,) bool: hit max_new_tokens before a stop token
    temperature: float  # the sampling temperature; the learner scores log-probs at the same temperature
    rewards: torch.Tensor | None = None  # (B,) float, one scalar per sample, set by the caller

    def usage(self) -> Usage:
        """What sampling cost, counted as a server would bill it: a call per response, its prompt's tokens and the
        response's tokens (pipelines/engine/usage.py)."""
        prompt_width = self.sequences.shape[1] - self.action_mask.shape[1]
        return Usage(len(self.texts), int(self.attention_mask[:, :prompt_width].sum()), int(self.action_mask.sum()))

    def with_rewards(self, rewards: Sequence[float] | torch.Tensor) -> "RolloutBatch":
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if rewards.numel() != len(self.texts):
            raise ValueError(f"got {rewards.numel()} rewards for {len(self.texts)} samples")
        if not torch.isfinite(rewards).all():
            raise ValueError(f"rewards must be finite (give invalid candidates a penalty instead): {rewards.tolist()}")
        return dataclasses.replace(self, rewards=rewards)


def _stop_token_ids(model, tokenizer) -> list[int]:
    # The generation config names the chat end-of-turn token (<|im_end|> for SmolLM2); the GGUF-loaded
    # tokenizer's own eos can differ, so both count as stops.
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the model's generation config nor the tokenizer names an end-of-sequence token")
    return ids


def sample(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> RolloutBatch:
    """One sampled response per prompt (repeat a prompt to get several), each prompt in the chat template.

    ``model`` is the policy (``PPOLearner.policy``). The global torch RNG is left as it was.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0: PPO needs sampled responses and their log-probs at that temperature")
    if not prompts:
        raise ValueError("no prompts to sample from")
    stop_ids = _stop_token_ids(model, tokenizer)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in prompts
    ]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):  # left padding: every response starts at column `width`
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1

    # the loop's groups repeat one prompt: its keys and values are computed once and handed to generate, which
    # then runs only the prompt's last token for each row (the RNG draws are the same either way)
    same = width > 1 and shared_prompt.one_prompt(input_ids, prompt_mask, 0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        cached = {"past_key_values": shared_prompt.prompt_cache(model, input_ids[:1, : width - 1], len(encoded))[0]
                  } if same else {}
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,  # no top-k cut: only temperature and top_p shape the distribution, as in openrlhf's rollouts
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            **cached,
        )
    response = sequences[:, width:]
    is_stop = torch.isin(response, torch.tensor(stop_ids))
    # Tokens up to and including the first stop token were sampled; what follows is padding.
    action_mask = (is_stop.long().cumsum(dim=1) - is_stop.long()) == 0
    texts = [tokenizer.decode(r[m], skip_special_tokens=True).strip() for r, m in zip(response, action_mask)]
    return RolloutBatch(
        prompts=list(prompts),
        texts=texts,
        sequences=sequences,
        attention_mask=torch.cat([prompt_mask, action_mask.long()], dim=1),
        action_mask=action_mask,
        truncated=~is_stop.any(dim=1),
        temperature=float(temperature),
    )


# --------------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------------


class PPOLearner:
    """PPO on a LoRA adapter of a causal LM, with openrlhf's losses, KL penalty and advantage estimators.

    * Policy: ``model`` (bf16) gets LoRA adapters (peft) on ``config.lora_target_modules``. The adapter weights
      are fp32 while the base stays bf16: an update of lr * ~1 on a bf16 weight of size ~1 would mostly round
      away (bf16 keeps 8 bits of mantissa); fp32 adapters keep every small step. Only the adapter trains.
      The learner takes ownership of ``model`` (peft injects the adapter layers into it).
    * Reference for the KL penalty: the same weights with the adapter disabled (``disable_adapter()``), i.e. the
      frozen starting policy, without a second copy of the weights.
    * Critic (GAE only): a fp32 value head (LayerNorm + Linear, zero-initialised so the first values are 0) on the
      reference pass's detached last hidden states. The features are fixed per rollout, so the critic is cheap
      to train for several epochs; it learns a value function over frozen features rather than a full critic LM.
    * The model stays in eval mode: no dropout, so the first PPO ratio is exactly 1 (the usual RLHF practice).
    * ``group_size``: samples per prompt, as consecutive rows of every batch; the group estimators take their
      baseline over each such group, and expert iteration picks each group's best samples.
    * ``config.update``: PPO, expert iteration (``_imitate``: no critic, no ratio, no KL term; the samples it
      imitates are the policy's own, so the text stays in its distribution), expert iteration then PPO, or none:
      ``step`` changes nothing, so every sample comes from the untrained policy (best-of-N). The adapter is still
      made (its B matrices start at zero, so the policy is the base model's), which keeps checkpoints alike.
    """

    def __init__(self, model, config: PPOConfig, *, group_size: int) -> None:
        needed = 2 if config.advantage_estimator in GROUP_ESTIMATORS else 1
        if group_size < needed:
            raise ValueError(
                f"group_size is {group_size}, but advantage_estimator {config.advantage_estimator!r} needs "
                f"group_size >= {needed} samples per prompt (generation.candidates_per_step in the loop)"
            )
        if config.update not in ("ppo", "none") and group_size < 2:
            raise ValueError(
                f"group_size is {group_size}, but ppo.update {config.update!r} imitates the samples above their "
                "group's mean reward, which needs group_size >= 2 samples per prompt (generation.candidates_per_step)"
            )
        import peft

        self.config = config
        self.group_size = group_size
        self._orl = _openrlhf()
        lora = peft.LoraConfig(
            task_type=peft.TaskType.CAUSAL_LM,
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.lora_target_modules),
            lora_dropout=0.0,
            bias="none",
        )
        # LoRA's A matrices start random; seeded here (without touching the caller's RNG), so that a run with the
        # same ppo.seed starts from the same policy. torch seeds its global generator at random in each process.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.policy = peft.get_peft_model(model, lora, autocast_adapter_dtype=True)  # bf16 adapter -> fp32
        self.lora_params = [p for p in self.policy.parameters() if p.requires_grad]
        for p in self.lora_params:
            p.data = p.data.float()  # make the fp32 adapter explicit whatever peft's autocast does
        self.policy.eval()

        # openrlhf's Actor computes the action log-probs. Wrapping an nn.Module skips its loading branch,
        # which is where packing_samples would be set; packing needs flash-attn, so it is off.
        self.actor = self._orl.Actor(self.policy)
        self.actor.packing_samples = False
        self.actor.eval()

        hidden = self.policy.config.hidden_size
        with torch.random.fork_rng(devices=[]):  # Linear draws its (zeroed) start: leave the caller's RNG as it was
            self.value_head = torch.nn.Sequential(
                torch.nn.LayerNorm(hidden, elementwise_affine=False), torch.nn.Linear(hidden, 1)
            )
        torch.nn.init.zeros_(self.value_head[1].weight)
        torch.nn.init.zeros_(self.value_head[1].bias)

        self.actor_optim = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=0.0)
        self.critic_optim = torch.optim.AdamW(self.value_head.parameters(), lr=config.critic_lr, weight_decay=0.0)
        self.policy_loss = self._orl.PolicyLoss(clip_eps_low=config.clip_eps, clip_eps_high=config.clip_eps)
        self.value_loss = self._orl.ValueLoss(clip_eps=config.value_clip_eps)
        if config.kl_target:
            self.kl_ctl = self._orl.AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
        else:
            self.kl_ctl = self._orl.FixedKLController(config.kl_coef)
        self.steps_done = 0
        self.pending: RolloutBatch | None = None  # a rewarded batch whose update waits (``defer``)

    # ---- one PPO step ---------------------------------------------------------------------------
    def defer(self, batch: RolloutBatch) -> None:
        """Keep a rewarded batch for the next ``step`` instead of updating now: a run's last step, whose update
        would change only samples the run never draws. The checkpoint keeps it, so a run resumed for more steps
        learns from it first."""
        if batch.rewards is None:
            raise ValueError("the batch has no rewards; use batch.with_rewards(...)")
        self.pending = batch

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One update on a rewarded batch (a deferred batch first, if one is owed), as ``config.update`` says:
        PPO (``_ppo``), expert iteration's supervised step (``_imitate``), the supervised step then PPO, or
        nothing (none: best-of-N; the step is counted all the same)."""
        if self.pending is not None:
            owed, self.pending = self.pending, None
            self.step(owed)
        start = time.perf_counter()
        if batch.rewards is None:
            raise ValueError("the batch has no rewards; use batch.with_rewards(...)")
        n = batch.sequences.size(0)
        if batch.rewards.shape != (n,):
            raise ValueError(f"rewards must have shape ({n},), one per sample; got {tuple(batch.rewards.shape)}")
        if n % self.group_size:
            raise ValueError(f"batch of {n} is not a multiple of group_size={self.group_size} (samples per prompt)")
        self.actor.temperature = batch.temperature  # log-probs of the distribution the sampler drew from
        metrics = {"train/reward_mean": batch.rewards.float().mean().item(),
                   "train/response_tokens_mean": batch.action_mask.sum(dim=-1).float().mean().item()}
        if self.config.update not in ("ppo", "none"):  # none: best-of-N, the policy stays as it started
            metrics.update(self._imitate(batch))
        if self.config.update not in ("expert_iteration", "none"):
            metrics.update(self._ppo(batch))
        self.steps_done += 1
        metrics["timing/update_s"] = time.perf_counter() - start
        return metrics

    def _imitate(self, batch: RolloutBatch) -> dict[str, float]:
        """Expert iteration's supervised step: raise the log-likelihood of each group's best samples (the highest
        rewards, at most ``expert_top_k``, each above its group's mean and ended by a stop token), ``expert_epochs``
        passes of minibatches, the per-token mean negative log-likelihood, AdamW on the adapter. A group whose
        samples all score alike teaches nothing and is skipped."""
        cfg, rewarded = self.config, batch.rewards
        assert rewarded is not None  # step() refused a batch without rewards
        groups = rewarded.float().view(-1, self.group_size)
        chosen = []
        for g, rewards in enumerate(groups):
            above = (rewards > rewards.mean()) & ~batch.truncated.view(-1, self.group_size)[g]
            order = torch.argsort(rewards, descending=True, stable=True)
            chosen += [g * self.group_size + int(i) for i in order if above[i]][: cfg.expert_top_k]
        metrics = {"train/imitated": float(len(chosen))}
        if not chosen:
            return {**metrics, "train/sft_loss": math.nan}
        idx = torch.tensor(chosen)
        seq, attn, amask = batch.sequences[idx], batch.attention_mask[idx], batch.action_mask[idx].bool()
        shuffle = torch.Generator().manual_seed(cfg.seed + self.steps_done)
        losses = []
        for _ in range(cfg.expert_epochs):
            for part in torch.randperm(len(chosen), generator=shuffle).split(cfg.minibatch_size):
                logp, _ = self._log_probs(seq[part], amask[part], attn[part])  # with grad
                loss = -self._orl.masked_mean(logp, amask[part], dim=-1).mean()
                self.actor_optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.lora_params, cfg.max_grad_norm)
                self.actor_optim.step()
                losses.append(loss.item())
        return {**metrics, "train/sft_loss": _mean(losses), "train/imitated_reward_mean":
                rewarded[idx].float().mean().item()}

    def _ppo(self, batch: RolloutBatch) -> dict[str, float]:
        """Score the rollouts (old, reference, values), shape rewards, estimate advantages, then update."""
        cfg, orl = self.config, self._orl
        start = time.perf_counter()
        seq, attn, amask = batch.sequences, batch.attention_mask, batch.action_mask.bool()
        n = seq.size(0)

        # experience: old log-probs (policy), reference log-probs (adapter off) and values, without grad
        with torch.no_grad():
            old_logp, _ = self._log_probs(seq, amask, attn)
            with self.policy.disable_adapter():
                ref_logp, features = self._log_probs(seq, amask, attn, hidden=True)
            assert features is not None  # asked for (hidden=True)
            old_values = self._values(features, amask)
        kl = orl.compute_approx_kl(old_logp, ref_logp, kl_estimator=cfg.kl_estimator)
        kl_per_sample = orl.masked_mean(kl, amask, dim=-1)
        kl_coef = self.kl_ctl.value
        advantages, returns, episode_returns = compute_advantages_and_returns(
            cfg, self.kl_ctl, group_size=self.group_size, rewards=batch.rewards, kl=kl, values=old_values,
            action_mask=amask,
        )
        experience_s = time.perf_counter() - start

        # ppo_epochs passes of shuffled minibatches: policy (LoRA) step, then value-head step
        shuffle = torch.Generator().manual_seed(cfg.seed + self.steps_done)
        stats: dict[str, list[float]] = {
            k: [] for k in ("policy_loss", "clipfrac", "ppo_kl", "grad_norm", "value_loss")
        }
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(n, generator=shuffle).split(cfg.minibatch_size):
                logp, _ = self._log_probs(seq[idx], amask[idx], attn[idx])  # with grad
                loss, clipfrac, ppo_kl, _, _ = self.policy_loss(
                    logp, old_logp[idx], advantages[idx], action_mask=amask[idx]
                )
                self.actor_optim.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.lora_params, cfg.max_grad_norm)
                self.actor_optim.step()
                stats["policy_loss"].append(loss.item())
                stats["clipfrac"].append(clipfrac.item())
                stats["ppo_kl"].append(ppo_kl.item())
                stats["grad_norm"].append(grad_norm.item())
                if cfg.advantage_estimator == "gae":
                    values = self._values(features[idx], amask[idx])
                    vloss = self.value_loss(values, old_values[idx], returns[idx], action_mask=amask[idx])
                    self.critic_optim.zero_grad(set_to_none=True)
                    vloss.backward()
                    torch.nn.utils.clip_grad_norm_(self.value_head.parameters(), cfg.max_grad_norm)
                    self.critic_optim.step()
                    stats["value_loss"].append(vloss.item())

        # the KL controller sees the rollout KL, as openrlhf's trainer does after each step
        kl_mean = kl_per_sample.mean().item()
        self.kl_ctl.update(kl_mean, n)
        metrics = {
            "train/policy_loss": _mean(stats["policy_loss"]),
            "train/kl": kl_mean,
            "train/kl_coef": kl_coef,
            "train/return_mean": episode_returns.mean().item(),
            "train/advantage_mean": orl.masked_mean(advantages, amask, dim=None).item(),
            "train/clipfrac": _mean(stats["clipfrac"]),
            "train/ppo_kl": _mean(stats["ppo_kl"]),
            "train/grad_norm": _mean(stats["grad_norm"]),
            "timing/experience_s": experience_s,
        }
        if stats["value_loss"]:  # only GAE has a critic
            metrics["train/value_loss"] = _mean(stats["value_loss"])
            metrics["train/value_mean"] = orl.masked_mean(old_values, amask, dim=None).item()
        return metrics

    def _log_probs(self, seq: torch.Tensor, amask: torch.Tensor, attn: torch.Tensor, *, hidden: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The action log-probs of the policy as it is now (under ``disable_adapter``: the reference), and with
        ``hidden`` the critic's features: the last hidden state before each response token (position t - 1 for
        token t, as in openrlhf's critic). A batch whose rows share one prompt (the loop's groups) runs the prompt
        once (``shared_prompt``); any other through openrlhf's ``Actor`` on the whole sequences."""
        if shared_prompt.one_prompt(seq, attn, amask.size(1)):
            return shared_prompt.action_log_probs(self.policy, seq, amask, attn, self.actor.temperature, hidden=hidden)
        if not hidden:
            return self.actor(seq, amask, attention_mask=attn, use_cache=False), None
        logp, out = self.actor(seq, amask, attention_mask=attn, return_output=True, output_hidden_states=True,
                               use_cache=False)
        return logp, out.hidden_states[-1][:, :-1][:, -amask.size(1) :].float()

    def _values(self, features: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        return self.value_head(features).squeeze(-1) * action_mask

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_adapter(self, path: str | Path) -> Path:
        """Adapter (peft format: adapter_config.json + adapter_model.safetensors), value head, optimizers, KL coef."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(path))
        torch.save(
            {
                "value_head": self.value_head.state_dict(),
                "actor_optim": self.actor_optim.state_dict(),
                "critic_optim": self.critic_optim.state_dict(),
                "kl_coef": float(self.kl_ctl.value),
                "steps_done": self.steps_done,
                "pending": None if self.pending is None else dataclasses.asdict(self.pending),
            },
            path / "learner_state.pt",
        )
        return path

    def load_adapter(self, path: str | Path) -> None:
        """Restore what ``save_adapter`` wrote into this learner (same base model and LoRA settings)."""
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        path = Path(path)
        state_file = path / "learner_state.pt"
        if not state_file.is_file():
            raise FileNotFoundError(f"{state_file} does not exist; is {path} a folder written by save_adapter?")
        result = set_peft_model_state_dict(self.policy, load_peft_weights(str(path)))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"adapter in {path} does not fit this model: unexpected keys {result.unexpected_keys[:5]}")
        state = torch.load(state_file, weights_only=True)
        self.value_head.load_state_dict(state["value_head"])
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.critic_optim.load_state_dict(state["critic_optim"])
        self.kl_ctl.value = state["kl_coef"]
        self.steps_done = state["steps_done"]
        pending = state.get("pending")  # absent in a checkpoint from before deferred updates
        self.pending = RolloutBatch(**pending) if pending else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _experience_maker(config: PPOConfig, kl_ctl, group_size: int, orl: types.SimpleNamespace):
    """openrlhf's ``RemoteExperienceMaker`` made without its constructor, for its advantage method alone.

    Why: the constructor wants Ray actor groups, vLLM engines and a DeepSpeed strategy, none of which the
    local update has; but ``compute_advantages_and_returns`` reads only ``self.strategy.args``,
    ``self.advantage_estimator``, ``self.kl_ctl`` and two helpers (``get_advantages_and_returns`` for GAE,
    ``get_cumulative_returns`` for the REINFORCE family) that do not touch the instance. So the instance is
    given exactly those, with ``args`` built by openrlhf's own ``hierarchize`` from the CLI's dotted names,
    and the method runs unmodified.
    """
    args = orl.hierarchize(
        argparse.Namespace(
            **{
                "algo.advantage.estimator": config.advantage_estimator,
                "algo.advantage.gamma": float(config.gamma),
                "algo.advantage.lambd": float(config.lambd),
                "algo.advantage.no_std_norm": False,
                "rollout.n_samples_per_prompt": group_size,
                "reward.clip_range": tuple(config.reward_clip_range),
                "reward.overlong_buffer_len": None,  # length penalties: off (the reward function owns them)
                "reward.stop_properly_penalty_coef": None,
            }
        )
    )
    maker = orl.RemoteExperienceMaker.__new__(orl.RemoteExperienceMaker)
    maker.strategy = types.SimpleNamespace(args=args)
    maker.args = args
    maker.advantage_estimator = config.advantage_estimator
    maker.kl_ctl = kl_ctl
    return maker


def compute_advantages_and_returns(
    config: PPOConfig,
    kl_ctl,
    *,
    group_size: int,
    rewards: torch.Tensor,
    kl: torch.Tensor,
    values: torch.Tensor | None,
    action_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """openrlhf's ``RemoteExperienceMaker.compute_advantages_and_returns``, unmodified, on one batch.

    ``rewards`` (B,), ``kl`` and ``values`` (B, R) per response token (``values`` None without a critic),
    ``action_mask`` (B, R). Returns advantages (B, R), returns (B, R) and each sample's shaped return (B,):
    the reward on its last response token minus the KL penalty summed over its tokens.

    The method subtracts the group baseline of rloo / reinforce_baseline / group_norm / dr_grpo over groups
    of ``group_size`` consecutive rows (flash_reinforce: the mean of the whole batch), applies
    ``compute_reward`` with the controller's current coefficient, runs GAE or cumulative returns, and
    whitens the advantages for gae / reinforce / reinforce_baseline.
    """
    orl = _openrlhf()
    n = rewards.numel()
    experience = orl.Experience(
        action_mask=action_mask.bool(),
        values=values if values is not None else torch.zeros_like(kl),
        kl=kl,
        rewards=rewards.float().clone(),
        index=list(range(n)),
    )
    (experience,) = _experience_maker(config, kl_ctl, group_size, orl).compute_advantages_and_returns([experience])
    return experience.advantages, experience.returns, experience.info["return"].float()
