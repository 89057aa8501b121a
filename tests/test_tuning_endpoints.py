"""The tuning loop against served models: the loopback OpenAI-compatible server (tests/openai_compat_server.py)
running the real embedded model in its own process, as target and judge over HTTP, with real Ray, PPO, W&B
offline files and SQLite. The server is killed mid-run and restarted; ``--resume`` completes the run."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines.cli import main

SERVED_TASK = str(Path(__file__).parent / "data" / "risk_served.yaml")  # lowercase answers: see the file
SERVER = Path(__file__).with_name("openai_compat_server.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    """The loopback server in its own process (so it can be killed), one torch thread; waits until it serves."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # --max-logprobs 200 (vLLM allows raising it): with 200 alternatives every capitalisation of yes/no is named,
    # so the server's label log-probs are the in-process scorer's (with OpenAI's 20, rare forms such as " YES"
    # fall out and log-odds move by up to 0.05 here)
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--name", "smollm2", "--dtype", "float32",
                             "--max-logprobs", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    line = proc.stdout.readline()  # "serving smollm2 at http://127.0.0.1:PORT/v1" once the model is loaded
    assert line.startswith("serving smollm2 at"), line
    return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow  # two real tuning runs; eval and predict over a server are in the default tier
def test_tuning_a_served_model_survives_the_servers_death_and_matches_in_process(tmp_path, capsys, ray_session):
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'store.sqlite'}"
    args = ["--task", SERVED_TASK, "--steps", "2", "--dev-examples", "8", "--finalists", "1",
            "--target-url", url, "--target-model", "smollm2", "--judge-url", url, "--judge-model", "smollm2",
            "--max-concurrency", "4", "--request-timeout", "20", "--max-retries", "2", "--top-logprobs", "200",
            "--run-dir", str(run_dir), "--store", store, "--json"]
    server = start_server(port)
    state = run_dir / "checkpoint" / "state.json"
    killed = threading.Event()

    def kill_after_step_1():
        while not killed.is_set():
            if state.exists() and json.loads(state.read_text())["step"] >= 1:
                kill(server)
                killed.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_after_step_1, daemon=True)
    watcher.start()
    try:
        code = main(args)
        err = capsys.readouterr().err
        killed.set()
        # the server died in step 2: retries, then one line naming the server and how to continue
        assert code == 2, err
        (line,) = [x for x in err.splitlines() if x.startswith("error:")]
        assert f"POST {url}/chat/completions failed 3 times" in line and "connection failed" in line
        assert f"The run stopped after step 1 of 2; its checkpoint is in {run_dir}" in line
        assert f"--resume --run-dir {run_dir}" in line and not (run_dir / "report.json").exists()

        server = start_server(port)  # the server is back
        assert main(args + ["--resume"]) == 0, capsys.readouterr().err
    finally:
        killed.set()
        kill(server)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 2 and len(report["history"]) == 2 and report["stopped"] is None
    assert report["promotion"] and len(report["test"]) == (2 if report["choice"]["chosen"] else 1)
    spent = report["usage"]["total"]
    # The resumed run's actors start with empty caches: the shortlist from step 1 and the seed are asked again,
    # so the run costs more than the estimate of an uninterrupted one (tests/test_budget.py checks that one).
    assert spent["target"]["calls"] >= 0.9 * report["estimate"]["for_steps_run"]["target"]["calls"]
    assert spent["target"]["prompt_tokens"] > 0 and spent["target"]["completion_tokens"] > 0  # the server's usage
    assert spent["judge"]["calls"] > 0 and spent["policy"]["calls"] == 2 * 3

    # the run's held-out figures (scored over HTTP) against the same templates scored in-process on the same examples
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import load_causal_lm
    from pipelines.scoring import build_scorer

    task = load_task(SERVED_TASK)
    splits = load_splits(task)
    scorer = build_scorer(task, splits, load_causal_lm(dtype="float32"))
    positives = sum(e.label == task.positive_label for e in splits.test)
    negatives = len(splits.test) - positives
    for row in report["test"]:  # within the endpoint tests' tolerance: ROC-AUC one discordant pair, one answer
        here = scorer.evaluate(row["template"], "test", latency=False).measured
        assert abs(row["roc_auc"] - here.metrics["roc_auc"]) <= 1 / (positives * negatives) + 1e-9
        assert row["instruction_following_n"] == "{}/{}".format(*here.rates["instruction_following"])
        assert abs(row["balanced_accuracy"] - here.metrics["balanced_accuracy"]) <= 0.5 / min(positives, negatives) + 1e-9
