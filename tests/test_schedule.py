"""The scheduler: the cron matcher (table-driven), the tick logic with a scripted job client, and
`tune-prompts schedule` against a real local Ray head (job API, overlapping ticks skipped, SIGTERM)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines import cli
from pipelines.schedule import Cron, CronError, Scheduler, check_entrypoint, interval_ticks

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


# --- cron -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, when, matches", [
    ("0 3 * * *", datetime(2026, 11, 29, 3, 0), True),
    ("0 3 * * *", datetime(2026, 11, 29, 3, 1), False),
    ("*/15 * * * *", datetime(2026, 1, 1, 7, 45), True),
    ("*/15 * * * *", datetime(2026, 1, 1, 7, 50), False),
    ("5/20 * * * *", datetime(2026, 1, 1, 7, 45), True),  # 5, 25, 45
    ("0 9-17/4 * * *", datetime(2026, 1, 1, 13, 0), True),  # 9, 13, 17
    ("0 9-17/4 * * *", datetime(2026, 1, 1, 15, 0), False),
    ("0 0 1,15 * *", datetime(2026, 3, 15), True),
    ("0 0 * * 1-5", datetime(2026, 11, 29), False),  # a Sunday
    ("0 0 * * 0", datetime(2026, 11, 29), True),
    ("0 0 * * 7", datetime(2026, 11, 29), True),  # 7 is Sunday too
    ("0 0 13 * 5", datetime(2026, 11, 13), True),  # both day fields restricted: either matches (a Friday the 13th)
    ("0 0 13 * 5", datetime(2026, 11, 20), True),  # a Friday
    ("0 0 13 * 5", datetime(2026, 11, 19), False),
    ("30 2 * 2 *", datetime(2026, 3, 1, 2, 30), False),  # month
])
def test_cron_matches(expression, when, matches):
    assert Cron.parse(expression).matches(when) is matches


@pytest.mark.parametrize("expression, after, expected", [
    ("0 3 * * *", datetime(2026, 11, 29, 19, 45), datetime(2026, 11, 30, 3, 0)),
    ("0 3 * * *", datetime(2026, 11, 29, 3, 0), datetime(2026, 11, 30, 3, 0)),  # strictly after
    ("*/15 9-17 * * 1-5", datetime(2026, 11, 28, 19, 45), datetime(2026, 11, 30, 9, 0)),  # Saturday -> Monday
    ("0 0 29 2 *", datetime(2026, 3, 1), datetime(2028, 2, 29)),  # the next leap day
    ("59 23 31 12 *", datetime(2026, 12, 31, 23, 59, 30), datetime(2027, 12, 31, 23, 59)),
])
def test_cron_next_after(expression, after, expected):
    assert Cron.parse(expression).next_after(after) == expected


@pytest.mark.parametrize("expression, message", [
    ("0 3 * *", "has 4 fields"),
    ("60 * * * *", "minute field '60'"),
    ("* 24 * * *", "hour field"),
    ("* * 0 * *", "day-of-month"),
    ("* * * 13 *", "month"),
    ("* * * * 8", "day-of-week"),
    ("*/0 * * * *", "step must be at least 1"),
    ("5-1 * * * *", "low to high"),
    ("x * * * *", "is not a number"),
    ("0 0 31 4 *", "never matches"),  # April has 30 days (raised by next_after)
])
def test_cron_errors(expression, message):
    with pytest.raises(CronError, match=message):
        Cron.parse(expression).next_after(datetime(2026, 1, 1))


def test_interval_ticks_first_at_once_then_every_n_without_bunching():
    tick = interval_ticks(2.0)
    assert tick(100.0) == 100.0
    assert tick(100.5) == 102.0
    assert tick(110.0) == 110.0  # late (a long wait): the next tick is now, not a burst of missed ones


def test_check_entrypoint_quotes_arguments():
    assert check_entrypoint("risk", store="postgresql://u@db/x?options=-csearch_path=a b") == (
        ".venv/bin/tune-prompts check --task risk --split test --tune-if-below "
        "--store 'postgresql://u@db/x?options=-csearch_path=a b'")


# --- the tick logic with a scripted client -----------------------------------------------------------
class ScriptedClient:
    """Jobs run for `runs` status polls; other tasks' jobs and a foreign running job can be planted."""

    def __init__(self, runs: int = 2):
        self.runs = runs
        self.jobs: dict[str, dict] = {}

    def submit_job(self, entrypoint, submission_id, metadata):
        self.jobs[submission_id] = {"metadata": metadata, "left": self.runs, "entrypoint": entrypoint}
        return submission_id

    def _status(self, job):
        return "RUNNING" if job["left"] > 0 else "SUCCEEDED"

    def list_jobs(self):
        return [SimpleNamespace(submission_id=i, metadata=j["metadata"], status=SimpleNamespace(value=self._status(j)))
                for i, j in self.jobs.items()]

    def get_job_info(self, job_id):
        job = self.jobs[job_id]
        job["left"] -= 1
        return SimpleNamespace(status=SimpleNamespace(value=self._status(job)), message="done")

    def get_job_logs(self, job_id):
        return "loading ...\ncheck: production version 3 of risk holds on the test split (400 examples)\n"


def test_a_tick_while_the_tasks_job_runs_is_skipped(tmp_path):
    client = ScriptedClient(runs=2)
    client.jobs["other"] = {"metadata": {"tune_prompts_task": "sentiment"}, "left": 99, "entrypoint": "x"}
    lines = []
    s = Scheduler(client, "risk", "echo hi", interval_ticks(1), tmp_path / "schedule.jsonl", echo=lines.append)
    first = s.tick()
    assert first and s.tick() is None  # risk's job is running; sentiment's does not count
    s.poll()
    s.poll()  # the job finishes on the second poll
    assert s.tick() is not None
    events = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["submitted", "skipped", "finished", "submitted"]
    assert events[1]["running"] == [first]
    assert events[2]["status"] == "SUCCEEDED" and events[2]["outcome"].startswith("check: production version 3")
    assert any("skipped" in line and first in line for line in lines)  # readable lines on stdout too


def test_another_schedulers_job_for_the_task_also_blocks(tmp_path):
    client = ScriptedClient()
    client.jobs["elsewhere"] = {"metadata": {"tune_prompts_task": "risk"}, "left": 99, "entrypoint": "x"}
    s = Scheduler(client, "risk", "echo hi", interval_ticks(1), tmp_path / "log.jsonl", echo=lambda _: None)
    assert s.tick() is None and s.counts["skipped"] == 1


# --- a real Ray head ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_ray(temp_dir: str) -> None:
    """Stop the processes of this head only: those whose command line names its temp dir, and their children.
    (`ray stop --force` would also kill every other Ray on this machine.)"""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    procs = {p.pid: p for root in roots for p in [root, *root.children(recursive=True)]}
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="tpray")  # short: Ray's socket paths must fit in 107 characters
    dashboard = _free_port()
    command = [str(VENV_BIN / "ray"), "start", "--head", f"--port={_free_port()}", "--num-cpus=1",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
               f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=180, cwd=temp_dir)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        _stop_ray(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.e2e
def test_schedule_submits_jobs_and_skips_an_overlapping_tick(ray_head, tmp_path, capsys):
    # Each job sleeps 3 s, the ticks come every 2 s: a tick while a job runs must be skipped.
    job = f"{sys.executable} -c 'import time; time.sleep(3)'"
    code = cli.main(["schedule", "--task", "risk", "--ray-address", ray_head, "--every-s", "2", "--max-ticks", "5",
                     "--entrypoint", job, "--run-dir", str(tmp_path), "--poll-s", "0.5"])
    assert code == 0
    events = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    submitted = [e["job_id"] for e in events if e["event"] == "submitted"]
    finished = {e["job_id"]: e["status"] for e in events if e["event"] == "finished"}
    assert len(submitted) >= 2 and "skipped" in kinds and kinds[-1] == "stopped"
    assert finished == {job_id: "SUCCEEDED" for job_id in submitted}  # every job ran to the end, and was logged
    assert kinds.count("submitted") + kinds.count("skipped") == 5
    skipped = next(e for e in events if e["event"] == "skipped")
    assert skipped["running"][0] in submitted
    out = capsys.readouterr().out
    assert "skipped" in out and "SUCCEEDED" in out


@pytest.mark.e2e
def test_sigterm_stops_the_scheduler_cleanly(ray_head, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "schedule", "--task", "risk", "--ray-address", ray_head,
         "--cron", "0 3 * * *", "--entrypoint", "true", "--run-dir", str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while line and "next tick" not in line:  # waiting for 03:00
            line = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM: stopping the scheduler" in out
    events = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["stopped"] and events[0]["ticks"] == 0
