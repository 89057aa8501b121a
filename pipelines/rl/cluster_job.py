"""``tune-prompts --backend openrlhf``: the tuning job at scale, as openrlhf's ``train_ppo_ray`` on a GPU Ray cluster.

``prepare_job`` writes three files into the run folder, builds the ``python -m openrlhf.cli.train_ppo_ray``
command, checks it with openrlhf's real argument parser, and then prints it (``--dry-run``) or submits it as a
Ray job with the run folder as the job's working directory:

* ``meta_prompts.jsonl``: the prompt data set, ``{"input": <meta-prompt>}`` per line. The local loop rewrites
  the best instruction so far; openrlhf's data set is fixed, so it holds the seed instruction with each way the
  meta-prompt can describe a weakness: once with none measured yet, then once per weighted reward component
  named as the weakest. Each episode is one rollout over all of them.
* ``reward_func.py``: a copy of ``rewards/openrlhf_reward.py``, which openrlhf loads by path
  (``--reward.remote_url``) in its vLLM engine processes and which scores responses with the local loop's
  reward code (``CandidateScorer``);
* ``reward_settings.json``: what that file reads: the task (as validated here), target and judge models,
  dev examples, end tokens and the failure limit.

The command names these files relative to the run folder, because Ray uploads the run folder as the job's
working directory (and the project's packages, ``pipelines``, ``rewards`` and ``templates``, as py_modules).
The policy (``--actor.model_name_or_path``) is a model path or hub id that the cluster's nodes must be able
to load: for the embedded model, the cached Hugging Face folder on this machine. The training settings come
from the task, as in the local loop (``ppo`` and its seed, ``generation``, ``template.max_instruction_tokens``
for the response length); the run options add the episodes (``--steps``), the models and W&B.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

from pipelines.config import ConfigError, Endpoint, RunOptions, TaskConfig
from pipelines.generation import meta_prompt
from pipelines.rl.train_ppo_ray import build_train_ppo_ray_command, parse_train_ppo_ray_args
from rewards import openrlhf_reward
from rewards.openrlhf_reward import DEFAULT_END_TOKENS, DEFAULT_MAX_FAILURES, FAILURES_NAME, SETTINGS_NAME

PROMPTS_NAME = "meta_prompts.jsonl"
REWARD_NAME = "reward_func.py"
JOB_NAME = "openrlhf_job.json"
CKPT_NAME = "openrlhf_ckpt"
INPUT_KEY = "input"
REWARD_SOURCE = Path(openrlhf_reward.__file__)  # copied into the run folder as REWARD_NAME
JOB_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def meta_prompts(task: TaskConfig) -> list[str]:
    """The seed instruction with no weakness measured yet, then with each weighted component as the weakest."""
    instruction = task.template.seed_instruction
    prompts = [meta_prompt(task, instruction, {})]
    for name, weight in task.reward.weights.items():
        if weight > 0:
            prompts.append(meta_prompt(task, instruction, {name: 0.0}))  # one measured component: it is the weakest
    return list(dict.fromkeys(prompts))


def _pretrain(policy_model: str) -> str:
    from pipelines.engine.models import EMBEDDED, embedded_model_dir

    if policy_model == EMBEDDED:
        return str(embedded_model_dir())
    local = Path(policy_model).expanduser()
    return str(local.resolve()) if local.exists() else policy_model


def _command(task: TaskConfig, options: RunOptions, pretrain: str, n_prompts: int) -> list[str]:
    ppo, gen = task.ppo, task.generation
    wandb = {}
    if options.wandb_mode != "disabled":
        wandb = {"wandb_project": options.wandb_project, "wandb_org": options.wandb_entity,
                 "wandb_run_name": f"{task.name}-{Path(options.run_dir).name}"}
    return build_train_ppo_ray_command(
        pretrain=pretrain, prompt_data=PROMPTS_NAME, reward_file=REWARD_NAME, save_path=CKPT_NAME,
        input_key=INPUT_KEY, apply_chat_template=True, vllm_engines=1,
        # One rollout = every meta-prompt x candidates_per_step samples; one optimizer step per prompt group.
        rollout_batch_size=n_prompts, n_samples_per_prompt=gen.candidates_per_step,
        micro_rollout_batch_size=4, train_batch_size=gen.candidates_per_step,
        # the largest micro batch of at most 4 that divides the group (openrlhf accumulates whole micro batches)
        micro_train_batch_size=max(d for d in range(1, 5) if gen.candidates_per_step % d == 0),
        max_new_tokens=task.template.max_instruction_tokens, temperature=gen.temperature, top_p=gen.top_p,
        actor_lr=ppo.lr, critic_lr=ppo.critic_lr, kl_coef=ppo.kl_coef, kl_target=ppo.kl_target,
        advantage_estimator=ppo.advantage_estimator, gamma=ppo.gamma, lambd=ppo.lambd, eps_clip=ppo.clip_eps,
        max_epochs=ppo.ppo_epochs, num_episodes=options.steps, lora_rank=ppo.lora_rank, lora_alpha=ppo.lora_alpha,
        lora_target_modules=ppo.lora_target_modules, seed=ppo.seed, **wandb,
    )


def _source(source):
    """A model source as JSON (what rewards/openrlhf_reward.py::model_source reads back)."""
    return asdict(source) if isinstance(source, Endpoint) else source


def _reward_settings(task: TaskConfig, options: RunOptions) -> dict:
    return {
        "task": task.model_dump(mode="json"),
        "task_base_dir": str(task.base_dir),
        "target": _source(options.target),
        "judge": _source(options.judge),
        "dev_examples": options.dev_examples,
        "end_tokens": list(DEFAULT_END_TOKENS),
        "max_failures": DEFAULT_MAX_FAILURES,
    }


def _runtime_env(run_dir: Path, options: RunOptions) -> dict:
    import pipelines
    import rewards
    import templates

    packages = [str(Path(p.__file__).resolve().parent) for p in (pipelines, rewards, templates)]
    env = dict(JOB_ENV)
    if options.wandb_mode != "disabled":
        env["WANDB_MODE"] = options.wandb_mode
    return {"working_dir": str(run_dir), "py_modules": packages, "env_vars": env}


def _submit(address: str, command: list[str], runtime_env: dict, task: TaskConfig) -> str:
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
        return client.submit_job(entrypoint=shlex.join(command), runtime_env=runtime_env,
                                 metadata={"tune_prompts_task": task.name})
    except (ConnectionError, RuntimeError) as exc:  # unreachable, or the job server refused (Ray raises RuntimeError)
        raise ConfigError(
            f"cannot submit the job to the Ray cluster at {address!r}: {exc}. The job API listens on the "
            "dashboard's port (8265 by default): pass --ray-address http://HEAD:8265"
        ) from None


def _pretty(command: list[str]) -> str:
    """One flag and its values per line."""
    lines, current = [], []
    for token in command:
        if token.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(token))
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


def prepare_job(task: TaskConfig, options: RunOptions, *, dry_run: bool, json_output: bool) -> int:
    """Write the job's files into ``options.run_dir``, then print the command (dry run) or submit it to Ray."""
    if not dry_run and not options.ray_address:
        raise ConfigError(
            "--backend openrlhf submits openrlhf's train_ppo_ray to a GPU Ray cluster: pass its job address "
            "with --ray-address http://HEAD:8265, or use --dry-run to write the job's files and print the command"
        )
    # the cluster backend is the choice to train with PPO: a task's "none" (the local loop's best-of-N) gives way
    # to it, expert iteration is refused (train_ppo_ray has no supervised step)
    if task.ppo.update not in ("ppo", "none"):
        raise ConfigError(
            f"task {task.name!r} sets ppo.update to {task.ppo.update!r}, which openrlhf's train_ppo_ray does not "
            "run: set ppo.update to ppo for --backend openrlhf, or run the local loop (without --backend)"
        )
    run_dir = Path(options.run_dir).resolve()
    prompts = meta_prompts(task)
    command = _command(task, options, _pretrain(options.policy_model), len(prompts))
    try:
        parse_train_ppo_ray_args(command)  # openrlhf's own parser and checks, before anything is written
    except ValueError as exc:
        raise ConfigError(f"the train_ppo_ray command for task {task.name!r} is not accepted: {exc}") from None

    run_dir.mkdir(parents=True, exist_ok=True)
    files = {"prompt_data": run_dir / PROMPTS_NAME, "reward_file": run_dir / REWARD_NAME,
             "reward_settings": run_dir / SETTINGS_NAME}
    files["prompt_data"].write_text("".join(json.dumps({INPUT_KEY: p}) + "\n" for p in prompts), encoding="utf-8")
    shutil.copyfile(REWARD_SOURCE, files["reward_file"])
    files["reward_settings"].write_text(json.dumps(_reward_settings(task, options), indent=1), encoding="utf-8")
    runtime_env = _runtime_env(run_dir, options)
    job = {
        "task": task.name, "dry_run": dry_run, "ray_address": options.ray_address, "working_dir": str(run_dir),
        "command": command, "entrypoint": shlex.join(command), "files": {k: str(v) for k, v in files.items()},
        "meta_prompts": len(prompts), "runtime_env": runtime_env, "submission_id": None,
        "options": asdict(options),
    }
    if not dry_run:
        job["submission_id"] = _submit(options.ray_address, command, runtime_env, task)
    (run_dir / JOB_NAME).write_text(json.dumps(job, indent=1), encoding="utf-8")

    if json_output:
        print(json.dumps({k: job[k] for k in ("task", "dry_run", "ray_address", "submission_id", "working_dir",
                                              "files", "command", "entrypoint", "runtime_env")}, indent=2))
        return 0
    print(f"openrlhf job for task {task.name}: {len(prompts)} meta-prompts x {task.generation.candidates_per_step} "
          f"samples per episode, {options.steps} episodes")
    print(f"  working dir (the Ray job's working_dir): {run_dir}")
    print(f"  prompt data:     {files['prompt_data']}")
    print(f"  reward file:     {files['reward_file']}")
    print(f"  reward settings: {files['reward_settings']} (failures go to {run_dir / FAILURES_NAME})")
    print(f"  policy (--actor.model_name_or_path): {command[command.index('--actor.model_name_or_path') + 1]}"
          " (must be loadable on the cluster's nodes)")
    if dry_run:
        print(f"\ncommand (checked by openrlhf's parser; run it from {run_dir} on a GPU Ray cluster):\n"
              f"  {_pretty(command)}")
        print(f"\ndry run: nothing submitted; the job record is {run_dir / JOB_NAME}")
        return 0
    sid = job["submission_id"]
    print(f"\nsubmitted Ray job {sid} to {options.ray_address}")
    print(f"follow it:  ray job logs -f {sid} --address {options.ray_address}")
    print(f"status:     ray job status {sid} --address {options.ray_address}")
    print(f"stop it:    ray job stop {sid} --address {options.ray_address}")
    return 0
