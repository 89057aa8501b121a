"""`tune-prompts --backend openrlhf`: the job's files, its command (parsed by openrlhf's real parser), its
submission, and the reward file as openrlhf itself loads and calls it.

The reward file is loaded by openrlhf's own loader (``SingleTurnAgentExecutor(remote_rm_url=...)``) and, in the
e2e test, called through openrlhf's own ``SingleTurnAgentExecutor.execute``: only the vLLM engine is a scripted
stand-in that "generates" a fixed reply (vLLM does not run on a CPU). openrlhf decodes prompt + reply into the
query, calls ``reward_func`` and turns the result into an ``Experience`` as in training.
"""

import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.config import load_task
from pipelines.rl import cluster_job
from pipelines.rl.stand_ins import install_cpu_stand_ins
from pipelines.rl.train_ppo_ray import parse_train_ppo_ray_args

REPO = Path(__file__).resolve().parent.parent
REPLY = "Decide whether this SMS message is a scam asking for money, a prize claim or a premium-rate call."


def _dry_run(run_dir: Path, *extra: str) -> int:
    return main(["--task", "risk", "--backend", "openrlhf", "--dry-run", "--run-dir", str(run_dir), *extra])


def _job(run_dir: Path) -> dict:
    return json.loads((run_dir / cluster_job.JOB_NAME).read_text())


def _edit_settings(run_dir: Path, **changes) -> Path:
    path = run_dir / cluster_job.SETTINGS_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def _executor(reward_file: Path):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    executor = SingleTurnAgentExecutor(remote_rm_url=str(reward_file))
    assert executor.reward_func is not None, "openrlhf did not load reward_func from the file"
    return executor


@pytest.fixture(autouse=True)
def _no_settings_env(monkeypatch):
    monkeypatch.delenv("TUNE_PROMPTS_REWARD_SETTINGS", raising=False)


# --- the job: files and command -----------------------------------------------------------------------


def test_dry_run_writes_the_files_and_prints_a_command_openrlhfs_parser_accepts(tmp_path, capsys):
    from pipelines.engine.models import embedded_model_dir

    run_dir = tmp_path / "run"
    assert _dry_run(run_dir) == 0
    out = capsys.readouterr().out
    command = _job(run_dir)["command"]
    assert "python -m openrlhf.cli.train_ppo_ray" in out and "dry run: nothing submitted" in out
    assert str(run_dir / "reward_func.py") in out and str(run_dir / "meta_prompts.jsonl") in out

    args = parse_train_ppo_ray_args(command)
    # Paths are relative to the run folder, which is the Ray job's working directory.
    assert [run_dir / url for url in args.reward.remote_url] == [run_dir / "reward_func.py"]
    assert (run_dir / args.data.prompt_dataset) == run_dir / "meta_prompts.jsonl"
    assert args.data.input_key == "input" and args.data.apply_chat_template
    assert args.actor.model_name_or_path == str(embedded_model_dir())
    assert args.vllm.num_engines >= 1
    assert args.rollout.n_samples_per_prompt == load_task("risk").generation.candidates_per_step == 24
    assert args.train.batch_size % args.train.micro_batch_size == 0  # whole micro batches per optimizer step

    # The reward file is the project's reward file; its settings describe the task.
    assert (run_dir / "reward_func.py").read_text() == (REPO / "rewards" / "openrlhf_reward.py").read_text()
    settings = json.loads((run_dir / "reward_settings.json").read_text())
    assert settings["task"]["name"] == "risk" and settings["dev_examples"] == 100 and settings["max_failures"] == 5
    records = [json.loads(line) for line in (run_dir / "meta_prompts.jsonl").read_text().splitlines()]
    prompts = [r["input"] for r in records]
    assert len(prompts) == len(set(prompts)) == args.rollout.batch_size >= 4
    assert all(set(r) == {"input"} and "Read the SMS message below." in r["input"] for r in records)
    assert "none measured yet" in prompts[0] and "it barely separates the two labels" in prompts[1]


def test_the_seed_and_the_response_length_come_from_the_task(tmp_path, capsys):
    from pipelines.config import RunOptions, load_task

    task = load_task("risk").with_overrides(**{"ppo.seed": 7, "template.max_instruction_tokens": 40})
    run_dir = tmp_path / "run"
    assert cluster_job.prepare_job(task, RunOptions(run_dir=str(run_dir)), dry_run=True, json_output=True) == 0
    args = parse_train_ppo_ray_args(_job(run_dir)["command"])
    assert args.train.seed == 7 and args.rollout.max_new_tokens == 40


def test_the_reward_file_gets_the_run_s_model_sources_back(tmp_path, capsys):
    """A served target reaches the reward file as the same Endpoint, so it builds the scorer the loop would."""
    from pipelines.config import EMBEDDED, Endpoint, RunOptions, load_task
    from rewards.openrlhf_reward import model_source

    served = Endpoint("http://gpu-node:8000/v1", "HuggingFaceTB/SmolLM2-135M-Instruct", "VLLM_KEY")
    run_dir = tmp_path / "run"
    options = RunOptions(run_dir=str(run_dir), target=served, judge=EMBEDDED)
    assert cluster_job.prepare_job(load_task("risk"), options, dry_run=True, json_output=True) == 0
    settings = json.loads((run_dir / "reward_settings.json").read_text())
    assert settings["target"] == {"url": served.url, "model": served.model, "api_key_env": "VLLM_KEY", "max_concurrency": 4,
                                  "timeout_s": 30.0, "max_retries": 3, "top_logprobs": 20, "deadline_s": 60.0,
                                  "max_retry_after_s": 10.0, "breaker_failures": 8}
    assert model_source(settings["target"]) == served and model_source(settings["judge"]) == EMBEDDED


def test_json_output_names_the_command_files_and_ray_address(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _dry_run(run_dir, "--json", "--candidates", "4") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is True and report["ray_address"] is None and report["submission_id"] is None
    assert report["files"] == {"prompt_data": str(run_dir / "meta_prompts.jsonl"),
                               "reward_file": str(run_dir / "reward_func.py"),
                               "reward_settings": str(run_dir / "reward_settings.json")}
    assert all(Path(p).is_file() for p in report["files"].values())
    assert report["entrypoint"] == shlex.join(report["command"])
    assert parse_train_ppo_ray_args(report["command"]).rollout.n_samples_per_prompt == 4


def test_the_default_update_none_gives_way_to_ppo_on_the_cluster_and_ppo_builds_the_same_job(tmp_path):
    """The local default is best-of-N (ppo.update none); --backend openrlhf is the choice to train with PPO."""
    from pipelines.config import RunOptions, load_task

    task = load_task("risk")
    assert task.ppo.update == "none"
    commands = []
    for name, chosen in (("default", task), ("ppo", task.with_overrides(**{"ppo.update": "ppo"}))):
        run_dir = tmp_path / name / "run"
        assert cluster_job.prepare_job(chosen, RunOptions(run_dir=str(run_dir)), dry_run=True, json_output=True) == 0
        commands.append([part.replace(str(run_dir), "RUN") for part in _job(run_dir)["command"]])
    assert commands[0] == commands[1]
    assert parse_train_ppo_ray_args(commands[0]).train.seed == task.ppo.seed


def test_expert_iteration_is_refused_for_the_cluster_job_before_anything_is_written(tmp_path):
    from pipelines.config import ConfigError, RunOptions, load_task

    task = load_task("risk").with_overrides(**{"ppo.update": "expert_iteration"})
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="ppo.update .*'expert_iteration'.* set ppo.update to ppo"):
        cluster_job.prepare_job(task, RunOptions(run_dir=str(run_dir)), dry_run=True, json_output=True)
    assert not run_dir.exists()


def test_without_a_ray_address_and_without_dry_run_it_exits_2_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--task", "risk", "--backend", "openrlhf", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "GPU Ray cluster" in err and "--ray-address" in err and "--dry-run" in err
    assert not run_dir.exists()


def test_submission_sends_the_checked_command_with_the_run_folder_as_working_dir(tmp_path, capsys, monkeypatch):
    import ray.job_submission

    calls = []

    class RecordingClient:  # Ray's JobSubmissionClient needs a running dashboard; this records what it is given
        def __init__(self, address):
            calls.append(("address", address))

        def submit_job(self, **kwargs):
            calls.append(("submit", kwargs))
            return "raysubmit_test123"

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", RecordingClient)
    run_dir = tmp_path / "run"
    address = "http://head.example:8265"
    assert main(["--task", "risk", "--backend", "openrlhf", "--run-dir", str(run_dir), "--ray-address", address]) == 0
    out = capsys.readouterr().out
    assert f"ray job logs -f raysubmit_test123 --address {address}" in out
    (_, got_address), (_, submitted) = calls
    job = _job(run_dir)
    assert got_address == address and job["submission_id"] == "raysubmit_test123"
    assert submitted["entrypoint"] == shlex.join(job["command"])
    env = submitted["runtime_env"]
    assert env["working_dir"] == str(run_dir)
    assert sorted(Path(p).name for p in env["py_modules"]) == ["pipelines", "rewards", "templates"]
    assert env["env_vars"]["WANDB_MODE"] == "offline"


# --- the reward file, loaded and called by openrlhf ------------------------------------------------------


class ScriptedEngine:
    """Stands in for a vLLM engine: 'generates' a fixed reply, ended by the chat end-of-turn token."""

    def __init__(self, tokenizer, reply: str):
        self.token_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        self.text = reply

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = types.SimpleNamespace(token_ids=self.token_ids, text=self.text, finish_reason="stop", logprobs=None)
        return types.SimpleNamespace(outputs=[out])


@pytest.mark.e2e
def test_openrlhf_scores_a_real_rollout_with_the_same_reward_as_the_local_scorer(tmp_path):
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.generation import candidate_text
    from pipelines.engine.models import load_causal_lm, load_tokenizer
    from pipelines.scoring import build_scorer

    run_dir = tmp_path / "run"
    assert _dry_run(run_dir) == 0
    overrides = {"scoring.robustness_examples": 4, "scoring.robustness_attacks": ["checklist"]}
    _edit_settings(run_dir, dev_examples=16, task_overrides=overrides)
    meta = json.loads((run_dir / "meta_prompts.jsonl").read_text().splitlines()[1])["input"]
    tokenizer = load_tokenizer()
    # What openrlhf's PromptDataset makes of a record with --data.apply_chat_template.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": meta}], tokenize=False, add_generation_prompt=True)

    executor = _executor(run_dir / "reward_func.py")
    params = types.SimpleNamespace(max_tokens=48, logprobs=None)
    output = asyncio.run(executor.execute(prompt, "", params, 1024, tokenizer, ScriptedEngine(tokenizer, REPLY)))

    # The reward the local loop's scorer gives the same candidate.
    task = load_task("risk").with_overrides(**overrides)
    scorer = build_scorer(task, load_splits(task), load_causal_lm(), reward_examples=16)  # the file's dev_examples
    from pipelines.racing import race_candidates

    # one candidate is not raced: measured on the whole sample as the task's second rung measures (a screen, for risk)
    (scored,), _ = race_candidates(task, scorer, [candidate_text(task, REPLY)])
    expected = scored.reward
    assert expected.valid

    assert output["reward"] is not None, "openrlhf got no reward (an exception in reward_func is logged at INFO only)"
    assert output["reward"].shape == (1,) and float(output["reward"][0]) == pytest.approx(expected.total, abs=1e-6)
    assert float(output["scores"][0]) == pytest.approx(expected.total, abs=1e-6)
    logs = output["extra_logs"]
    assert set(logs) == {"reward/valid", *(f"reward/{name}" for name in scorer.components)}
    assert float(logs["reward/valid"][0]) == 1.0
    for name, value in expected.components.items():
        assert float(logs[f"reward/{name}"][0]) == pytest.approx(0.0 if value is None else value, abs=1e-6)

    # openrlhf turns the response into a training Experience without complaint.
    install_cpu_stand_ins()
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    experience = SamplesGenerator._process_response_into_experience(None, output, max_len=1024)
    assert experience.rewards.shape == (1,) and experience.info["reward/valid"].shape == (1,)
    assert not (run_dir / "reward_failures.jsonl").exists()

    # An unusable reply is no failure: it earns the task's invalid penalty, like in the local loop.
    bad = asyncio.run(executor.execute(prompt, "", params, 1024, tokenizer, ScriptedEngine(tokenizer, "Use {text} {x}")))
    assert float(bad["reward"][0]) == task.reward.invalid_penalty and float(bad["extra_logs"]["reward/valid"][0]) == 0.0


def _failures(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "reward_failures.jsonl").read_text().splitlines()]


def test_a_query_that_does_not_start_with_its_prompt_is_logged_filed_and_raised(tmp_path, caplog):
    run_dir = tmp_path / "run"
    assert _dry_run(run_dir) == 0
    executor = _executor(run_dir / "reward_func.py")
    with caplog.at_level(logging.ERROR, logger="tune_prompts.reward"), pytest.raises(ValueError, match="does not start"):
        asyncio.run(executor._fetch_rewards_via_func(["something else entirely"], ["<|im_start|>user\nhi"], [""]))
    errors = [r for r in caplog.records if r.name == "tune_prompts.reward" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    (failure,) = _failures(run_dir)
    assert "does not start with its prompt" in failure["error"] and failure["queries"] == ["something else entirely"]


def test_a_settings_file_naming_an_unknown_task_fails_every_call_until_the_limit(tmp_path, caplog, capsys):
    run_dir = tmp_path / "run"
    assert _dry_run(run_dir) == 0
    _edit_settings(run_dir, task="no-such-task", max_failures=3)
    executor = _executor(run_dir / "reward_func.py")
    for _ in range(2):  # below max_failures: raised, not exited
        with caplog.at_level(logging.ERROR, logger="tune_prompts.reward"), pytest.raises(ValueError, match="unknown task"):
            executor.reward_func(["<p>reply"], ["<p>"], [""])
    assert len([r for r in caplog.records if r.levelno == logging.ERROR and r.name == "tune_prompts.reward"]) == 2
    assert "reward_func FAILED (2)" in capsys.readouterr().err
    assert [f["failure"] for f in _failures(run_dir)] == [1, 2]


def test_at_max_failures_the_process_exits_with_status_3(tmp_path):
    """In a subprocess, as in a vLLM engine actor: openrlhf's loader, one failure, max_failures=1."""
    run_dir = tmp_path / "run"
    assert _dry_run(run_dir) == 0
    elsewhere = tmp_path / "elsewhere" / "settings.json"  # TUNE_PROMPTS_REWARD_SETTINGS overrides the location
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps({**json.loads((run_dir / "reward_settings.json").read_text()), "max_failures": 1}))
    script = ("import sys\nfrom openrlhf.utils.agent import SingleTurnAgentExecutor\n"
              "SingleTurnAgentExecutor(remote_rm_url=sys.argv[1]).reward_func(['not the prompt'], ['prompt'], [''])\n"
              "print('still running')")
    env = {**os.environ, "TUNE_PROMPTS_REWARD_SETTINGS": str(elsewhere), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script, str(run_dir / "reward_func.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "still running" not in done.stdout
    assert "max_failures=1" in done.stderr and "exiting with status 3" in done.stderr
    assert len(_failures(elsewhere.parent)) == 1 and not (run_dir / "reward_failures.jsonl").exists()


def test_an_unreachable_cluster_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    # Nothing listens on port 9 (discard) of this machine: Ray's client cannot reach a job server there.
    code = main(["--task", "risk", "--backend", "openrlhf", "--run-dir", str(tmp_path / "run"),
                 "--ray-address", "http://127.0.0.1:9"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot submit the job to the Ray cluster at 'http://127.0.0.1:9'" in err and "8265" in err


@pytest.mark.slow  # long generated answers; the classification reward file is in the default tier
def test_the_reward_file_scores_a_generation_task_as_the_local_scorer_does(tmp_path):
    """Both kinds reach OpenRLHF: a JSON-contract task's candidate gets the local scorer's reward."""
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import load_causal_lm, load_tokenizer
    from pipelines.generation import candidate_text
    from pipelines.scoring import build_scorer

    task_file = str(REPO / "tests" / "data" / "transactions_json.yaml")
    run_dir = tmp_path / "run"
    assert main(["--task", task_file, "--backend", "openrlhf", "--dry-run", "--run-dir", str(run_dir)]) == 0
    overrides = {"scoring.robustness_attacks": ["checklist"]}
    _edit_settings(run_dir, task_overrides=overrides)
    reply = "Extract the merchant, the amount and the channel of the transaction."
    prompt = load_tokenizer().apply_chat_template([{"role": "user", "content": "write an instruction"}], tokenize=False,
                                                  add_generation_prompt=True)
    executor = _executor(run_dir / "reward_func.py")
    (reward,) = executor.reward_func([prompt + reply], [prompt], [""])["rewards"]

    task = load_task(task_file).with_overrides(**overrides)
    (scored,) = build_scorer(task, load_splits(task), load_causal_lm()).measure([candidate_text(task, reply)])
    assert scored.reward.valid and "field_exact_match" in scored.measured.metrics
    assert float(reward) == pytest.approx(scored.reward.total, abs=1e-6)
