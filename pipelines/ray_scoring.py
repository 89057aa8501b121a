"""Scoring on Ray: actors that each hold the target and judge models, and a pool that survives their death.

Each ``ScoringWorker`` builds its own scorer with ``pipelines.scoring.build_scorer`` (its own copy of the
target model, or its own client of an endpoint); the pool splits a step's candidates across the workers. A
worker that dies mid-step (out of memory, a killed node) is replaced by a fresh one and its share of the step
is retried, so the step completes.

On a 2-core machine two one-thread workers are the default: they score about 18% more pairs per second
than one worker with two threads (measured with the project's scorer), because small operations no longer
wait on each other's threads. A template's later calls go to the worker that scored it first, whose pair
cache already holds its scores. On a cluster, ``num_workers`` workers spread over the CPU nodes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from pipelines.config import ModelSource, TaskConfig
from pipelines.data import Splits
from pipelines.engine.usage import Usage

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
    """One scorer in its own process; its methods are the pool's whole vocabulary."""

    def __init__(self, *, task: TaskConfig, splits: Splits, target: ModelSource, judge: ModelSource | None,
                 threads: int, reward_examples: int | None):
        import torch

        from pipelines.scoring import build_scorer

        torch.set_num_threads(threads)
        # In the loop a server's malformed answer is data (an answer naming no label), not the end of the run.
        self.scorer = build_scorer(task, splits, target, judge, reward_examples=reward_examples, bad_responses="count")

    def measure(self, texts: list[str], whole_dev: bool, examples: int | None = None, screen: bool = False):
        return self.scorer.measure(texts, whole_dev=whole_dev, examples=examples, screen=screen)

    def evaluate(self, texts: list[str], split: str, fitted: list | None = None):
        return [self.scorer.evaluate(text, split, latency=False, fitted=known)
                for text, known in zip(texts, fitted or [None] * len(texts))]

    def latencies(self, texts: list[str], split: str):
        """Each template's latency, their requests interleaved, and the calls its probe requests took (a server
        bills them too)."""
        return self.scorer.latencies([self.scorer.validate(text).template for text in texts], split)

    def ready(self) -> int:
        return os.getpid()

    def sizes(self) -> tuple[int, int]:
        """(dev examples in a reward, examples in a race's first rung), as the scorer sized them in tokens."""
        return self.scorer.sample_size, self.scorer.first_rung


_DEAD = (ActorDiedError, ActorUnavailableError, RayActorError)
Call = Callable[[ray.actor.ActorHandle], ray.ObjectRef]  # one worker's remote call, repeatable on a replacement


class ScoringPool:
    """A fixed number of scoring workers; dead ones are replaced and their work retried."""

    def __init__(self, task: TaskConfig, splits: Splits, *, target: ModelSource, judge: ModelSource | None = None,
                 num_workers: int = 1, cpus_per_worker: int | None = None, max_retries: int = 2,
                 reward_examples: int | None = None):
        """``reward_examples``: dev examples in a candidate's step reward (the first ones; None: all)."""
        if cpus_per_worker:
            self.cpus = cpus_per_worker
        else:  # an equal share each; never more workers than CPUs (an actor without one would wait forever)
            available = max(1, int(ray.available_resources().get("CPU", 1)))
            if num_workers > available:
                log.warning("%d scoring workers asked for, %d CPUs free in Ray: starting %d", num_workers, available, available)
                num_workers = available
            self.cpus = available // num_workers
        self.task = task
        self._worker_args = dict(task=task, splits=splits, target=target, judge=judge, threads=self.cpus,
                                 reward_examples=reward_examples)
        self.workers = [self._start() for _ in range(num_workers)]
        self._sample_sizes: tuple[int, int] | None = None
        self.max_retries = max_retries
        self.replaced = 0  # workers replaced after dying
        self._unread: list = []  # results submitted ahead (the seed's evaluation) that a stopped run never reads
        self._home: dict[str, int] = {}  # template text -> the worker whose pair cache holds its scores

    def _start(self):
        return ScoringWorker.options(num_cpus=self.cpus).remote(**self._worker_args)

    @property
    def sample_size(self) -> int:
        """Dev examples in a candidate's reward, as the workers' scorers chose them (``scoring.dev_tokens``)."""
        return self._sizes()[0]

    @property
    def first_rung(self) -> int:
        """Dev examples in a race's first rung, as the workers' scorers chose them (``racing.first_tokens``)."""
        return self._sizes()[1]

    def _sizes(self) -> tuple[int, int]:
        if self._sample_sizes is None:
            self._sample_sizes = tuple(self._run({0: lambda worker: worker.sizes.remote()})[0])
        return self._sample_sizes

    def wait_ready(self) -> None:
        """Block until every worker has loaded its models (so step timings exclude start-up)."""
        self._run({i: lambda worker: worker.ready.remote() for i in range(len(self.workers))})

    def measure(self, texts: Sequence[str], whole_dev: bool = False, examples: int | None = None,
                screen: bool = False) -> list:
        """``Scored`` candidates, measured across the workers, in the order given (on the first ``examples`` of
        the dev sample when given; ``screen``: the screening measurement, ``CandidateScorer.measure``)."""
        # a full measurement (a race's second rung) is spread evenly: the screen cached only a slice's log-probs
        chunks = self._assign(texts, balance=examples is None and not whole_dev)
        results = self._run({w: lambda worker, part=[texts[j] for j in chunk]: worker.measure.remote(part, whole_dev, examples, screen)
                             for w, chunk in chunks.items()})
        return self._gather(len(texts), chunks, results)

    def evaluate(self, texts: Sequence[str], split: str, latency: bool = True, fitted: Sequence | None = None) -> list:
        """``Evaluation``s across the workers; then, with ``latency``, the valid templates are timed together
        (``time``). ``fitted``: per template, its evaluation on another split or None (``CandidateScorer.evaluate``)."""
        chunks = self._assign(texts, balance=True)
        known = list(fitted) if fitted is not None else [None] * len(texts)
        results = self._run({w: lambda worker, part=[texts[j] for j in chunk], got=[known[j] for j in chunk]:
                             worker.evaluate.remote(part, split, got) for w, chunk in chunks.items()})
        evaluations = self._gather(len(texts), chunks, results)
        if latency:
            self.time(evaluations, split)
        return evaluations

    def time(self, evaluations: Sequence, split: str) -> None:
        """Set each valid evaluation's latency: on one worker while the others wait (their compute would inflate
        the figure), the templates' requests interleaved (``CandidateScorer.latencies``: a machine whose speed
        drifts while they are timed drifts for all of them, so the gate's ratio holds). Their probes' calls are
        added to each evaluation's usage."""
        timed = [ev for ev in evaluations if ev.measured.valid]
        if not timed:
            return
        texts = [ev.measured.template for ev in timed]
        found = self._run({0: lambda worker: worker.latencies.remote(texts, split)})[0]
        for ev, (latency, probes) in zip(timed, found):
            ev.latency = latency
            ev.usage = {role: ev.usage.get(role, Usage()) + usage for role, usage in probes.items()}

    def seed(self, text: str, evaluate: bool = True) -> tuple:
        """The seed's ``Scored`` on the search sample, and what waits for its ``Evaluation`` on the whole dev split
        (for the choice; call it then). With two workers or more the evaluation runs on the second while the first
        measures the seed and the steps begin: the evaluation costs the most, and nothing before the choice reads
        it (the second worker's share of step 1 waits for it; the first worker's does not). The evaluation is not
        timed: the choice times it beside the candidates (``time``). Without ``evaluate`` (a run with no choice),
        the seed is measured only."""
        screen = self.task.scoring.racing.screens_sample  # measured like the candidates it is ranked with
        if not evaluate:
            return self.measure([text], screen=screen)[0], None
        if len(self.workers) < 2:
            (scored,) = self.measure([text], screen=screen)
            (evaluation,) = self.evaluate([text], "dev", latency=False)
            return scored, lambda: evaluation
        self._home[text] = 0
        call = {1: lambda worker: worker.evaluate.remote([text], "dev")}
        pending = self._submit(call)
        self._unread += pending.values()
        (scored,) = self._run({0: lambda worker: worker.measure.remote([text], False, None, screen)})[0]
        return scored, lambda: self._run(call, pending)[1][0]

    def _assign(self, texts: Sequence[str], balance: bool = False) -> dict[int, list[int]]:
        """Indices of ``texts`` per worker (workers with nothing to do left out): a template goes back to the
        worker that scored it before (its cache answers the pairs already scored), a new one to the worker with
        the least work. With ``balance`` (the test split, which no cache holds) a template goes back only while
        that worker has less than its equal share: the seed and a finalist that one worker scored are tested
        side by side, not one after the other (the moved one pays again for its robustness sample)."""
        chunks: list[list[int]] = [[] for _ in self.workers]
        share = -(-len(texts) // len(self.workers)) if balance else len(texts)
        new = []
        for j, text in enumerate(texts):
            home = self._home.get(text)
            (chunks[home] if home is not None and len(chunks[home]) < share else new).append(j)
        for j in new:
            worker = min(range(len(chunks)), key=lambda w: len(chunks[w]))
            chunks[worker].append(j)
            self._home[texts[j]] = worker
        return {w: chunk for w, chunk in enumerate(chunks) if chunk}

    @staticmethod
    def _gather(n: int, chunks: dict[int, list[int]], results: dict[int, list]) -> list:
        out: list = [None] * n
        for w, chunk in chunks.items():
            for j, value in zip(chunk, results[w]):
                out[j] = value
        return out

    def _submit(self, calls: dict[int, Call]) -> dict:
        return {i: call(self.workers[i]) for i, call in calls.items()}

    def _run(self, calls: dict[int, Call], pending: dict | None = None) -> dict:
        """Run calls[i] on worker i, concurrently (``pending``: those calls submitted already, by ``_submit``);
        replace a worker that dies and run its call again."""
        results: dict = {}
        pending = dict(pending) if pending is not None else self._submit(calls)
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
                pending[i] = calls[i](self.workers[i])
            except RayTaskError as exc:  # e.g. JudgeError, EndpointError: the worker's own error and message
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else exc.as_instanceof_cause()) from None
        return results

    def shutdown(self, wait_s: float = 30.0) -> None:
        """Kill the workers, then wait (at most ``wait_s``) until Ray counts their CPUs free again: a pool started
        right after gets its full share of workers instead of fewer (Ray frees a killed actor's CPUs a moment
        later)."""
        free = ray.available_resources().get("CPU", 0) if ray.is_initialized() else 0
        total = ray.cluster_resources().get("CPU", 0) if ray.is_initialized() else 0
        want = min(total, free + self.cpus * len(self.workers))
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        for ref in self._unread:  # read what a stopped run left (failed with its workers), or Ray prints its traceback
            if ray.wait([ref], timeout=1.0)[0]:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the run has ended on its own error already
                    pass
        self._unread = []
        deadline = time.monotonic() + wait_s
        while ray.is_initialized() and ray.available_resources().get("CPU", 0) < want and time.monotonic() < deadline:
            time.sleep(0.1)
