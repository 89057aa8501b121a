"""The commands about the production template: ``predict`` (what it answers), ``check`` (whether it still holds
its bars, tuning again below them) and ``schedule`` (check-and-tune jobs on a Ray cluster, on a cron schedule)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipelines import cli_store
from pipelines.cli_eval import make_scorer
from pipelines.cli_flags import add_model_flags, add_task_flag, model_sources, setting
from pipelines.cli_output import table
from pipelines.cli_tune import run_tuning, tuning_setup
from pipelines.config import ConfigError, FlagSettings, TaskConfig
from pipelines.data import load_examples, split_examples
from pipelines.drift import DEFAULT_MAX_DROP
from pipelines.task_files import load_task
from templates.store import StoreError, default_store_url


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
            target = label_scorer(target_source, words, chat_template=task.template.chat_template,
                                  batch_size=task.scoring.batch_size)
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


def register_check(sub: argparse._SubParsersAction) -> None:
    """Add the ``check`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
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


def register_predict(sub: argparse._SubParsersAction) -> None:
    """Add the ``predict`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
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


def register_schedule(sub: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
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
