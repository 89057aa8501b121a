"""The reward function that openrlhf's ``train_ppo_ray`` calls (``--reward.remote_url path/to/this_file.py``).

openrlhf loads this file by path in each vLLM engine process (``openrlhf/utils/agent.py``) and calls
``reward_func(queries, prompts, labels)`` positionally, from a worker thread, with lists of length 1:
``queries[i]`` is the prompt and the sampled response decoded together with their special tokens,
``prompts[i]`` the prompt string (the meta-prompt inside the policy's chat template). This file scores the
response with the same code as the local loop: the reply becomes a candidate template
(``pipelines.generation.candidate_text``), and ``CandidateScorer.measure`` measures it on the dev split and
weighs the components. An unusable candidate is not an error: it gets the task's invalid penalty, as in the
local loop.

Settings: ``reward_settings.json`` next to this file (``TUNE_PROMPTS_REWARD_SETTINGS`` may point elsewhere),
written by ``pipelines/rl/cluster_job.py``. Keys:

* ``task``: the task config as a mapping (what ``prepare_job`` writes, with ``task_base_dir`` for its
  relative paths), or a built-in task name, or a task YAML path (relative to the settings file);
* ``task_overrides``: optional dotted overrides, e.g. ``{"scoring.robustness_examples": 8}``;
* ``target``, ``judge`` (null: the target judges): a model id or path as for ``tune-prompts``, or
  ``{"url": ..., "model": ..., "api_key_env": ...}`` for a model served over an OpenAI-compatible API;
* ``dev_examples``: dev examples in each reward (null: the whole dev split);
* ``end_tokens``: strings that end a response (chat end-of-turn and eos tokens); the response is cut at the first;
* ``max_failures``: failures this process tolerates before it exits (default 5).

The scorer (target and judge models) is built once per process, on the first call, and every call holds
one lock: openrlhf calls from several threads, and one model on the CPU gains nothing from concurrency.

Failures are loud on purpose. openrlhf catches an exception from ``reward_func``, logs it at INFO level and
trains on a missing reward. So every failure is logged at ERROR level with its traceback (logger
``tune_prompts.reward``), printed to stderr, appended to ``reward_failures.jsonl`` next to the settings, and
re-raised. After ``max_failures`` failures the process exits with status 3 (``os._exit``: openrlhf would
catch ``SystemExit`` like any exception). That kills the vLLM engine actor, so the Ray job stops instead of
training on rewards that are not there; the failures file says why.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

log = logging.getLogger("tune_prompts.reward")

SETTINGS_ENV = "TUNE_PROMPTS_REWARD_SETTINGS"
SETTINGS_NAME = "reward_settings.json"
FAILURES_NAME = "reward_failures.jsonl"
DEFAULT_MAX_FAILURES = 5
EXIT_STATUS = 3
# Chat end-of-turn and end-of-sequence tokens of common chat templates (SmolLM2/Qwen/ChatML, GPT-2, Llama).
DEFAULT_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end|>")

_lock = threading.Lock()
_state: dict[str, Any] = {"scorer": None, "settings": None, "failures": 0}


def settings_path() -> Path:
    # resolve(): openrlhf may load this file by a relative path; the settings stay next to the file.
    return Path(os.environ.get(SETTINGS_ENV) or Path(__file__).resolve().parent / SETTINGS_NAME)


def failures_path() -> Path:
    return settings_path().parent / FAILURES_NAME


def _settings() -> dict:
    if _state["settings"] is None:
        path = settings_path()
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"reward settings {path} do not exist: write them with `tune-prompts --backend openrlhf` "
                f"or point {SETTINGS_ENV} at them"
            ) from None
        if not isinstance(settings, dict):
            raise ValueError(f"reward settings {path} must hold a JSON object")
        _state["settings"] = settings
    return _state["settings"]


def _task(settings: dict):
    from pipelines.config import TaskConfig
    from pipelines.task_files import load_task

    spec = settings.get("task")
    if isinstance(spec, dict):
        task = TaskConfig.model_validate({**spec, "base_dir": Path(settings.get("task_base_dir") or ".")})
    elif isinstance(spec, str) and spec:
        if spec.endswith((".yaml", ".yml")) and not Path(spec).is_absolute():
            spec = str(settings_path().parent / spec)
        task = load_task(spec)
    else:
        raise ValueError(f"reward settings {settings_path()}: 'task' must be a task mapping, a task name or a YAML path")
    overrides = settings.get("task_overrides") or {}
    return task.with_overrides(**overrides) if overrides else task


def model_source(spec):
    """A model source from the settings: a model id or path, or ``{"url", "model", "api_key_env"}`` for a served one."""
    from pipelines.config import Endpoint

    return Endpoint(**spec) if isinstance(spec, dict) else spec


def _build_scorer(settings: dict):
    """The scorer the local loop's Ray workers hold, built the same way (``pipelines.scoring.build_scorer``)."""
    from pipelines.config import EMBEDDED
    from pipelines.data import load_splits
    from pipelines.scoring import build_scorer

    task = _task(settings)
    target = model_source(settings.get("target") or EMBEDDED)
    judge = model_source(settings["judge"]) if settings.get("judge") else None
    scorer = build_scorer(task, load_splits(task), target, judge, reward_examples=settings.get("dev_examples"))
    log.info("reward scorer ready: task %s, target %s, %d dev examples", task.name, target, len(scorer.dev))
    return scorer


def response_of(query: str, prompt: str, end_tokens=DEFAULT_END_TOKENS) -> str:
    """The sampled response: the query without its prompt, cut at the first end token."""
    if not query.startswith(prompt):
        raise ValueError(
            f"the query does not start with its prompt, so the response cannot be told apart "
            f"(prompt begins {prompt[:80]!r}, query begins {query[:80]!r})"
        )
    response = query[len(prompt) :]
    cuts = [i for i in (response.find(token) for token in end_tokens) if i >= 0]
    return response[: min(cuts)] if cuts else response


def _score(queries: list[str], prompts: list[str]) -> dict:
    import torch

    from pipelines.generation import candidate_text
    from pipelines.racing import race_candidates

    settings = _settings()
    if len(queries) != len(prompts):
        raise ValueError(f"got {len(queries)} queries for {len(prompts)} prompts")
    end_tokens = tuple(settings.get("end_tokens") or DEFAULT_END_TOKENS)
    responses = [response_of(q, p, end_tokens) for q, p in zip(queries, prompts)]  # before loading any model
    if _state["scorer"] is None:
        _state["scorer"] = _build_scorer(settings)
    scorer = _state["scorer"]
    texts = [candidate_text(scorer.task, response) for response in responses]
    rewards = [scored.reward for scored in race_candidates(scorer.task, scorer, texts)[0]]  # raced as the loop does
    totals = [r.total for r in rewards]
    if not all(math.isfinite(t) for t in totals):
        raise ValueError(f"reward is not finite: {totals} for candidates {texts}")
    # openrlhf turns every extra_logs value into a one-element tensor per sample and concatenates them over the
    # batch, so every sample must carry the same keys with a number: an abstaining component (and every
    # component of an invalid candidate) is logged as 0.0, and reward/valid says which samples were valid.
    extra_logs = {"reward/valid": torch.tensor([float(r.valid) for r in rewards])}
    for name in scorer.components:
        values = [r.components.get(name) for r in rewards]
        extra_logs[f"reward/{name}"] = torch.tensor([0.0 if v is None else float(v) for v in values])
    return {"rewards": torch.tensor(totals), "scores": torch.tensor(totals), "extra_logs": extra_logs}


def _record_failure(exc: BaseException, queries: list[str]) -> int:
    """Log, print and file one failure; returns how many this process has had."""
    _state["failures"] += 1
    count = _state["failures"]
    where = failures_path()
    log.error("reward_func failed (%d so far in this process; failures file %s)", count, where, exc_info=exc)
    print(f"tune_prompts reward_func FAILED ({count}): {type(exc).__name__}: {exc}\n"
          + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), "failure": count,
              "error": f"{type(exc).__name__}: {exc}", "queries": [q[:500] for q in queries]}
    try:
        with open(where, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    except OSError as write_error:
        log.error("could not append to the failures file %s: %s", where, write_error)
    return count


def _max_failures() -> int:
    try:
        return int(_settings().get("max_failures", DEFAULT_MAX_FAILURES))
    except (OSError, ValueError, TypeError):  # unreadable settings are the failure being counted: default limit
        return DEFAULT_MAX_FAILURES


def reward_func(queries, prompts, labels):
    """openrlhf's reward hook: {"rewards": (B,), "scores": (B,), "extra_logs": {"reward/<name>": (B,)}} tensors.

    ``labels`` are unused: the reward is measured on the task's own dev split, not per prompt.
    """
    queries, prompts = list(queries), list(prompts)
    with _lock:
        try:
            return _score(queries, prompts)
        except Exception as exc:
            count = _record_failure(exc, queries)
            limit = _max_failures()
            if count >= limit:
                message = (f"tune_prompts reward_func: {count} failures (limit max_failures={limit}); exiting with "
                           f"status {EXIT_STATUS} so the job stops instead of training on missing rewards. "
                           f"See {failures_path()}")
                log.critical(message)
                print(message, file=sys.stderr, flush=True)
                logging.shutdown()
                os._exit(EXIT_STATUS)
            raise
