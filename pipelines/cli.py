"""The `tune-prompts` command line.

    tune-prompts --task risk                 tune the risk task's template (the main job)
    tune-prompts tasks                       list tasks with data sizes and label balance
    tune-prompts validate TASK.yaml          check a task file as a run reads it, loading no model
    tune-prompts render --task risk          show the seed template rendered on a few examples
    tune-prompts eval --task risk            score a template: every reward component, with timing
    tune-prompts store list|show|...         the versioned template store
    tune-prompts check --task risk           drift check of the production template (exit 1 when below its bars)
    tune-prompts predict --task risk --text  what production receives: the stored version's decision on one input
    tune-prompts schedule --task risk ...    submit check-and-tune jobs to a Ray cluster on a cron schedule
    tune-prompts report RUN_DIR              a run's report.html: learning curves, candidates, test, gate, store

Every command exits 0 on success, 2 on bad input (with one line saying what to fix), 1 on a failure.
An unexpected exception is also one line and exit 2; ``--debug`` (or TUNE_PROMPTS_DEBUG=1) shows its traceback.

The module is long because it holds every command's flags, help and printed tables in one place, so that the
whole command-line surface reads together; the work behind each command lives elsewhere (``store`` in
``cli_store.py``, which has its own subcommands).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Sequence, get_args

import annotated_types
from pydantic import BaseModel

from pipelines import cli_store, config
from pipelines.budget import BudgetError
from pipelines.config import (ConfigError, Endpoint, FlagSettings, GenerationConfig, ModelSource, PPOConfig,
                              RunOptions, SelectionConfig, TaskConfig, builtin_tasks, load_task, load_yaml_mapping)
from pipelines.data import DataError, load_examples, split_examples
from pipelines.drift import DEFAULT_MAX_DROP
from pipelines.engine.endpoints import EndpointError
from pipelines.engine.models import EMBEDDED, ModelLoadError
from pipelines.schedule import CronError, ScheduleError
from pipelines.validate import summarize, validate_task
from rewards.judge import JudgeError
from templates.decision import DecisionError
from templates.store import StoreError, default_store_url
from templates.template import Template, TemplateError, constraints_from_spec

MAX_RENDER_EXAMPLES = 1000
USER_ERRORS = (ConfigError, DataError, TemplateError, DecisionError, ModelLoadError, JudgeError, StoreError, FileExistsError, FileNotFoundError,
               EndpointError, CronError, ScheduleError, BudgetError)


def quiet_libraries() -> None:
    """Keep third-party chatter (progress bars, deprecation notes) out of the CLI's output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not spin while Ray actors compute
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # an optional CPU kernel it cannot download
    warnings.filterwarnings("ignore", message=".*pynvml.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


# C0 and C1 controls, DEL, lone surrogates, line/paragraph separators and bidi overrides: what data can hold that
# would move the cursor, colour the terminal, forge a table row, reorder text or fail to encode when printed.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape(text: str, keep: str = "") -> str:
    """``text`` with unprintable characters (but those in ``keep``) written as Python escapes: \\x1b, \\n, \\udc80."""
    return _UNPRINTABLE.sub(lambda m: m.group() if m.group() in keep else repr(m.group())[1:-1], text)


def one_line(message: str, limit: int) -> str:
    """An error message as one escaped line of at most ``limit`` characters. A longer one loses its middle, not
    its end: a message names the problem first and the fix (the command to run) last."""
    message = escape(message)
    if len(message) <= limit:
        return message
    head = (limit - 5) // 2
    return message[:head] + " ... " + message[len(message) - (limit - 5 - head):]


def table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """A plain aligned text table; every cell is one escaped line, so data cannot forge rows or colours."""
    if not rows:
        return "(none)"
    columns = list(columns or rows[0])
    headers = [_fmt(c) for c in columns]
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return escape(str(value))


def read_template_file(path: str, task: TaskConfig) -> Template:
    """A template from a file: YAML record (text, variables, constraints, decision) or plain template text.

    The task's constraints on its input hold for a template from a file too; a record's own constraints add to them.
    """
    file, name = Path(path), config.excerpt(path)
    if file.suffix in (".yaml", ".yml"):
        template = Template.from_dict(load_yaml_mapping(file, "template file"))
    else:
        config.check_file(file, "template file", config.MAX_TASK_FILE_BYTES)
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"template file {name} is not UTF-8 text (byte {exc.start} is not valid UTF-8): "
                              "save it as UTF-8") from None
        template = Template.from_text(text.rstrip("\n"))
    if set(template.variables) != set(task.input_variables):
        wanted = ", ".join("{" + v + "}" for v in task.input_variables)
        declared = template.variables[:5] + (("...",) if len(template.variables) > 5 else ())
        raise TemplateError(f"template in {name} declares {len(template.variables)} variable(s) {list(declared)}; "
                            f"task {task.name!r} fills {wanted}")
    task_constraints = tuple(constraints_from_spec(task.template.constraints))
    return Template(template.text, template.variables, tuple(dict.fromkeys(task_constraints + template.constraints)),
                    template.decision)


# --- commands ---------------------------------------------------------------------------------
def cmd_tasks(args) -> int:
    rows = []
    for name in builtin_tasks() + list(args.files or []):
        s, _ = summarize(load_task(name))
        rows.append(
            {
                "task": s["task"],
                "examples": s["examples"],
                "labels": s["output"] or balance(s),
                "train/dev/test": "/".join(str(n) for n in s["splits"].values()),
                "source": s["source"],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in rows]))
    return 0


def balance(summary: dict) -> str:
    """``summarize``'s label counts as 'high_risk 561 (12%), low_risk 3973 (88%)'."""
    n = summary["examples"]
    return ", ".join(f"{label} {count} ({count / n:.0%})" for label, count in summary["labels"].items())


def cmd_validate(args) -> int:
    from functools import cache

    from pipelines.engine.models import load_tokenizer

    # the embedded target's tokenizer counts template tokens, as a run's scorer does; loaded once, and only
    # when a file gets that far (a broken file is refused without it)
    tokenizer = cache(load_tokenizer)
    count_tokens = lambda text: len(tokenizer()(text, add_special_tokens=False).input_ids)  # noqa: E731
    reports = []
    for path in args.files:
        r = validate_task(path, count_tokens)
        reports.append(r)
        if args.json:
            continue
        expected = (f"reference {json.dumps(r['example']['reference'], ensure_ascii=False)}" if r["output"]
                    else f"label {r['example']['label']}")
        print(f"task {escape(r['task'])} ({escape(r['file'])})")
        print(f"  data: {r['examples']} examples from {escape(r['source'])}: {escape(r['output'] or balance(r))}")
        print("  splits: " + ", ".join(f"{name} {n}" for name, n in r["splits"].items()))
        print(f"  seed template: {r['template_tokens']} of {r['max_tokens']} tokens; on the first dev example "
              f"({escape(expected)}):")
        print("    " + escape(r["example"]["prompt"], keep="\n\t").replace("\n", "\n    "))
        print("ok")
    if args.json:
        print(json.dumps(reports, indent=2, ensure_ascii=False))
    return 0


def cmd_render(args) -> int:
    task = load_task(args.task)
    template = read_template_file(args.template, task) if args.template else task.seed_template()
    splits = split_examples(task, load_examples(task))
    examples = splits[args.split][: args.n]
    chat = None
    if args.chat:
        from pipelines.engine.models import load_tokenizer

        chat = load_tokenizer(args.model)
    rendered = []
    for example in examples:
        prompt = template.render(example.inputs(task.input_variable))
        if chat is not None:
            prompt = chat.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        expected = {"reference": example.reference} if task.is_generation else {"label": example.label}
        rendered.append({**expected, "prompt": prompt})
    if args.json:
        print(json.dumps({"task": task.name, "template": template.to_dict(), "examples": rendered}, indent=2))
        return 0
    # Data and template text are printed as they are, line breaks and tabs included, but escaped where they hold
    # terminal escapes or lone surrogates (which JSON data can carry and printing cannot encode).
    print(f"task {escape(task.name)}: template ({len(template.text)} characters, variables {list(template.variables)})")
    print("  " + escape(template.text, keep="\n\t").replace("\n", "\n  "))
    for i, item in enumerate(rendered, 1):
        expected = (f"reference: {json.dumps(item['reference'], ensure_ascii=False)}" if task.is_generation
                    else f"label: {item['label']}")
        print(f"\n--- example {i} of the {args.split} split ({escape(expected)}) ---")
        print(escape(item["prompt"], keep="\n\t"))
    return 0


def evaluation_report(task: TaskConfig, ev, name: str) -> dict:
    """One template's evaluation as a flat, JSON-ready record (``Evaluation.as_record``, the reward's weights beside)."""
    record = ev.as_record()
    reward = {"total": record["reward"]["total"], "weights": dict(task.reward.weights),
              "components": record["reward"]["components"]}
    return {"task": task.name, "template_name": name, **record, "reward": reward}


def print_report(report: dict) -> None:
    print(f"task {report['task']} · {report['split']} split ({report['examples']} examples) · template {report['template_name']}")
    print("  " + report["template"].replace("\n", "\n  "))
    if not report["valid"]:
        print("INVALID: " + "; ".join(report["invalid_reasons"]))
        print(f"total reward {report['reward']['total']:.3f} (the invalid-candidate penalty)")
        return
    rows = []
    for name, value in report["reward"]["components"].items():
        weight = report["reward"]["weights"].get(name, 0.0)
        rows.append({"component": name, "value": "n/a" if value is None else value, "weight": float(weight),
                     "weighted": "n/a" if value is None else value * weight})
    rows.append({"component": "TOTAL REWARD", "value": "", "weight": "", "weighted": report["reward"]["total"]})
    print()
    print(table(rows))
    print()
    rule = report["decision"] or {}
    auc = "roc_auc (label log-odds, macro one-vs-rest)" if len(rule.get("labels", ())) > 2 else "roc_auc (label log-odds)"
    metric_rows = [{"metric": auc if k == "roc_auc" else f"{k} (production decision: {rule.get('kind')})", "value": v}
                   for k, v in report["metrics"].items()]
    for name, r in report["rates"].items():
        metric_rows.append({"metric": f"{name} rate", "value": f"{r['kept']}/{r['of']}" + (f" = {r['rate']:.3f}" if r["of"] else "")})
    if report["decision_threshold"] is not None:
        metric_rows.append({"metric": "decision threshold (log-odds, fitted on train)", "value": report["decision_threshold"]})
    for label, offset in zip(rule.get("labels", ()), rule.get("offsets") or ()):
        metric_rows.append({"metric": f"decision offset of {label} (fitted on train)", "value": offset})
    metric_rows += [{"metric": f"PDR {k}", "value": v} for k, v in report["pdr"].items()]
    metric_rows += [{"metric": f"judge P(yes) {k}", "value": "n/a" if v is None else v} for k, v in report["judge"].items()]
    metric_rows.append({"metric": "template tokens", "value": report["template_tokens"]})
    for k, v in report["latency_ms"].items():
        metric_rows.append({"metric": f"target latency {k} (ms, one request)", "value": v})
    if report["request_error_rate"] is not None:
        metric_rows.append({"metric": "target request error rate", "value": report["request_error_rate"]})
    if report["render_us_p99"] is not None:
        metric_rows.append({"metric": "render p99 (us)", "value": report["render_us_p99"]})
    metric_rows += [{"metric": f"timing {k}", "value": v} for k, v in report["timing_s"].items()]
    print(table(metric_rows))
    if report["samples"]:
        print("\nsampled answers (input -> what the target said -> what the contract made of it):")
        for sample in report["samples"]:
            print(f"  {sample['input'][:60]!r} -> {sample['answer']!r} -> {sample['parsed']!r}"
                  f"{'' if sample['contract_kept'] else ' (contract broken)'}")


def add_task_flag(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--task", required=required,
                   help=f"a built-in task ({', '.join(builtin_tasks())}) or a task YAML file")


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


def make_scorer(args, task: TaskConfig, splits):
    """eval's and check's CandidateScorer (endpoints are checked with GET /models first)."""
    from pipelines.scoring import build_scorer

    target, judge = model_sources(args)
    if not args.json:
        for role, source in (("target", target), ("judge", judge)):
            if isinstance(source, Endpoint):
                print(f"{role}: {source.model} at {source.url}", file=sys.stderr)
            elif source is not None or role == "target":
                print(f"loading {role} model {source} ...", file=sys.stderr)
    try:
        return build_scorer(task, splits, target, judge)
    except ValueError as exc:  # a URL or model name the endpoint scorer refuses
        raise ConfigError(str(exc)) from None


def cmd_eval(args) -> int:
    task = load_task(args.task)
    template = read_template_file(args.template, task) if args.template else task.seed_template()
    splits = split_examples(task, load_examples(task))
    t0 = time.perf_counter()
    scorer = make_scorer(args, task, splits)
    load_s = time.perf_counter() - t0
    ev = scorer.evaluate(template.text, args.split)
    report = evaluation_report(task, ev, args.template or "seed")
    report["timing_s"]["load_model_s"] = round(load_s, 3)
    if hasattr(scorer.target, "base_url"):
        report["target_endpoint"] = {"url": scorer.target.base_url, "model": scorer.target.model, **scorer.target.stats.as_dict()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def tuning_setup(args, store_url: str | None) -> tuple[TaskConfig, RunOptions]:
    """The task (with the flags that override it) and the run options of a tuning run."""
    task = load_task(args.task)
    changes = {}
    if args.candidates is not None:
        changes["generation.candidates_per_step"] = args.candidates
    if args.seed is not None:
        changes["ppo.seed"] = args.seed
    if changes:
        task = task.with_overrides(**changes)
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir, the folder of the run to continue")
    target, judge = model_sources(args)
    options = RunOptions(
        steps=args.steps or task.ppo.steps, policy_model=args.policy_model, target=target, judge=judge,
        max_target_calls=args.max_target_calls, max_tokens=args.max_tokens,
        num_scorers=args.num_scorers, ray_address=args.ray_address, finalists=args.finalists,
        run_dir=args.run_dir or str(Path("runs") / f"{task.name}-{time.strftime('%Y%m%d-%H%M%S')}"),
        dev_examples=args.dev_examples or None, wandb_mode=args.wandb_mode, wandb_project=args.wandb_project,
        wandb_entity=args.wandb_entity, store_url=store_url, promote=not args.no_promote, progress=not args.json,
    )
    return task, options


def run_tuning(task: TaskConfig, options: RunOptions, *, resume: bool, json_output: bool) -> dict:
    """The local tuning run, with its progress on the terminal and its final table (unless JSON is wanted)."""
    from pipelines.loop import tune

    log = (lambda *a: print(*a, file=sys.stderr)) if json_output else print
    log(f"tune-prompts: task {task.name}, {options.steps} steps x {task.generation.candidates_per_step} candidates, "
        f"run folder {options.run_dir}")
    report = tune(task, options, resume=resume, log=log)
    if not json_output:
        print_final_table(task, report)
    return report


def cmd_tune(args) -> int:
    task, options = tuning_setup(args, None if args.no_store else (args.store or default_store_url()))
    if args.estimate:
        return print_estimate(task, options, json_output=args.json)
    if args.backend == "openrlhf":
        from pipelines.rl.cluster_job import prepare_job

        return prepare_job(task, options, dry_run=args.dry_run, json_output=args.json)
    report = run_tuning(task, options, resume=args.resume, json_output=args.json)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def print_estimate(task: TaskConfig, options: RunOptions, *, json_output: bool) -> int:
    """``--estimate``: the calls and tokens the run would take, priced by the run's own scoring code, and for a
    local run its wall time on this machine (the scorer timed for a few seconds on the seed); writes nothing."""
    from pipelines.budget import Budget, Timing, calibrate, estimate, local_seconds, scoring_tokenizer
    from pipelines.scoring import answer_tokens

    splits = split_examples(task, load_examples(task))
    plan = estimate(task, options, splits, scoring_tokenizer(options.target))
    budget = Budget(options.max_target_calls, options.max_tokens)
    smallest = plan.affords(budget, plan.phases.get("seed", {}), 0) if budget else None
    affordable = plan.affordable_steps(budget)
    seconds = None
    if not isinstance(options.target, Endpoint) and not isinstance(options.judge, Endpoint):
        # a local run's wall time: this machine's scoring rate, timed now on the seed (a few seconds)
        timing = Timing.scaled(calibrate(task, splits, options.target), min(options.num_scorers, os.cpu_count() or 1))
        seconds = local_seconds(plan, timing, task.generation.candidates_per_step)
    if json_output:
        print(json.dumps({**plan.as_dict(), "budget_steps": affordable,
                          "seconds": seconds and {k: round(v, 1) for k, v in seconds.items()}}, indent=2))
        return 0
    where = {"target": options.target, "judge": options.judge or options.target, "policy": options.policy_model}
    print(f"estimate for task {task.name}: {options.steps} steps x {task.generation.candidates_per_step} candidates, "
          f"{len(splits.dev) if options.dev_examples is None else min(options.dev_examples, len(splits.dev))} dev "
          f"examples per reward, the seed and {options.finalists or task.selection.shortlist} candidate(s) on "
          f"{len(splits.dev)} dev examples, at most one on {len(splits.test)} test examples")
    for role, source in where.items():
        print(f"  {role}: {source.model + ' at ' + source.url if isinstance(source, Endpoint) else source}")
    print(table(plan.rows()))
    print("A call is one request a server would bill (see pipelines/engine/usage.py). Calls assume every candidate "
          "is valid and new (invalid or repeated ones cost nothing); completion tokens assume every answer runs to "
          f"its limit ({answer_tokens(task)} tokens), so the run takes at most these.")
    if seconds:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if k != "total")
        print(f"wall time on this machine, about {seconds['total'] / 60:.1f} min ({parts}): prompt tokens at "
              f"{timing.tokens_per_s:.0f}/s per scoring worker x {timing.workers} (timed just now on the seed), the "
              f"policy at {timing.policy_s_per_candidate:.1f} s per candidate (docs/endpoints.md, \"The cost model\")")
    if budget:
        if smallest:
            print(f"the budget cannot pay for the seed and the final test: {smallest}")
        else:
            print(f"the budget pays for {affordable} of the {options.steps} steps, the seed and the final test")
    return 0


def print_choice(task: TaskConfig, choice: dict) -> None:
    """The choice on dev: the seed and each shortlisted candidate, ranked, with every bar it met or missed."""
    metric = task.scoring.metric
    print(f"\nthe choice on the whole dev split (the gate's bars with the task's selection margins; seed included):")
    columns = ["name", metric, *task.promotion.thresholds, "tokens", "latency_p95_ms", "gain", "p_value",
               "feasible", "beats_seed", "chosen"]
    print(table(choice["ranking"], columns))
    for row in choice["ranking"]:
        if row["name"] == "seed":
            continue
        print(f"  {row['name']}: {row['instruction']!r}")
        for reason in row["bars"]:
            print(f"    {reason}")
    if choice.get("front"):
        print("  front of " + metric + " against tokens: " + ", ".join(
            f"{p['name']} ({p['tokens']} tokens, {p[metric]:.3f})" for p in choice["front"]))


def print_learning(rows: list[dict]) -> None:
    """Per step, what the policy's samples got."""
    if rows:
        print("\nlearning: per step, the policy's samples (mean reward, share that met every promotion threshold in "
              "its step, share valid) and the best reward so far")
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in rows]))


def print_final_table(task: TaskConfig, report: dict) -> None:
    print_learning(report.get("learning", []))
    if report.get("choice"):
        print_choice(task, report["choice"])
    rows = report["test"]
    metric = task.scoring.metric
    second = "token_f1" if task.is_generation else "roc_auc"
    columns = ["template_name", metric, *([second] if second != metric else []), "instruction_following_n", "instruction_following",
               "entity_consistency_n", "entity_consistency", "readability", "total_reward", *task.judge.all_rubrics,
               *[k for k in rows[0] if k.startswith("pdr/")], "tokens", "latency_p95_ms", "gate_passed"]
    decision = next((r["decision"] for r in rows if r.get("decision")), task.scoring.decision)
    print(f"\nheld-out test split ({task.name}): the seed template{' vs the chosen candidate' if len(rows) > 1 else ''}; "
          f"{metric} is what an application gets under the {decision} decision; the rates count the target's answers")
    print(table(rows, columns))
    print("\nthe gate on each (the seed as if it had no incumbent, the chosen candidate against the seed):")
    for row in rows:
        print(f"  {row['template_name']}: {'PASSES' if row.get('gate_passed') else 'REFUSED'}")
        for reason in row.get("gate_reasons") or []:
            print(f"    {reason}")
    seed = rows[0][metric]
    tuned = rows[1] if len(rows) > 1 else None  # the best by whole-dev reward: chosen without looking at test
    if tuned is not None and seed is not None and tuned[metric] is not None:
        print(f"\n{metric}: seed {seed:.3f} -> tuned {tuned[metric]:.3f} ({tuned[metric] - seed:+.3f}), "
              f"the candidate chosen on the whole dev split")
    print("\ninstructions:")
    for row in rows:
        print(f"  {row['template_name']}: {row['instruction']!r}")
    if "promotion" in report:
        p = report["promotion"]
        written = (f"version {p['version']} {'PROMOTED' if p['promoted'] else 'recorded, not promoted'}"
                   if p.get("version") is not None else "no candidate recorded")
        print(f"\nstore: {written}; production is version {p['production']}")
        for reason in p["reasons"]:
            print(f"  {reason}")
    usage = report.get("usage", {}).get("total", {})
    if usage:
        print("\ncalls (requests a server would bill) and tokens: " + "; ".join(
            f"{role} {u['calls']} ({u['prompt_tokens']} prompt + {u['completion_tokens']} completion)"
            for role, u in usage.items()))
    if report.get("stopped"):
        print(f"stopped before the last step: {report['stopped']}")
    if report.get("choice") and not report["choice"]["chosen"]:
        print(f"\n{report['choice']['verdict']}")
    page = Path(report["run_dir"]) / "report.html"
    print(f"\nreport: {report['run_dir']}/report.json{f'  page: {page}' if page.is_file() else ''}   "
          f"W&B (offline) run: {report['wandb_folder']}")


def input_values(task: TaskConfig, text: str) -> dict[str, str]:
    """One --text as the template's values: the text itself, or for a task with several inputs a JSON object of
    them (e.g. '{"category": "laptops", "price_range": "500-800"}')."""
    if len(task.input_variables) == 1:
        return {task.input_variable: text}
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, dict) or set(values) != set(task.input_variables):
        example = json.dumps({name: "..." for name in task.input_variables})
        raise ConfigError(f"task {task.name!r} takes several inputs: give each --text as a JSON object with exactly "
                          f"the keys {list(task.input_variables)}, e.g. '{example}'")
    return values


def cmd_predict(args) -> int:
    """The serving path from the command line: the routed version, the target's log-probs, its decision."""
    from pipelines.scoring import label_scorer
    from rewards.judge import JUDGE_VERBALIZERS
    from templates.serving import TemplateReader

    task = load_task(args.task)
    store = args.store or default_store_url()
    target_source, _ = model_sources(args)
    reader = TemplateReader(store, watch=False)  # one call: no watcher thread
    try:
        template = reader.for_caller(task.name, args.key) if args.key else reader.get(task.name, args.label)
        if template.decision is None:
            raise StoreError(f"the {task.name!r} version this call routes to carries no decision rule: store a newly "
                             f"evaluated version (a tuning run into {store} records one)")
        try:
            # a generation version reads no labels: its scorer is only asked for answers
            words = template.decision.verbalizers or JUDGE_VERBALIZERS
            target = label_scorer(target_source, words,
                                  chat_template=task.template.chat_template, batch_size=task.scoring.batch_size)
        except ValueError as exc:  # a URL or model name the endpoint scorer refuses
            raise ConfigError(str(exc)) from None
        label = None if args.key else args.label
        out = [reader.predict(task.name, input_values(task, text), target, label=label, key=args.key)
               for text in args.text]
    finally:
        reader.close()
    if args.json:
        print(json.dumps([{"text": text, "label": p.label, "value": p.value, "version": p.version_id,
                           "logprobs": p.logprobs, "answer": p.answer, "contract_broken": p.reason or None}
                          for text, p in zip(args.text, out)], indent=2))
    else:
        for text, p in zip(args.text, out):
            said = "" if p.answer is None else f"\tanswer {p.answer!r}" + (f" ({p.reason})" if p.reason else "")
            result = p.label if p.label is not None else json.dumps(p.value) if p.value is not None else "NO RESULT"
            print(f"{result}\tversion {p.version_id}\t{text[:80]!r}{said}")
    return 0


def cmd_check(args) -> int:
    from pipelines import drift

    task = load_task(args.task)
    store = args.store or default_store_url()
    drift.production_version(store, task.name)  # no store or no production label: exit 2 before loading models
    scorer = make_scorer(args, task, split_examples(task, load_examples(task)))
    report = drift.check_production(task, scorer, store, split=args.split, min_metric=args.min_metric,
                                    max_drop=args.max_drop)
    verdict = (f"check: production version {report['version']} of {task.name} "
               f"{'holds' if report['passed'] else 'is BELOW its bars'} on the {args.split} split ({report['examples']} examples)")
    if not args.json:
        rows = [{"bar": b["name"], "value": "n/a" if b["value"] is None else b["value"],
                 "minimum": "-" if b["minimum"] is None else b["minimum"],
                 "result": {True: "pass", False: "FAIL", None: "not checked"}[b["passed"]]} for b in report["bars"]]
        print(f"task {task.name}: production version {report['version']} on the {args.split} split, store {store}")
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in rows]))
        print(verdict)
    code = 0 if report["passed"] else 1
    if not report["passed"] and args.tune_if_below:
        if not args.json:
            print(f"tuning {task.name} (--tune-if-below) ...")
        task, options = tuning_setup(args, store)  # the tuning run records into the same store
        report["tuning"] = run_tuning(task, options, resume=args.resume, json_output=args.json)
        code = 0
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return code


def cmd_schedule(args) -> int:
    from pipelines import schedule

    if (args.cron is None) == (args.every_s is None):
        raise ConfigError("give one of --cron 'MIN HOUR DAY MONTH WEEKDAY' (e.g. '0 3 * * *') or --every-s SECONDS")
    next_tick = schedule.cron_ticks(schedule.Cron.parse(args.cron)) if args.cron else schedule.interval_ticks(args.every_s)
    entrypoint = args.entrypoint or schedule.check_entrypoint(args.task, command=args.command, store=args.store,
                                                              split=args.split)
    run_dir = Path(args.run_dir or Path("runs") / f"schedule-{args.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    scheduler = schedule.Scheduler(schedule.connect(args.ray_address), args.task, entrypoint, next_tick,
                                   run_dir / "schedule.jsonl", poll_s=args.poll_s)
    print(f"scheduling {args.task} on {args.ray_address} ({args.cron or f'every {args.every_s:g} s'}); "
          f"log {scheduler.log_path}; Ctrl-C stops")
    schedule.serve(scheduler, args.max_ticks)
    return 0


def cmd_report(args) -> int:
    """A run's report page from its report.json (a run writes it too; this draws it again, or elsewhere)."""
    from pipelines import run_report

    run_dir = Path(args.run_dir)
    report = run_report.read_report(run_dir)
    out = run_report.output_path(run_dir, args.out)
    try:
        run_report.write_html(report, out)
    except OSError as exc:
        raise ConfigError(f"cannot write {out} ({exc.strerror}): give a writable --out FILE") from None
    print(f"report: {escape(str(out))}")
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (still exit 2); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message, 300)}; see {self.prog} --help\n")


def number(kind: type, low: float, high: float, *, above: bool = False):
    """An argparse type: a finite ``kind`` (int or float) from ``low`` (more than it, with ``above``) to ``high``."""
    def parse(text: str):
        try:
            value = kind(text)  # int() refuses '1e30' and numbers of thousands of digits
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r} is not a {'whole number' if kind is int else 'number'}") from None
        if not math.isfinite(value) or value < low or value > high or (above and value == low):
            bounds = f"{'more than' if above else 'from'} {low:,.12g} to {high:,.12g}"
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range: give a number {bounds}")
        return value
    parse.bounds = (low, high, kind is int, above)  # what the tests feed it
    return parse


def setting(model: type[BaseModel], name: str):
    """The argparse type of the flag that gives ``model``'s field ``name``: its number type and the bounds its
    Field states, so that a flag accepts what the task file (or ``FlagSettings``) accepts and nothing else."""
    field = model.model_fields[name]
    kind = float if float in (field.annotation, *get_args(field.annotation)) else int
    low, high, above = -math.inf, math.inf, False
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            low = bound.ge
        elif isinstance(bound, annotated_types.Gt):
            low, above = bound.gt, True
        elif isinstance(bound, annotated_types.Le):
            high = bound.le
        elif isinstance(bound, annotated_types.Lt):  # no flag's field has one; a float flag would need 'below'
            raise TypeError(f"{model.__name__}.{name}: give the flag's bound as le, not lt")
    return number(kind, low, high, above=above)


example_count = number(int, 1, MAX_RENDER_EXAMPLES)  # render's -n


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tune-prompts",
        description="Tune LLM prompt templates with reinforcement learning. With --task and no command, runs the\n"
        "tuning job: a policy model writes candidate instructions, each is scored on the task's data (its metric,\n"
        "an LLM judge, robustness, tokens, latency), PPO updates the policy, and the candidate chosen on dev is\n"
        "tested and put through the promotion gate into the template store. Each command's --help has examples.\n"
        "Exit 0: done; 2: bad input (one line saying what to fix); 1: a failure (check: below a bar).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tune-prompts --task risk\n  tune-prompts --task risk --estimate\n"
        "  tune-prompts --task risk --steps 1 --candidates 4 --dev-examples 0 --no-store\n"
        "  tune-prompts --task risk --target-url http://localhost:8000/v1 "
        "--target-model HuggingFaceTB/SmolLM2-135M-Instruct\n"
        "  tune-prompts tasks\n  tune-prompts render --task risk -n 3\n  tune-prompts eval --task risk --split test",
    )
    # the help's example defaults (YAML and pydantic, no data), from config itself: a command's load_task may be
    # replaced (tests do) without breaking the parser
    risk = config.load_task("risk")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an unexpected error (also TUNE_PROMPTS_DEBUG=1)")
    add_task_flag(parser, required=False)
    tuning = parser.add_argument_group("tuning (with --task and no command)")
    tuning.add_argument("--steps", type=setting(PPOConfig, "steps"),
                        help=f"steps of the loop (default: the task's ppo.steps; risk: {risk.ppo.steps})")
    tuning.add_argument("--candidates", type=setting(GenerationConfig, "candidates_per_step"),
                        help="candidates per step, one group (default: the task's "
                        f"generation.candidates_per_step; risk: {risk.generation.candidates_per_step})")
    tuning.add_argument("--dev-examples", type=setting(FlagSettings, "dev_examples"), default=RunOptions.dev_examples,
                        help="dev examples per candidate reward (default %(default)s; 0: all)")
    tuning.add_argument("--finalists", type=setting(SelectionConfig, "shortlist"),
                        help="candidates evaluated on the whole dev split beside the seed, under the gate's bars "
                             f"(default: the task's selection.shortlist; risk: {risk.selection.shortlist}); at most "
                             "one, the chosen, is tested")
    tuning.add_argument("--run-dir", help="run folder for checkpoints, report and W&B files (default runs/<task>-<time>)")
    tuning.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    tuning.add_argument("--seed", type=setting(PPOConfig, "seed"), help="the run's seed: sampling and PPO minibatch order (default: the "
                        f"task's ppo.seed; risk: {risk.ppo.seed}); the data split has its own, split.seed")
    tuning.add_argument("--backend", choices=["local", "openrlhf"], default="local",
                        help="local: this machine's PPO loop (default); openrlhf: write the train_ppo_ray job and submit it")
    tuning.add_argument("--dry-run", action="store_true", help="with --backend openrlhf: print the job instead of submitting it")
    tuning.add_argument("--ray-address", help="Ray cluster address (default: a local Ray)")
    tuning.add_argument("--num-scorers", type=setting(FlagSettings, "num_scorers"), default=RunOptions.num_scorers,
                        help="Ray scoring actors, each with an equal share of the CPUs (default %(default)s; at most "
                        "one per CPU)")
    tuning.add_argument("--policy-model", default=EMBEDDED,
                        help="the policy that writes instructions: the embedded model or a Hugging Face folder")
    add_model_flags(parser, command=False)
    budget = parser.add_argument_group("budget (see --estimate)")
    budget.add_argument("--max-target-calls", type=setting(FlagSettings, "max_target_calls"),
                        help="stop before the step that, with the final test, would pass this many target calls")
    budget.add_argument("--max-tokens", type=setting(FlagSettings, "max_tokens"),
                        help="the same for the target's and the judge's prompt + completion tokens")
    budget.add_argument("--estimate", action="store_true",
                        help="print the calls and tokens the run will take, per phase and model, and for a local "
                        "model its wall time on this machine (its scorer timed for a few seconds); tunes nothing")
    cli_store.add_store_flag(tuning)
    tuning.add_argument("--no-store", action="store_true", help="do not record the result in the store")
    tuning.add_argument("--no-promote", action="store_true", help="record the result but never move production")
    tuning.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=RunOptions.wandb_mode,
                        help="W&B logging (default %(default)s: files in the run folder, nothing sent)")
    tuning.add_argument("--wandb-project", default=RunOptions.wandb_project, help="(default %(default)s)")
    tuning.add_argument("--wandb-entity")
    cli_store.add_json_flag(tuning, "the final report")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "tasks", help="list tasks with data sizes and label balance", formatter_class=raw,
        description="List the built-in tasks, and the task files given: examples, label balance (a generation\n"
        "task: its output contract), train/dev/test sizes and data source. Reads the data; loads no model.",
        epilog="examples:\n  tune-prompts tasks\n  tune-prompts tasks my_task/task.yaml --json")
    p.add_argument("files", nargs="*", help="extra task YAML files to include")
    cli_store.add_json_flag(p, "one record per task")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser(
        "render", help="show a template rendered on a few examples", formatter_class=raw,
        description="Render a template (the task's seed, or --template FILE) on the first examples of a split and\n"
        "print each prompt as the target model receives it, with its expected label or reference. Loads no model\n"
        "(--chat loads the model's tokenizer, for its chat template).",
        epilog="examples:\n  tune-prompts render --task risk -n 3\n"
        "  tune-prompts render --task risk --template my_template.txt --split test --chat")
    add_task_flag(p)
    p.add_argument("--template", help="a template file (YAML record or plain text); default: the task's seed template")
    p.add_argument("--split", default="dev", choices=["train", "dev", "test"], help="(default %(default)s)")
    p.add_argument("-n", type=example_count, default=3,
                   help=f"how many examples, 1 to {MAX_RENDER_EXAMPLES} (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target model's chat template")
    p.add_argument("--model", default=None, help="model whose chat template --chat uses (default: the embedded one)")
    cli_store.add_json_flag(p, "the template and the rendered prompts")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "eval", help="score a template: every reward component on the dev or test split, with timing",
        formatter_class=raw,
        description="Score one template (the task's seed, or --template FILE) as a tuning run scores a candidate:\n"
        "each reward component with its weight and the total, the held-out metric under the task's decision, the\n"
        "contract rates, PromptBench PDR, the judge's rubrics, tokens, latency, and the time each part took.",
        epilog="examples:\n  tune-prompts eval --task risk --split test\n"
        "  tune-prompts eval --task risk --template my_template.txt --json\n"
        "  tune-prompts eval --task risk --target-url http://localhost:8000/v1 --target-model "
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    add_task_flag(p)
    p.add_argument("--template", help="a template file (YAML record or plain text); default: the task's seed template")
    p.add_argument("--split", default="dev", choices=["dev", "test"], help="(default %(default)s)")
    cli_store.add_json_flag(p, "the evaluation report")
    add_model_flags(p, command=True)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "check", help="drift check: score the production template on fresh data against its bars",
        formatter_class=raw,
        description="Score the task's production template (from the store) and compare it with the task's "
        "promotion\nthresholds and a held-out metric bar. The target and judge flags go before or after the command;\n"
        "the tuning flags go before it and apply with --tune-if-below.\nExit 0: every bar holds; 1: below a bar "
        "(with --tune-if-below: the tuning run's exit code); 2: bad input,\nno store, no production template.",
        epilog="examples:\n  tune-prompts check --task risk --store sqlite:///runs/store.sqlite\n"
        "  tune-prompts check --task risk --split dev --min-metric 0.75 --json\n"
        "  tune-prompts --steps 4 --num-scorers 2 --ray-address auto check --task risk --tune-if-below")
    add_task_flag(p)
    cli_store.add_store_flag(p)
    p.add_argument("--split", default="test", choices=["dev", "test"],
                   help="(default %(default)s: tuning never reads it, so it stands for fresh data; point the task's "
                   "data.source at newly labelled data to check on that)")
    p.add_argument("--min-metric", type=setting(FlagSettings, "min_metric"), help="bar for the task's held-out metric (default: the figure the "
                   "store recorded for this version on test, minus --max-drop)")
    p.add_argument("--max-drop", type=setting(FlagSettings, "max_drop"), default=DEFAULT_MAX_DROP,
                   help="allowed drop of the held-out metric (default %(default)s)")
    p.add_argument("--tune-if-below", action="store_true", help="below a bar: start a tuning run into the same store")
    cli_store.add_json_flag(p, "the check's report (with --tune-if-below, the tuning run's inside it)")
    add_model_flags(p, command=True)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "predict", help="what production receives: the stored version's decision on one or more inputs",
        formatter_class=raw,
        description="Render the version the store routes to (production, a --label, or the caller --key's A/B\n"
        "route), ask the target model for its label log-probs (a generation task: its answer), and apply the\n"
        "decision rule stored with that version (e.g. the threshold fitted on train). TemplateReader.predict does\n"
        "the same in an application. A task with several inputs takes each --text as a JSON object of them.",
        epilog="examples:\n  tune-prompts predict --task risk --text 'WIN a prize! Call 0906...' --text 'see you at 7'\n"
        "  tune-prompts predict --task risk --label staging --json --text 'Your parcel is held: pay the fee here'\n"
        "  tune-prompts predict --task risk --key user-17 --target-url http://localhost:8000/v1 "
        "--target-model HuggingFaceTB/SmolLM2-135M-Instruct --text 'see you at 7'")
    add_task_flag(p)
    p.add_argument("--text", required=True, action="append", help="an input; repeat for several")
    cli_store.add_store_flag(p)
    p.add_argument("--label", default="production", help="the label to read (default %(default)s)")
    p.add_argument("--key", help="a caller key: route as the A/B canary does for this caller (instead of --label)")
    cli_store.add_json_flag(p, "the predictions")
    add_model_flags(p, command=True)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser(
        "schedule", help="submit check-and-tune jobs to a Ray cluster on a schedule", formatter_class=raw,
        description="At each tick of a cron schedule (or every N seconds), submit one job to a Ray cluster through\n"
        "its job API: by default `tune-prompts check --task TASK --tune-if-below`, which tunes only when the\n"
        "production template has fallen below its bars. A tick while the task's job still runs is skipped. Every\n"
        "event goes to RUN_DIR/schedule.jsonl and stdout; Ctrl-C stops (a running job keeps running).",
        epilog="examples:\n  tune-prompts schedule --task risk --ray-address http://localhost:8265 --cron '0 3 * * *'\n"
        "  tune-prompts schedule --task risk --ray-address http://localhost:8265 --every-s 3600 --max-ticks 24 "
        "--store postgresql://tune@db/prompts")
    add_task_flag(p)
    p.add_argument("--ray-address", required=True, help="the cluster's job API, e.g. http://HEAD:8265")
    p.add_argument("--cron", help="5-field cron (local time), e.g. '0 3 * * *' for 03:00 daily")
    p.add_argument("--every-s", type=setting(FlagSettings, "every_s"), help="instead of --cron: a tick every N seconds, the first at once")
    p.add_argument("--max-ticks", type=setting(FlagSettings, "max_ticks"), help="stop after N ticks, once their jobs end (default: run until stopped)")
    cli_store.add_store_flag(p, "; the store the job checks and tunes into, as the cluster sees it")
    p.add_argument("--split", default="test", choices=["dev", "test"], help="the job's check split (default %(default)s)")
    p.add_argument("--command", default=".venv/bin/tune-prompts", help="tune-prompts as the cluster runs it, relative "
                   "to where Ray was started on the head (default %(default)s)")
    p.add_argument("--entrypoint", help="a shell command to submit instead of the check-and-tune job")
    p.add_argument("--run-dir", help="folder for schedule.jsonl (default runs/schedule-<task>-<time>)")
    p.add_argument("--poll-s", type=setting(FlagSettings, "poll_s"), default=FlagSettings().poll_s, help="how often job statuses are polled (default %(default)s s)")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser(
        "validate", help="check task files as a run reads them (data, labels, splits, seed template), loading no model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load each task file with the code a run uses, read its data, map its labels, make the\n"
        "splits, render the seed template on one example and count its tokens against template.max_tokens\n"
        "(with the embedded model's tokenizer; no model weights are loaded). Prints a short summary per file\n"
        "and 'ok'. Exit 0: every file is usable; 2: the first problem, in one line naming the fix.",
        epilog="examples:\n  tune-prompts validate my_task/task.yaml\n"
        "  tune-prompts validate --json risk tests/data/cases_4label.yaml")
    p.add_argument("files", nargs="+", metavar="TASK.yaml", help="task YAML files (or built-in task names: risk, ...)")
    cli_store.add_json_flag(p, "one record per file")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "report", help="write a run's report.html: learning curves, candidates, test, samples, gate, store, usage",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Draw one self-contained HTML page from a tuning run's report.json: the reward by step, the\n"
        "candidates each step produced, the seed against the chosen template on the held-out test split (with\n"
        "counts and 95% intervals), sample answers, the gate's decision with every bar, what the store recorded,\n"
        "and the calls, tokens and wall time. Figures are inline SVG; the page loads nothing from the network.\n"
        "A run writes RUN_DIR/report.html itself; this draws it again. Exit 0: written; 2: no such folder, no\n"
        "report.json, or a file that is not a run report.",
        epilog="examples:\n  tune-prompts report runs/risk-20261205-1200\n"
        "  tune-prompts report runs/risk-20261205-1200 --out /tmp/risk-report.html")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a tuning run's folder (its --run-dir), holding report.json")
    p.add_argument("--out", metavar="FILE", help="where to write the page (default RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)

    cli_store.register(sub).set_defaults(func=cli_store.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)  # a usage error exits 2 and --help 0 from here, as argparse does
    if args.command is None:
        if not args.task:
            parser.print_help()
            print("error: give a COMMAND, or --task TASK to tune", file=sys.stderr)
            return 2
        args.func = cmd_tune
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:
        print(f"error: {one_line(str(exc), 800)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug, or input no check foresaw: one line, unless asked for the traceback
        if args.debug or os.environ.get("TUNE_PROMPTS_DEBUG") == "1":
            traceback.print_exc()
        else:
            first = str(exc).split("\n", 1)[0]
            print(f"error: {type(exc).__name__}: {one_line(first, 200)}; rerun with --debug for the traceback",
                  file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
