"""The self-evaluating judge: a small LLM answers the task's rubric questions.

Each rubric is a yes/no question from the task file. The judge model reads the item inside a fixed frame and
its score is P(yes) / (P(yes) + P(no)) from one forward pass. The item is a *value* of the frame (inserted
literally), never part of the frame's own template text. Two frames:

* ``RESPONSE_FRAME`` (``judge.rubrics``): one (input, response) pair, the target's greedy answer to one input
  (``response_item``); a candidate's score is the mean over the pairs graded. This is the self-evaluation of
  responses: coherence, factual support.
* ``TEMPLATE_FRAME`` (``judge.template_rubrics``): the candidate template's own text, e.g. its readability.

Failures are bounded: an error on one item gives None for that rubric and counts in ``errors``; past
``max_errors`` in a run the judge raises ``JudgeError`` and the run stops with that message.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

from templates.template import Template, TemplateError

TEMPLATE_FRAME = (
    "You review prompts written for an AI assistant.\n"
    "Prompt:\n<<<\n{candidate}\n>>>\n"
    "Question: {question} Answer yes or no."
)
RESPONSE_FRAME = (
    "You check the answers an AI assistant gave.\n"
    "{candidate}\n"
    "Question: {question} Answer yes or no."
)
FRAME = TEMPLATE_FRAME  # the frame of earlier versions


def response_item(task_description: str, text: str, answer: str, max_chars: int = 1500) -> str:
    """One (input, response) pair as the judge reads it (long inputs shortened; the answer in full)."""
    text = text if len(text) <= max_chars else text[:max_chars] + " ..."
    return f"Task: {task_description.strip()}\nInput:\n<<<\n{text}\n>>>\nAnswer:\n<<<\n{answer}\n>>>"
JUDGE_VERBALIZERS = ("yes", "no")

# ask(frame, candidates) -> label log-probs over JUDGE_VERBALIZERS, shape (len(candidates), 2)
AskFn = Callable[[Template, Sequence[str]], np.ndarray]


class JudgeError(RuntimeError):
    """The judge failed more often than the run allows."""


class Judge:
    def __init__(self, rubrics: Mapping[str, str], ask: AskFn, max_errors: int = 5, frame: str = TEMPLATE_FRAME,
                 fatal: tuple[type[BaseException], ...] = ()):
        """``fatal``: failures that are not the judge's to absorb (a server that stopped answering ends the run,
        resumably, rather than quietly scoring its rubrics as missing)."""
        self.fatal = fatal
        if not callable(ask):
            raise TypeError("the judge's ask function must be callable as ask(template, candidates)")
        self.frames: dict[str, Template] = {}
        for name, question in rubrics.items():
            # The question becomes part of the frame's text, so braces in it would be placeholders: refuse them.
            try:
                self.frames[name] = Template(
                    frame.replace("{question}", question.strip()), ("candidate",)
                )
            except TemplateError as exc:
                raise ValueError(f"judge rubric {name!r}: {exc}") from None
        self.ask = ask
        self.max_errors = max_errors
        self.errors = 0

    def __call__(self, candidates: Sequence[str]) -> list[dict[str, float | None]]:
        """P(yes) per rubric for each candidate; None where the judge failed."""
        out: list[dict[str, float | None]] = [{} for _ in candidates]
        for name, frame in self.frames.items():
            try:
                logprobs = np.asarray(self.ask(frame, list(candidates)), dtype=np.float64)
                if logprobs.shape != (len(candidates), len(JUDGE_VERBALIZERS)):
                    raise ValueError(f"judge returned shape {logprobs.shape}")
            except self.fatal:
                raise
            except Exception as exc:  # any other judge failure is counted, bounded, and reported below
                self._failed(name, exc)
                for row in out:
                    row[name] = None
                continue
            for row, lp in zip(out, logprobs):
                p_yes = math.exp(lp[0]) / (math.exp(lp[0]) + math.exp(lp[1]))
                row[name] = p_yes if math.isfinite(p_yes) else None
        return out

    def _failed(self, rubric: str, exc: Exception) -> None:
        self.errors += 1
        if self.errors > self.max_errors:
            raise JudgeError(
                f"the judge failed {self.errors} times (limit {self.max_errors}); last failure on rubric "
                f"{rubric!r}: {type(exc).__name__}: {exc}. Check the judge model, or raise judge.max_errors"
            ) from exc
