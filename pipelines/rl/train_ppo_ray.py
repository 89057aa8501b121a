"""The same tuning job at scale: openrlhf's ``train_ppo_ray`` on a GPU Ray cluster (vLLM rollouts, DeepSpeed).

``build_train_ppo_ray_command`` writes the ``python -m openrlhf.cli.train_ppo_ray`` argv;
``parse_train_ppo_ray_args`` runs openrlhf's real argument parser and its checks on it, so a command that
openrlhf would refuse, or silently rewrite, fails here, before anything is submitted. openrlhf is imported
on the first parse, after the CPU stand-ins (``pipelines.rl.stand_ins``) are in place.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import logging
import sys
import types
from typing import Sequence

from pipelines.config import ADVANTAGE_ESTIMATORS

log = logging.getLogger(__name__)

TRAIN_PPO_RAY_MODULE = "openrlhf.cli.train_ppo_ray"


def build_train_ppo_ray_command(
    *,
    pretrain: str,
    prompt_data: str,
    reward_file: str,
    save_path: str,
    input_key: str = "input",
    apply_chat_template: bool = True,
    # One keyword per train_ppo_ray setting this project sets, so the argv below reads against this list.
    actor_gpus: int = 1,
    critic_gpus: int = 1,
    ref_gpus: int = 1,
    vllm_engines: int = 1,
    vllm_tensor_parallel_size: int = 1,
    colocate_all: bool = False,
    micro_train_batch_size: int = 4,
    train_batch_size: int = 64,
    micro_rollout_batch_size: int = 8,
    rollout_batch_size: int = 64,
    n_samples_per_prompt: int = 8,
    max_new_tokens: int = 64,
    max_len: int = 1024,
    temperature: float = 1.0,
    top_p: float = 1.0,
    actor_lr: float = 1e-5,
    critic_lr: float = 1e-5,
    kl_coef: float = 0.01,
    kl_target: float | None = None,
    advantage_estimator: str = "gae",
    gamma: float = 1.0,
    lambd: float = 0.95,
    eps_clip: float = 0.2,
    max_epochs: int = 1,
    num_episodes: int = 1,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    zero_stage: int = 2,
    seed: int = 42,
    wandb_project: str | None = None,
    wandb_run_name: str | None = None,
    wandb_org: str | None = None,
    wandb_group: str | None = None,
    wandb_key: str = "env",
    python: str = "python",
) -> list[str]:
    """argv of ``python -m openrlhf.cli.train_ppo_ray`` for this tuning job on a GPU Ray cluster.

    ``prompt_data`` is a JSONL file whose ``input_key`` holds the meta-prompt; ``reward_file`` is a Python file
    with ``reward_func(queries, prompts, labels)`` (openrlhf loads it through ``--reward.remote_url``).
    W&B logging is on when ``wandb_project`` is given. openrlhf switches it on by a truthy ``--logger.wandb.key``
    and logs in with that key only when wandb has none yet, so the default "env" keeps the real key in
    ``WANDB_API_KEY`` and off the command line.
    Every flag emitted exists in openrlhf 0.11.2's parser; tests run ``parse_train_ppo_ray_args`` on the result.
    """
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator {advantage_estimator!r} is not one of {ADVANTAGE_ESTIMATORS}")
    argv = [
        python, "-m", TRAIN_PPO_RAY_MODULE,
        "--actor.model_name_or_path", pretrain,
        "--data.prompt_dataset", prompt_data,
        "--data.input_key", input_key,
        "--reward.remote_url", reward_file,
        "--ckpt.output_dir", save_path,
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(actor_gpus),
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", str(ref_gpus),
        "--vllm.num_engines", str(vllm_engines),
        "--vllm.tensor_parallel_size", str(vllm_tensor_parallel_size),
        "--train.micro_batch_size", str(micro_train_batch_size),
        "--train.batch_size", str(train_batch_size),
        "--rollout.micro_batch_size", str(micro_rollout_batch_size),
        "--rollout.batch_size", str(rollout_batch_size),
        "--rollout.n_samples_per_prompt", str(n_samples_per_prompt),
        "--rollout.max_new_tokens", str(max_new_tokens),
        "--data.max_len", str(max_len),
        "--rollout.temperature", str(temperature),
        "--rollout.top_p", str(top_p),
        "--actor.adam.lr", str(actor_lr),
        "--algo.kl.init_coef", str(kl_coef),
        "--algo.advantage.estimator", advantage_estimator,
        "--algo.advantage.gamma", str(gamma),
        "--algo.advantage.lambd", str(lambd),
        "--actor.eps_clip", str(eps_clip),
        "--train.max_epochs", str(max_epochs),
        "--train.num_episodes", str(num_episodes),
        "--ds.zero_stage", str(zero_stage),
        "--ds.param_dtype", "bf16",
        "--train.seed", str(seed),
    ]
    if advantage_estimator == "gae":  # only GAE trains a critic (openrlhf drops it for the others)
        argv += ["--critic.num_nodes", "1", "--critic.num_gpus_per_node", str(critic_gpus)]
        argv += ["--critic.adam.lr", str(critic_lr)]
    if kl_target is not None:
        argv += ["--algo.kl.target", str(kl_target)]
    if lora_rank > 0:
        argv += ["--ds.lora.rank", str(lora_rank), "--ds.lora.alpha", str(lora_alpha)]
        argv += ["--ds.lora.target_modules", *lora_target_modules]
    if apply_chat_template:
        argv.append("--data.apply_chat_template")
    if colocate_all:
        argv += ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"]
    if wandb_project is not None:
        argv += ["--logger.wandb.key", wandb_key, "--logger.wandb.project", wandb_project]
        for flag, value in (("run_name", wandb_run_name), ("org", wandb_org), ("group", wandb_group)):
            if value is not None:
                argv += [f"--logger.wandb.{flag}", value]
    return argv


def _main_block(source: str, filename: str) -> types.CodeType:
    """The body of the module's ``if __name__ == "__main__":`` block, compiled as its own code."""
    tree = ast.parse(source)
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return compile(ast.Module(body=node.body, type_ignores=[]), filename, "exec")
    raise RuntimeError(f"{filename} has no `if __name__ == '__main__':` block; openrlhf's CLI layout changed")


def parse_train_ppo_ray_args(argv: Sequence[str]) -> types.SimpleNamespace:
    """Run openrlhf's real train_ppo_ray argument parser and its validation on ``argv``; return its args.

    openrlhf builds the parser inside ``if __name__ == "__main__":`` and ends that block with ``train(args)``.
    So the module is imported normally (with the CPU stand-ins), and that block's own code is executed on a
    copy of the module's namespace in which ``train`` only captures its argument: parser, ``hierarchize``
    and every check run unmodified. ``argv`` may start with ``python -m openrlhf.cli.train_ppo_ray``.
    Raises ValueError when the parser exits, a validation assertion fails, or openrlhf prints a
    "[Warning]" (it then rewrites an argument silently). Swaps ``sys.argv`` while it runs.
    """
    argv = list(argv)
    if TRAIN_PPO_RAY_MODULE in argv:
        argv = argv[argv.index(TRAIN_PPO_RAY_MODULE) + 1 :]
    from pipelines.rl.stand_ins import install_cpu_stand_ins

    install_cpu_stand_ins()
    module = importlib.import_module(TRAIN_PPO_RAY_MODULE)
    code = _main_block(inspect.getsource(module), module.__file__)
    captured: list[types.SimpleNamespace] = []
    namespace = dict(vars(module), __name__="__main__", train=captured.append)
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = [module.__file__, *argv]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            exec(code, namespace)
    except SystemExit as exc:
        raise ValueError(f"openrlhf's train_ppo_ray parser exited ({exc.code}): {stderr.getvalue().strip()}") from None
    except AssertionError as exc:
        raise ValueError(f"openrlhf's train_ppo_ray rejected the arguments: {exc}") from None
    finally:
        sys.argv = saved_argv
    printed = stdout.getvalue().splitlines()
    warnings = [line for line in printed if line.startswith("[Warning]")]
    if warnings:
        raise ValueError("openrlhf's train_ppo_ray would rewrite arguments: " + " | ".join(warnings))
    for line in printed:
        log.info("train_ppo_ray: %s", line)
    if len(captured) != 1:
        raise RuntimeError("openrlhf's train_ppo_ray main block did not reach train(args)")
    return captured[0]
