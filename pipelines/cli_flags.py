"""The flags several commands take, each defined once here, and the argparse types that read a flag's bounds
from the schema (``pipelines/config.py``), so that a flag accepts what a task file or ``FlagSettings`` accepts."""

from __future__ import annotations

import argparse
import math
from typing import get_args

from pydantic import BaseModel

from pipelines.config import Bounds, ConfigError, Endpoint, FlagSettings, ModelSource, bounds_of
from pipelines.engine.models import EMBEDDED
from pipelines.task_files import builtin_tasks


class Number:
    """An argparse type: a finite ``kind`` (int or float) within ``bounds``."""

    def __init__(self, kind: type[int] | type[float], bounds: Bounds) -> None:
        self.kind, self.limits = kind, bounds
        self.bounds = (bounds.low, bounds.high, kind is int, bounds.above)  # what the tests feed it

    def __call__(self, text: str) -> float:
        try:
            value = self.kind(text)  # int() refuses '1e30' and numbers of thousands of digits
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r} is not a {'whole number' if self.kind is int else 'number'}") from None
        if not math.isfinite(value) or not self.limits.admit(value):
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range: give a number {self.limits}")
        return value


def number(kind: type[int] | type[float], low: float, high: float, *, above: bool = False) -> Number:
    """An argparse type: a finite ``kind`` from ``low`` (more than it, with ``above``) to ``high``."""
    return Number(kind, Bounds(low, high, above))


def setting(model: type[BaseModel], name: str) -> Number:
    """The argparse type of the flag that gives ``model``'s field ``name``: its number type and the bounds its
    Field states (``config.bounds_of``), so that a flag accepts what the task file (or ``FlagSettings``) accepts."""
    annotation = model.model_fields[name].annotation
    return Number(float if float in (annotation, *get_args(annotation)) else int, bounds_of(model, name))


def add_task_flag(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--task", required=required,
                   help=f"a built-in task ({', '.join(builtin_tasks())}) or a task YAML file")


def add_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--template", help="a template file (YAML record or plain text); default: the task's seed template")


def add_model_flags(p: argparse.ArgumentParser, *, command: bool) -> None:
    """The target and judge, read by ``model_sources``: a local model, or one served over an OpenAI-compatible
    API and how to reach it. The top level adds them for the tuning run, and eval, check and predict add them
    again (``command``) with no defaults of their own, since argparse copies a command's defaults over the top
    level's values: so a flag given before the command holds for it too, unless repeated after it."""
    def default(value):
        return argparse.SUPPRESS if command else value

    served = Endpoint("URL", "MODEL")  # the connection defaults, as Endpoint sets them
    g = p.add_argument_group(
        "target and judge: a local model, or one served over the OpenAI API (vLLM, TGI, ...)",
        None if command else "eval, check and predict take these flags too, before or after the command")
    g.add_argument("--model", default=default(EMBEDDED), help="the target model (and judge, unless --judge-model): "
                   f"the embedded model, a Hugging Face folder or hub id (default {EMBEDDED})")
    g.add_argument("--judge-model", default=default(None), help="a separate judge: the name a server serves "
                   "(--judge-url's, else --target-url's), or without a URL a local model")
    g.add_argument("--target-url", default=default(None), help="the target's server, e.g. http://localhost:8000/v1 "
                   "(vLLM: vllm serve MODEL --max-logprobs 20)")
    g.add_argument("--target-model", default=default(None),
                   help="the model name the target server serves (GET URL/models lists them)")
    g.add_argument("--judge-url", default=default(None),
                   help="the judge's server (default: --target-url; with neither, the local model judges)")
    g.add_argument("--api-key-env", default=default(served.api_key_env), help="name of the environment variable "
                   f"holding the API key, never the key (default {served.api_key_env})")
    g.add_argument("--max-concurrency", type=setting(FlagSettings, "max_concurrency"),
                   default=default(served.max_concurrency),
                   help=f"requests in flight per scoring actor (default {served.max_concurrency})")
    g.add_argument("--request-timeout", type=setting(FlagSettings, "timeout_s"), default=default(served.timeout_s),
                   help="seconds one try of a request may take, all of it: connect, send, first byte and whole body "
                   f"(default {served.timeout_s:g})")
    g.add_argument("--request-deadline", type=setting(FlagSettings, "deadline_s"), default=default(served.deadline_s),
                   help="seconds one request may take in all, its retries, backoffs and Retry-After waits included "
                   f"(default {served.deadline_s:g})")
    g.add_argument("--max-retries", type=setting(FlagSettings, "max_retries"), default=default(served.max_retries),
                   help=f"retries after a timeout, a dropped connection, 429 or 5xx, with backoff (default "
                   f"{served.max_retries}); then the command stops (a tuning run: --resume continues it)")
    g.add_argument("--max-retry-after", type=setting(FlagSettings, "max_retry_after_s"),
                   default=default(served.max_retry_after_s), help="the longest wait a 429's or 503's Retry-After "
                   f"is honoured for (default {served.max_retry_after_s:g})")
    g.add_argument("--breaker-failures", type=setting(FlagSettings, "breaker_failures"),
                   default=default(served.breaker_failures), help="failed tries in a row after which every request "
                   f"to that server fails at once, for one deadline (default {served.breaker_failures})")
    g.add_argument("--top-logprobs", type=setting(FlagSettings, "top_logprobs"), default=default(served.top_logprobs),
                   help=f"alternatives per position to read labels from (default {served.top_logprobs}, OpenAI's "
                   "limit; a vLLM server started with a higher --max-logprobs allows more, and fewer labels get floored)")


def model_sources(args) -> tuple[ModelSource, ModelSource | None]:
    """The target and judge the flags name: a local model, or a model served at a URL. The judge defaults to
    the target (``build_scorer`` shares its scorer where it can); a judge model without a judge URL is served
    by the target's server when there is one, else loaded locally."""
    if args.target_url and not args.target_model:
        raise ConfigError(f"--target-url {args.target_url} needs --target-model, the model name that server serves "
                          "(GET URL/models lists them)")
    def served(url: str, model: str) -> Endpoint:
        return Endpoint(url, model, args.api_key_env, max_concurrency=args.max_concurrency,
                        timeout_s=args.request_timeout, max_retries=args.max_retries, top_logprobs=args.top_logprobs,
                        deadline_s=args.request_deadline, max_retry_after_s=args.max_retry_after,
                        breaker_failures=args.breaker_failures)

    target = served(args.target_url, args.target_model) if args.target_url else args.model
    if args.judge_url:
        judge = served(args.judge_url, args.judge_model or args.target_model)
    elif args.judge_model:
        judge = served(args.target_url, args.judge_model) if args.target_url else args.judge_model
    else:
        judge = None
    return target, judge
