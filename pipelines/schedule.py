"""Scheduled check-and-tune jobs on a Ray cluster: `tune-prompts schedule`.

At each tick (a 5-field cron expression, or every N seconds) the scheduler submits one Ray job through the
cluster's job API (the dashboard address, http://HEAD:8265): by default
``.venv/bin/tune-prompts check --task TASK --split test --tune-if-below --store URL``, which checks the
production template on fresh data and starts a tuning run only when it falls below its bars. The job runs on the head in the
folder where Ray was started (ray_cluster.yaml starts it in ~/tune-prompts, where that path resolves).

Never two at once for one task: a tick while a job for the task is still PENDING or RUNNING on the cluster
(submitted by this scheduler or any other, found by the job's ``tune_prompts_task`` metadata) is skipped and
logged. Every event (tick, submitted, skipped, finished with status and the job's last log line, stopped)
goes as one JSON line to ``<run folder>/schedule.jsonl`` and as a readable line to stdout.
SIGINT/SIGTERM end the wait and return; a job already running on the cluster keeps running (its id is logged).

``Cron`` is a small matcher: minute hour day-of-month month day-of-week, each ``*``, a number, ``a-b``,
``*/n``, ``a-b/n``, ``a/n`` or a comma list of those; day-of-week 0-7 with 0 and 7 both Sunday. As in cron,
when both day fields are restricted a day matches if either does. Times are local.
"""

from __future__ import annotations

import json
import shlex
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Callable

ACTIVE = ("PENDING", "RUNNING")
FINISHED = ("SUCCEEDED", "FAILED", "STOPPED")
TASK_KEY = "tune_prompts_task"  # job metadata key that ties a job to its task


class ScheduleError(RuntimeError):
    """The scheduler cannot reach the cluster's job API; the message names the address and the fix."""


class CronError(ValueError):
    """A cron expression that cannot be parsed; the message names the field and the fix."""


_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12), ("day-of-week", 0, 7))


def _parse_field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        spec, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if spec == "*":
                start, end = low, high
            elif "-" in spec:
                a, b = spec.split("-", 1)
                start, end = int(a), int(b)
            else:
                start = int(spec)
                end = high if step_text else start  # "5/15": from 5 to the end, every 15
        except ValueError:
            raise CronError(f"cron {name} field {text!r}: {part!r} is not a number, a-b range, * or step /n") from None
        if step < 1:
            raise CronError(f"cron {name} field {text!r}: the step must be at least 1")
        if not (low <= start <= end <= high):
            raise CronError(f"cron {name} field {text!r}: {part!r} must lie within {low}-{high}, low to high")
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday ... 6 = Saturday
    any_day: bool  # day-of-month is *
    any_weekday: bool  # day-of-week is *

    @classmethod
    def parse(cls, expression: str) -> "Cron":
        fields = expression.split()
        if len(fields) != 5:
            raise CronError(f"cron {expression!r} has {len(fields)} fields; give 5: minute hour day-of-month month "
                            "day-of-week, e.g. '0 3 * * *' for 03:00 every day")
        parsed = [_parse_field(text, *spec) for text, spec in zip(fields, _FIELDS)]
        weekdays = frozenset(d % 7 for d in parsed[4])
        return cls(*parsed[:4], weekdays, fields[2].startswith("*"), fields[4].startswith("*"))

    def day_matches(self, when: datetime) -> bool:
        day_ok = when.day in self.days
        weekday_ok = (when.weekday() + 1) % 7 in self.weekdays
        if self.any_day or self.any_weekday:
            return day_ok and weekday_ok
        return day_ok or weekday_ok

    def matches(self, when: datetime) -> bool:
        return (when.minute in self.minutes and when.hour in self.hours and when.month in self.months
                and self.day_matches(when))

    def next_after(self, when: datetime) -> datetime:
        """The first whole minute strictly after ``when`` that matches."""
        t = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t + timedelta(days=366 * 5)  # every valid expression matches within 5 years (Feb 29 included)
        while t < limit:
            if t.month not in self.months:
                t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
            elif not self.day_matches(t):
                t = t.replace(hour=0, minute=0) + timedelta(days=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0) + timedelta(hours=1)
            elif t.minute not in self.minutes:
                t += timedelta(minutes=1)
            else:
                return t
        raise CronError("cron expression never matches a real date (e.g. day 31 of a 30-day month)")


def interval_ticks(every_s: float) -> Callable[[float], float]:
    """Ticks every ``every_s`` seconds, the first one at once."""
    state = {"next": None}

    def next_tick(now: float) -> float:
        state["next"] = now if state["next"] is None else max(now, state["next"] + every_s)
        return state["next"]

    return next_tick


def cron_ticks(cron: Cron) -> Callable[[float], float]:
    return lambda now: cron.next_after(datetime.fromtimestamp(now)).timestamp()


def check_entrypoint(task: str, *, command: str = ".venv/bin/tune-prompts", store: str | None = None,
                     split: str = "test", extra: tuple[str, ...] = ()) -> str:
    """The job's shell command: check the production template, tune if it fell below its bars."""
    argv = [*shlex.split(command), "check", "--task", task, "--split", split, "--tune-if-below", *extra]
    if store:
        argv += ["--store", store]
    return shlex.join(argv)


class Scheduler:
    """Submits ``entrypoint`` at each tick through ``client`` (a ``ray.job_submission.JobSubmissionClient``)."""

    def __init__(self, client, task: str, entrypoint: str, next_tick: Callable[[float], float], log_path: Path, *,
                 poll_s: float = 1.0, echo: Callable[[str], None] = print, stop: threading.Event | None = None):
        self.client = client
        self.task = task
        self.entrypoint = entrypoint
        self.next_tick = next_tick
        self.log_path = Path(log_path)
        self.poll_s = poll_s
        self.echo = echo
        self.stop = stop or threading.Event()
        self.watching: dict[str, str] = {}  # job id -> last status seen, for jobs this scheduler submitted
        self.counts = {"submitted": 0, "skipped": 0, "finished": 0}

    def log(self, event: str, text: str, **fields) -> None:
        record = {"time": datetime.now().astimezone().isoformat(timespec="seconds"), "event": event,
                  "task": self.task, **fields}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        self.echo(f"{record['time']}  {event:<9}  {text}")

    def active_jobs(self) -> list[str]:
        """Jobs of this task still PENDING or RUNNING on the cluster, whoever submitted them."""
        return [job.submission_id for job in self.client.list_jobs()
                if (job.metadata or {}).get(TASK_KEY) == self.task and str(job.status.value) in ACTIVE]

    def tick(self) -> str | None:
        """Submit the job unless one for this task is still active; returns the new job's id."""
        active = self.active_jobs()
        if active:
            self.counts["skipped"] += 1
            self.log("skipped", f"{self.task}: job {', '.join(active)} is still running; not starting another",
                     running=active)
            return None
        job_id = self.client.submit_job(
            entrypoint=self.entrypoint,
            submission_id=f"tune-prompts-{self.task}-{datetime.now():%Y%m%d-%H%M%S}-{self.counts['submitted']}",
            metadata={TASK_KEY: self.task, "submitted_by": "tune-prompts schedule"},
        )
        self.counts["submitted"] += 1
        self.watching[job_id] = "PENDING"
        self.log("submitted", f"{self.task}: job {job_id}: {self.entrypoint}", job_id=job_id, entrypoint=self.entrypoint)
        return job_id

    def poll(self) -> None:
        """Log each watched job's final status once, with the last line it printed (the check's verdict)."""
        for job_id in list(self.watching):
            info = self.client.get_job_info(job_id)
            status = str(info.status.value)
            if status not in FINISHED:
                self.watching[job_id] = status
                continue
            del self.watching[job_id]
            self.counts["finished"] += 1
            lines = [line for line in (self.client.get_job_logs(job_id) or "").splitlines() if line.strip()]
            outcome = lines[-1].strip() if lines else ""
            self.log("finished", f"{self.task}: job {job_id} {status}: {outcome or info.message}", job_id=job_id,
                     status=status, message=info.message, outcome=outcome)

    def _wait_until(self, deadline: float) -> bool:
        """Poll watched jobs until ``deadline``; False if told to stop."""
        while not self.stop.is_set():
            self.poll()
            left = deadline - time.time()
            if left <= 0:
                return True
            self.stop.wait(min(self.poll_s, left))
        return False

    def run(self, max_ticks: int | None = None, drain_s: float = 600) -> dict:
        """Tick until stopped (or ``max_ticks`` ticks, then wait up to ``drain_s`` for the watched jobs to end)."""
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            when = self.next_tick(time.time())
            if when > time.time() + 1:
                self.echo(f"next tick for {self.task} at {datetime.fromtimestamp(when):%Y-%m-%d %H:%M:%S}")
            if not self._wait_until(when):
                break
            ticks += 1
            self.tick()
        else:
            end = time.time() + drain_s
            while self.watching and not self.stop.is_set() and time.time() < end:
                self._wait_until(min(end, time.time() + self.poll_s))
        still = sorted(self.watching)
        self.log("stopped", f"{self.task}: after {ticks} ticks, {self.counts['submitted']} submitted, "
                 f"{self.counts['skipped']} skipped" + (f"; still running on the cluster: {', '.join(still)}" if still else ""),
                 ticks=ticks, still_running=still, **self.counts)
        return {"ticks": ticks, "still_running": still, **self.counts}


def connect(address: str):
    """A job-submission client for the cluster's dashboard address (http://HOST:8265)."""
    from ray.job_submission import JobSubmissionClient  # the scheduler's one use of ray

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ScheduleError(f"cannot reach Ray's job API at {address}: {exc}. Give the dashboard address "
                            "(http://HEAD:8265; `ray dashboard ray_cluster.yaml` forwards it to localhost)") from None


def serve(scheduler: Scheduler, max_ticks: int | None = None) -> dict:
    """``scheduler.run`` with SIGINT and SIGTERM ending it cleanly (handlers restored afterwards)."""

    def handle(signum, frame):
        scheduler.echo(f"{signal.Signals(signum).name}: stopping the scheduler")
        scheduler.stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return scheduler.run(max_ticks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
