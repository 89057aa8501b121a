"""The tuning loop end to end: the real small model, real Ray, promptbench, PPO, W&B offline files, SQLite."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines.cli import main

SMALL_TASK = str(Path(__file__).parent / "data" / "risk_small.yaml")
REPO = Path(__file__).resolve().parents[1]


def wandb_tables(run_dir: Path, name: str) -> list[dict]:
    """The W&B tables a run wrote offline, read back from its files."""
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    files = sorted((folder / "files" / "media" / "table").glob(f"{name}_*.table.json"),
                   key=lambda p: int(p.name.split("_")[1]))
    return [json.loads(p.read_text()) for p in files]


@pytest.mark.e2e
def test_tune_runs_end_to_end_and_fills_wandb_and_the_store(tmp_path, capsys, ray_session):
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'store.sqlite'}"
    code = main(["--task", SMALL_TASK, "--steps", "2", "--dev-examples", "0", "--finalists", "2",
                 "--run-dir", str(run_dir), "--store", store])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out test split" in out and "seed" in out
    # what production gets, for the seed and the chosen candidate: the figure, the rates with counts, every reason
    assert "under the calibrated decision" in out and "instruction_following_n" in out
    assert "the gate on each" in out and ("pass: instruction_following" in out or "fail: instruction_following" in out)

    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 2 and len(report["history"]) == 2
    for scalars in report["history"]:  # what each step logged: the samples' means, per component too
        for key in ("reward/total/mean", "reward/task_metric/mean", "reward/readability/mean",
                    "train/feasible_fraction", "train/best_reward", "timing/generate_s", "timing/score_s", "timing/update_s"):
            assert key in scalars, key
    # the default update is none (best-of-N): no step trains the policy (PPO through the loop:
    # test_local_folder_models.py and the expert iteration test below)
    assert "update none" in out
    assert not any(key in h for h in report["history"] for key in ("train/policy_loss", "train/kl", "train/sft_loss"))
    # ... and the small table the run prints at its end
    assert [row["step"] for row in report["learning"]] == [1, 2] and "learning: per step" in out
    for row in report["learning"]:
        assert 0 <= row["feasible_fraction"] <= 1 and row["mean_reward"] is not None and row["best_so_far"] is not None
    # the choice on dev: the seed and the 2 shortlisted candidates, every bar with its dev figure
    choice = report["choice"]
    assert "the choice on the whole dev split" in out
    names = [row["name"] for row in choice["ranking"]]
    assert "seed" in names and len(names) == 3
    for row in choice["ranking"]:
        if row["name"] != "seed" and row["valid"]:
            assert any(b.startswith(("pass: instruction_following", "fail: instruction_following")) for b in row["bars"])
            assert any("paired bootstrap over 24 dev examples" in b for b in row["bars"])
    assert report["test"][0]["template_name"] == "seed"
    if choice["chosen"]:  # only the chosen candidate is tested
        assert [r["template"] for r in report["test"][1:]] == [choice["chosen"]]
    else:
        assert len(report["test"]) == 1 and "no candidate beat the seed on dev; production unchanged" in out
    assert 0.0 <= report["test"][0]["balanced_accuracy"] <= 1.0
    for row in report["test"]:
        kept, total = map(int, row["instruction_following_n"].split("/"))
        assert total == 40 and row["instruction_following"] == pytest.approx(kept / total)  # every test answer
        assert any(reason.startswith(("pass: instruction_following", "fail: instruction_following"))
                   for reason in row["gate_reasons"])
        low, high = row["balanced_accuracy_ci95"]  # the bootstrap over the test examples, for the run report
        assert 0 <= low <= high <= 1 and len(row["samples"]) == 10

    # the per-step candidate tables, read back from the offline W&B files
    tables = wandb_tables(run_dir, "candidates")
    assert len(tables) == 2
    for table in tables:
        assert {"template", "valid", "tokens", "total_reward", "task_metric", "instruction_following"} <= set(table["columns"])
        assert len(table["data"]) == 4  # candidates per step
        texts = [row[table["columns"].index("template")] for row in table["data"]]
        assert all("{text}" in t or "Message:" in t for t in texts)
    assert len(wandb_tables(run_dir, "leaderboard")) == 1
    # ... which report.json keeps too, for the run report; and the page itself, drawn after report.json
    assert [c["step"] for c in report["candidates"]] == [1] * 4 + [2] * 4
    assert all(set(c) >= {"instruction", "total_reward", "task_metric", "instruction_following"} for c in report["candidates"])
    assert report["timings"]["timing/total_s"] > report["timings"]["timing/select_s"]
    from pipelines.run_report import SECTIONS

    page = (run_dir / "report.html").read_text()
    assert all(f'<section id="{name}">' in page for name in SECTIONS) and f"page: {run_dir / 'report.html'}" in out
    assert all(f'<figure id="fig-{name}">' in page for name in ("reward", "components", "test", "time"))
    assert page.count("<svg") == 4 and not any(f'{a}="{s}' in page for a in ("src", "href") for s in ("http", "//"))
    # a few sampled answers per candidate: what the model said and what the contract made of it
    answers = wandb_tables(run_dir, "answers")
    assert len(answers) == 2
    for table in answers:
        assert table["columns"] == ["step", "instruction", "input", "answer", "parsed", "contract_kept", "decision", "label"]
        valid = sum(r[tables[0]["columns"].index("valid")] for r in tables[0]["data"])
        assert len(table["data"]) >= 4 * min(1, valid) and all(isinstance(r[3], str) for r in table["data"])

    # the store: the seed became production; a chosen candidate was recorded with the gate's reasons
    from templates.store import TemplateStore

    with TemplateStore(store, create=False) as s:
        versions = s.list_versions("risk-small")
        assert len(versions) == (2 if choice["chosen"] else 1)
        if choice["chosen"]:
            candidate = versions[-1]
            assert candidate.parent_id == versions[0].id and candidate.decision.reasons
            assert "test" in candidate.scores and "latency_p95_ms" in candidate.latency
        else:
            assert report["promotion"]["promoted"] is False
            assert report["promotion"]["reasons"][0].startswith("no candidate beat the seed on dev")
        assert s.get_label("risk-small", "production") is not None


def test_stop_after_reaches_the_run_options_and_an_early_report_prints_what_ran(capsys):
    from pipelines.cli import build_parser
    from pipelines.cli_tune import print_final_table, tuning_setup

    args = build_parser().parse_args(["--task", SMALL_TASK, "--stop-after", "choice"])
    task, options = tuning_setup(args, None)
    assert options.stop_after == "choice"
    assert tuning_setup(build_parser().parse_args(["--task", SMALL_TASK]), None)[1].stop_after is None
    report = {"learning": [{"step": 1, "mean_reward": 0.5}], "choice": None, "test": [], "stopped_after": "steps",
              "run_dir": "runs/x", "wandb_folder": "runs/x/wandb/offline-run-1"}
    print_final_table(task, report)
    out = capsys.readouterr().out
    assert "stopped after the steps (--stop-after): no held-out test, gate or store" in out
    assert "learning: per step" in out and "runs/x/report.json" in out


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["choice", "steps"])
def test_stop_after_ends_the_run_early_reports_what_ran_and_writes_no_store(stop, tmp_path, capsys, ray_session):
    run_dir, store = tmp_path / "run", tmp_path / "store.sqlite"
    code = main(["--task", SMALL_TASK, "--steps", "1", "--dev-examples", "0", "--finalists", "1", "--stop-after", stop,
                 "--run-dir", str(run_dir), "--store", f"sqlite:///{store}"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["stopped_after"] == stop and report["steps"] == 1 and report["test"] == []
    assert [row["step"] for row in report["learning"]] == [1] and report["target_calls"] > 0
    assert f"stopped after the {stop} (--stop-after): no held-out test, gate or store" in out
    assert "held-out test split" not in out and not store.exists()
    if stop == "choice":  # the finalists with every bar, as a whole run shows them
        assert [row["name"] for row in report["choice"]["ranking"]].count("seed") == 1
        assert "the choice on the whole dev split" in out
    else:
        assert report["choice"] is None and "the choice" not in out


@pytest.mark.slow
def test_expert_iteration_runs_in_the_loop_and_its_steps_report_what_they_imitated(tmp_path, capsys, ray_session):
    """ppo.update: expert_iteration, set in a task file: the same loop, a supervised update instead of PPO's."""
    text = Path(SMALL_TASK).read_text().replace("ppo: {minibatch_size: 4, ppo_epochs: 1}",
                                                "ppo: {minibatch_size: 4, ppo_epochs: 1, update: expert_iteration}")
    assert "update: expert_iteration" in text
    task_file = tmp_path / "risk_small_expert_iteration.yaml"  # its data comes from a package, not a path
    task_file.write_text(text)
    run_dir = tmp_path / "run"
    code = main(["--task", str(task_file), "--steps", "2", "--dev-examples", "0", "--stop-after", "steps",
                 "--run-dir", str(run_dir)])
    assert code == 0, capsys.readouterr().out
    first, last = json.loads((run_dir / "report.json").read_text())["history"]
    assert 0 <= first["train/imitated"] <= 4 and "train/kl" not in first and "train/policy_loss" not in first
    assert "train/imitated" not in last  # the last step's update is deferred, as PPO's is


@pytest.mark.slow
def test_a_policy_that_draws_only_what_it_drew_before_ends_the_steps_and_says_so(tmp_path, capsys, ray_session):
    """Near-greedy sampling (temperature 0.01) draws one instruction again and again: the second step finds
    nothing new, so the run does not spend its third step; it chooses among what it found."""
    text = Path(SMALL_TASK).read_text().replace("generation: {candidates_per_step: 4}",
                                                "generation: {candidates_per_step: 4, temperature: 0.01}")
    assert "temperature: 0.01" in text
    task_file = tmp_path / "risk_small_greedy.yaml"
    task_file.write_text(text)
    run_dir = tmp_path / "run"
    code = main(["--task", str(task_file), "--steps", "3", "--dev-examples", "0", "--stop-after", "steps",
                 "--run-dir", str(run_dir)])
    out = capsys.readouterr()
    assert code == 0, out.out
    report = json.loads((run_dir / "report.json").read_text())
    assert [h["train/new_fraction"] for h in report["history"]] == [0.25, 0.0]  # 1 of 4 samples new, then none
    assert report["steps"] == 2 and report["stopped"] == "collapsed: step 2 drew only instructions drawn before"
    assert "stopping after step 2 of 3: the policy drew only instructions it had drawn before" in out.out + out.err


@pytest.mark.e2e
def test_a_dead_scoring_actor_is_replaced_and_the_step_completes(ray_session):
    import ray

    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.ray_scoring import ScoringPool, init_ray

    task = load_task(SMALL_TASK)
    splits = load_splits(task)
    init_ray()
    pool = ScoringPool(task, splits, target="embedded:smollm2-135m-instruct", num_workers=1)
    pool.wait_ready()
    texts = [task.seed_template().text, task.compose("Flag prizes, urgent payments and premium numbers as scams.")]
    first_pid = ray.get(pool.workers[0].ready.remote())
    result = {}
    worker = threading.Thread(target=lambda: result.update(measured=pool.measure(texts)))
    worker.start()
    time.sleep(1.0)  # the measure call is running in the actor now
    ray.kill(pool.workers[0])
    worker.join(timeout=240)
    assert not worker.is_alive()
    measured = [s.measured for s in result["measured"]]
    assert [m.valid for m in measured] == [True, True] and all(0 <= m.metrics["roc_auc"] <= 1 for m in measured)
    assert pool.replaced == 1 and ray.get(pool.workers[0].ready.remote()) != first_pid
    pool.shutdown()


def test_a_pool_started_right_after_another_shut_down_gets_all_its_workers(ray_session):
    import ray

    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.ray_scoring import ScoringPool, init_ray

    task = load_task(SMALL_TASK)
    splits = load_splits(task)
    init_ray()
    cpus = int(ray.cluster_resources()["CPU"])
    for _ in range(2):  # without the wait in shutdown the second pool finds CPUs still held: fewer workers
        pool = ScoringPool(task, splits, target="embedded:smollm2-135m-instruct", num_workers=cpus)
        assert len(pool.workers) == cpus
        pool.wait_ready()
        pool.shutdown()


@pytest.mark.slow
def test_resume_completes_a_run_killed_after_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # --update ppo: a checkpoint then holds a trained adapter and a deferred update, which the resumed run applies
    cmd = [sys.executable, "-m", "pipelines.cli", "--task", SMALL_TASK, "--steps", "3", "--update", "ppo",
           "--dev-examples", "0", "--finalists", "1", "--run-dir", str(run_dir), "--no-store"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = run_dir / "checkpoint" / "state.json"
    deadline = time.time() + 400
    while time.time() < deadline and not (state.exists() and json.loads(state.read_text())["step"] >= 1):
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.5)
    # the driver and everything it started (its Ray head and workers), and nothing else: `ray stop --force` would
    # also kill every other Ray on this machine, a bench's or this test session's own
    import psutil

    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=10)
    killed_at = json.loads(state.read_text())["step"]
    assert 1 <= killed_at < 3 and not (run_dir / "report.json").exists()

    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming {run_dir} after step {killed_at}" in done.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 3 and len(report["history"]) == 3
