"""Scoring on Ray: actors that each hold the target and judge models, and a pool that survives their death.

The only module that imports ray (besides the scheduler's job-submission client). Each ``ScoringWorker``
loads its own copy of the target model and runs ``pipelines.scoring.CandidateScorer``; the pool splits a
step's candidates across the workers. A worker that dies mid-step (out of memory, a killed node) is
replaced by a fresh one and its share of the step is retried, so the step completes.

On a 2-core machine two one-thread workers are the default: they score about 18% more pairs per second
than one worker with two threads (measured with the project's scorer), because small operations no longer
wait on each other's threads. A template's later calls go to the worker that scored it first, whose pair
cache already holds its scores. On a cluster, ``num_workers`` workers spread over the CPU nodes.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from pipelines.config import TaskConfig
from pipelines.data import Splits

log = logging.getLogger(__name__)

# Idle torch threads in one process must not spin while another process computes (2 cores, several processes).
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a cluster (``address``) or start a local Ray without the dashboard."""
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": WORKER_ENV}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=runtime_env,
            log_to_driver=False, configure_logging=False,
        )


@ray.remote(max_restarts=0)
class ScoringWorker:
    def __init__(self, task: TaskConfig, splits: Splits, target_model: str, judge_model: str | None, threads: int,
                 reward_examples: int | None = None):
        import torch

        from pipelines.engine.models import load_causal_lm
        from pipelines.scoring import CandidateScorer

        torch.set_num_threads(threads)
        target = load_causal_lm(target_model)
        judge = load_causal_lm(judge_model) if judge_model and judge_model != target_model else None
        self.scorer = CandidateScorer(task, splits, target, judge, reward_examples=reward_examples)

    def measure(self, texts: list[str], robustness: bool = True, whole_dev: bool = False):
        return self.scorer.measure(texts, robustness=robustness, whole_dev=whole_dev)

    def evaluate(self, texts: list[str], split: str):
        return [self.scorer.evaluate(text, split, latency=False) for text in texts]

    def latency(self, text: str, split: str) -> tuple[dict, float]:
        """Per-request latency (p50/p95 ms) and render time (p99 us) of a valid template."""
        template = self.scorer.validate(text).template
        examples = list(self.scorer.splits[split])
        return self.scorer.request_latency_ms(template, examples), self.scorer.render_us_p99(template, examples)

    def stats(self) -> dict:
        return {"target": self.scorer.target.stats.as_dict(), "judge_errors": self.scorer.judge.errors}

    def pid(self) -> int:
        return os.getpid()


_DEAD = (ActorDiedError, ActorUnavailableError, RayActorError)


class ScoringPool:
    """A fixed number of scoring workers; dead ones are replaced and their work retried."""

    def __init__(
        self,
        task: TaskConfig,
        splits: Splits,
        *,
        target_model: str,
        judge_model: str | None = None,
        num_workers: int = 1,
        cpus_per_worker: int | None = None,
        max_retries: int = 2,
        reward_examples: int | None = None,
    ):
        """``reward_examples``: dev examples in a candidate's step reward (the first ones; None: all)."""
        if cpus_per_worker:
            self.cpus = cpus_per_worker
        else:  # an equal share each; never more workers than CPUs (an actor without one would wait forever)
            available = max(1, int(ray.available_resources().get("CPU", 1)))
            if num_workers > available:
                log.warning("%d scoring workers asked for, %d CPUs free in Ray: starting %d", num_workers, available, available)
                num_workers = available
            self.cpus = available // num_workers
        self._args = (task, splits, target_model, judge_model, self.cpus, reward_examples)
        self.workers = [self._start() for _ in range(num_workers)]
        self.max_retries = max_retries
        self.replaced = 0  # workers replaced after dying
        self._home: dict[str, int] = {}  # template text -> the worker whose pair cache holds its scores

    def _start(self):
        return ScoringWorker.options(num_cpus=self.cpus).remote(*self._args)

    def wait_ready(self) -> None:
        """Block until every worker has loaded its models (so step timings exclude start-up)."""
        self._call_all([("pid", ())] * len(self.workers))

    def _assign(self, texts: Sequence[str]) -> list[list[int]]:
        """Indices of ``texts`` per worker: a template goes back to the worker that scored it before (its
        cache answers the pairs already scored), a new one to the worker with the least work."""
        chunks: list[list[int]] = [[] for _ in self.workers]
        new = []
        for j, text in enumerate(texts):
            (chunks[self._home[text]] if text in self._home else new).append(j)
        for j in new:
            worker = min(range(len(chunks)), key=lambda w: len(chunks[w]))
            chunks[worker].append(j)
            self._home[texts[j]] = worker
        return chunks

    def _scatter(self, name: str, texts: Sequence[str], *args) -> list:
        chunks = self._assign(texts)
        results = self._call_all([(name, ([texts[j] for j in chunk], *args)) for chunk in chunks])
        out: list = [None] * len(texts)
        for chunk, values in zip(chunks, results):
            for j, value in zip(chunk, values or []):
                out[j] = value
        return out

    def measure(self, texts: Sequence[str], robustness: bool = True, whole_dev: bool = False) -> list:
        """Measure candidates across the workers, in the order given."""
        return self._scatter("measure", texts, robustness, whole_dev)

    def evaluate(self, texts: Sequence[str], split: str, latency: bool = True) -> list:
        """Evaluate templates across the workers; then, with ``latency``, time each valid one on its own
        (one worker at a time, so the other workers' compute does not inflate the figure)."""
        evaluations = self._scatter("evaluate", texts, split)
        if latency:
            for text, ev in zip(texts, evaluations):
                if ev.measured.valid:
                    (timed,) = self._run({self._home[text]: ("latency", (text, split))}).values()
                    ev.latency_ms, ev.render_us_p99 = timed
        return evaluations

    def _call_all(self, calls: list[tuple[str, tuple]]) -> list:
        """Run calls[i] on worker i; see ``_run``."""
        results = self._run(dict(enumerate(calls)))
        return [results[i] for i in range(len(calls))]

    def _run(self, calls: dict[int, tuple[str, tuple]]) -> dict:
        """Run calls[i] on worker i, concurrently; replace a worker that dies and run its call again."""
        results: dict = {}
        pending = {i: self._submit(i, call) for i, call in calls.items()}
        attempts = {i: 0 for i in pending}
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                results[i] = ray.get(ref)
                del pending[i]
            except _DEAD as exc:
                attempts[i] += 1
                if attempts[i] > self.max_retries:
                    raise RuntimeError(f"scoring worker {i} died {attempts[i]} times; last: {exc}") from exc
                log.warning("scoring worker %d died (%s); starting a replacement and retrying", i, type(exc).__name__)
                self.workers[i] = self._start()
                self.replaced += 1
                pending[i] = self._submit(i, calls[i])
            except RayTaskError as exc:
                raise exc.as_instanceof_cause() from None  # e.g. JudgeError: the worker's own error, unwrapped
        return results

    def _submit(self, i: int, call: tuple[str, tuple]):
        name, args = call
        return getattr(self.workers[i], name).remote(*args)

    def stats(self) -> list[dict]:
        return ray.get([w.stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

