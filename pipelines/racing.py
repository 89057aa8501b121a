"""Racing: a step's candidates first meet a small slice of the dev sample, and only the best go on.

Successive halving in one cut. Every candidate is measured on the first rung, the first examples of its dev
sample (``racing.first_examples``, fewer when they pass ``racing.first_tokens``: the scorer's ``first_rung``);
with ``racing.screen`` that rung is a screen: the label log-probs and greedy answers only (reward metric,
instruction following, readability, length), no entity swaps, perturbations or judge. The ``racing.keep`` best
by that reward (valid ones only) get the full measurement on the whole sample, and the others keep the reward
of the slice. The pair caches make the second rung pay only for the examples
the first did not score, so a step costs about ``n * first + keep * (sample - first)`` examples instead of
``n * sample``.

What each reward is used for follows from how much it saw:
* the policy update reads every candidate's first-rung reward (``first_rung_reward``): the one reward every
  sample of the group has, measured alike, so group baselines (rloo, group_norm) compare like with like;
* the leaderboard, which the meta-prompt's incumbent and the finalists come from, takes only candidates that
  finished the race, so a lucky slice cannot put a candidate there.

The loop, the budget's estimate and the cluster reward function all race through ``race``, so what they price
and what they run are the same.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from pipelines.config import TaskConfig
from pipelines.engine.usage import sum_usage

Measure = Callable[[Sequence[str], int | None], list]  # (texts, dev examples or None for the whole sample) -> Scored


def race(measure: Measure, texts: Sequence[str], first_examples: int, keep: int,
         sample_size: int) -> tuple[list, list[bool]]:
    """The candidates' ``Scored`` results in the order given, and whether each finished the race (measured on
    the whole sample of ``sample_size`` examples). No racing when the slice is 0 or not smaller than the
    sample, or when every candidate would go on anyway."""
    texts = list(texts)
    if not first_examples or first_examples >= sample_size or keep >= len(texts):
        return measure(texts, None), [True] * len(texts)
    scored = measure(texts, first_examples)
    ranked = sorted((i for i, s in enumerate(scored) if s.measured.valid), key=lambda i: -scored[i].reward.total)
    contenders = ranked[:keep]
    finished = [False] * len(texts)
    if contenders:
        for i, full in zip(contenders, measure([texts[i] for i in contenders], None)):
            # what the candidate cost is both rungs' (the second paid only for examples the first did not see);
            # its first rung's reward stays with it: every sample has one, so the policy can learn from it
            scored[i] = replace(full, usage=sum_usage(scored[i].usage, full.usage), screen=scored[i].reward)
            finished[i] = True
    return scored, finished


def race_candidates(task: TaskConfig, measurer, texts: Sequence[str]) -> tuple[list, list[bool]]:
    """A step's candidates measured as the task races them (``scoring.racing``). ``measurer``: anything with
    ``measure(texts, examples=...)``, ``sample_size`` and ``first_rung`` (the Ray ``ScoringPool``, a
    ``CandidateScorer``, which sizes the first slice: ``racing.first_examples``, fewer when their inputs pass
    ``racing.first_tokens``)."""
    racing = task.scoring.racing
    return race(lambda part, n: measurer.measure(part, examples=n, screen=racing.screen if n else racing.screens_sample),
                texts,
                measurer.first_rung, task.scoring.racing.keep, measurer.sample_size)


def first_rung_reward(scored) -> float:
    """The reward every sample of a step has: its first rung's (a finisher's ``screen``), else its only one."""
    return (scored.screen or scored.reward).total
