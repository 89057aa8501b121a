"""Scoring on Ray: actors that each hold the target and judge models, and a pool that survives their death.

The only module that imports ray (besides the scheduler's job-submission client). Each ``ScoringWorker``
loads its own copy of the target model and runs ``pipelines.scoring.CandidateScorer``; the pool splits a
step's candidates across the workers. A worker that dies mid-step (out of memory, a killed node) is
replaced by a fresh one and its share of the step is retried, so the step completes.

On this 2-core machine one worker with both cores is the default (torch already uses both threads); on a
cluster, ``num_workers`` workers spread over the CPU nodes.
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
    def __init__(self, task: TaskConfig, splits: Splits, target_model: str, judge_model: str | None, threads: int):
        import torch

        from pipelines.models import load_causal_lm
        from pipelines.scoring import CandidateScorer

        torch.set_num_threads(threads)
        target = load_causal_lm(target_model)
        judge = load_causal_lm(judge_model) if judge_model and judge_model != target_model else None
        self.scorer = CandidateScorer(task, splits, target, judge)

    def measure(self, texts: list[str], robustness: bool = True):
        return self.scorer.measure(texts, robustness=robustness)

    def evaluate(self, text: str, split: str, latency: bool = True):
        return self.scorer.evaluate(text, split, latency=latency)

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
    ):
        self.cpus = cpus_per_worker or max(1, int(ray.available_resources().get("CPU", 1)) // num_workers)
        self._args = (task, splits, target_model, judge_model, self.cpus)
        self.workers = [self._start() for _ in range(num_workers)]
        self.max_retries = max_retries
        self.replaced = 0  # workers replaced after dying

    def _start(self):
        return ScoringWorker.options(num_cpus=self.cpus).remote(*self._args)

    def wait_ready(self) -> None:
        """Block until every worker has loaded its models (so step timings exclude start-up)."""
        self._call_all([("pid", ())] * len(self.workers))

    def measure(self, texts: Sequence[str], robustness: bool = True) -> list:
        """Measure candidates across the workers, in the order given."""
        chunks = [list(range(i, len(texts), len(self.workers))) for i in range(len(self.workers))]
        calls = [("measure", ([texts[j] for j in chunk], robustness)) for chunk in chunks]
        results = self._call_all(calls)
        out: list = [None] * len(texts)
        for chunk, measured in zip(chunks, results):
            for j, m in zip(chunk, measured or []):
                out[j] = m
        return out

    def evaluate(self, texts: Sequence[str], split: str, latency: bool = True) -> list:
        calls = [("evaluate", (text, split, latency)) for text in texts]
        out = []
        for start in range(0, len(calls), len(self.workers)):  # one template per worker at a time
            out.extend(self._call_all(calls[start : start + len(self.workers)]))
        return out

    def _call_all(self, calls: list[tuple[str, tuple]]) -> list:
        """Run calls[i] on worker i; replace a worker that dies and run its call again."""
        results: list = [None] * len(calls)
        pending = {i: self._submit(i, calls[i]) for i in range(len(calls))}
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

