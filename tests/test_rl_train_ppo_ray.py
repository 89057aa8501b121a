"""The train_ppo_ray command for a GPU Ray cluster, checked by openrlhf's own argument parser."""

import pytest

from pipelines.config import ADVANTAGE_ESTIMATORS
from pipelines.rl.train_ppo_ray import build_train_ppo_ray_command, parse_train_ppo_ray_args


def _command(**overrides):
    kwargs = dict(
        pretrain="HuggingFaceTB/SmolLM2-135M-Instruct",
        prompt_data="runs/risk/prompts.jsonl",
        reward_file="rewards/openrlhf_reward.py",
        save_path="runs/risk/ckpt",
        input_key="meta_prompt",
    )
    return build_train_ppo_ray_command(**{**kwargs, **overrides})


def test_the_command_parses_with_openrlhfs_parser_and_keeps_every_value():
    argv = _command(
        actor_gpus=4,
        critic_gpus=2,
        ref_gpus=2,
        vllm_engines=2,
        micro_train_batch_size=2,
        train_batch_size=32,
        micro_rollout_batch_size=4,
        rollout_batch_size=16,
        n_samples_per_prompt=4,
        max_new_tokens=48,
        actor_lr=2e-5,
        critic_lr=3e-5,
        kl_coef=0.02,
        kl_target=0.1,
        lambd=0.9,
        lora_rank=16,
        wandb_project="tune-prompts",
        wandb_run_name="risk-ppo",
    )
    assert argv[:3] == ["python", "-m", "openrlhf.cli.train_ppo_ray"]
    args = parse_train_ppo_ray_args(argv)
    assert args.actor.model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert args.reward.remote_url == ["rewards/openrlhf_reward.py"]  # openrlhf splits it on commas
    assert args.reward.model_name_or_path is None
    assert args.data.prompt_dataset == "runs/risk/prompts.jsonl"
    assert args.data.input_key == "meta_prompt"
    assert args.data.apply_chat_template is True
    assert args.ckpt.output_dir == "runs/risk/ckpt"
    assert args.algo.advantage.estimator == "gae"
    assert args.critic.model_name_or_path == args.actor.model_name_or_path  # GAE: critic from the policy
    assert (args.actor.num_gpus_per_node, args.critic.num_gpus_per_node, args.ref.num_gpus_per_node) == (4, 2, 2)
    assert args.vllm.num_engines == 2
    assert (args.train.micro_batch_size, args.train.batch_size) == (2, 32)
    assert (args.rollout.micro_batch_size, args.rollout.batch_size) == (4, 16)
    assert args.rollout.n_samples_per_prompt == 4
    assert args.rollout.max_new_tokens == 48
    assert args.actor.adam.lr == 2e-5 and args.critic.adam.lr == 3e-5
    assert args.algo.kl.init_coef == 0.02 and args.algo.kl.target == 0.1
    assert args.algo.advantage.lambd == 0.9
    assert args.ds.lora.rank == 16 and args.ds.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert args.logger.wandb.project == "tune-prompts" and args.logger.wandb.run_name == "risk-ppo"
    assert args.logger.wandb.key == "env"  # truthy switches W&B on; the real key stays in WANDB_API_KEY


@pytest.mark.parametrize("estimator", [e for e in ADVANTAGE_ESTIMATORS if e != "gae"])
def test_every_estimator_the_config_offers_is_one_openrlhf_accepts(estimator):
    args = parse_train_ppo_ray_args(_command(advantage_estimator=estimator, n_samples_per_prompt=4))
    assert args.algo.advantage.estimator == estimator
    assert args.critic.model_name_or_path is None  # no critic without GAE


def test_without_wandb_the_command_leaves_wandb_off():
    args = parse_train_ppo_ray_args(_command())
    assert args.logger.wandb.key is None


@pytest.mark.parametrize(
    "argv_change, message",
    [
        (lambda argv: argv + ["--no_such_flag", "1"], "unrecognized arguments"),
        (lambda argv: argv + ["--algo.advantage.estimator", "ppo2"], "invalid choice"),
        (
            lambda argv: argv + ["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "1"],
            "n_samples_per_prompt > 1",
        ),
        (lambda argv: argv + ["--ds.ring_attn_size", "2"], "would rewrite"),  # openrlhf's silent rewrite
    ],
)
def test_openrlhfs_parser_rejections_come_back_as_errors(argv_change, message):
    with pytest.raises(ValueError, match=message):
        parse_train_ppo_ray_args(argv_change(_command()))


def test_an_unknown_estimator_is_refused_before_building():
    with pytest.raises(ValueError, match="advantage_estimator"):
        _command(advantage_estimator="ppo2")
