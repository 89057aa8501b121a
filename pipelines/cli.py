"""The `tune-prompts` command line.

    tune-prompts --task risk                 tune the risk task's template (the main job)
    tune-prompts tasks                       list tasks with data sizes and label balance
    tune-prompts render --task risk          show the seed template rendered on a few examples
    tune-prompts eval --task risk            score a template: every reward component, with timing
    tune-prompts store list|show|...         the versioned template store

Every command exits 0 on success, 2 on bad input (with one line saying what to fix), 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

from pipelines import cli_store
from pipelines.config import ConfigError, TaskConfig, builtin_tasks, load_task
from pipelines.data import DataError, label_counts, load_examples, split_examples
from pipelines.models import EMBEDDED, ModelLoadError
from rewards.judge import JudgeError
from templates.store import StoreError, default_store_url
from templates.template import Template, TemplateError

USER_ERRORS = (ConfigError, DataError, TemplateError, ModelLoadError, JudgeError, StoreError, FileExistsError, FileNotFoundError)


def quiet_libraries() -> None:
    """Keep third-party chatter (progress bars, deprecation notes) out of the CLI's output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not spin while Ray actors compute
    warnings.filterwarnings("ignore", message=".*pynvml.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """A plain aligned text table."""
    if not rows:
        return "(none)"
    columns = list(columns or rows[0])
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def read_template_file(path: str, task: TaskConfig) -> Template:
    """A template from a file: YAML record (text, variables, constraints) or plain template text."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"template file {path!r} does not exist")
    text = file.read_text(encoding="utf-8")
    if file.suffix in (".yaml", ".yml"):
        import yaml

        try:
            record = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"template file {path} is not valid YAML: {exc}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"template file {path} must hold a mapping with at least 'text'")
        template = Template.from_dict(record)
    else:
        template = task.make_template(text.rstrip("\n"))
    if template.variables != (task.input_variable,):
        raise TemplateError(
            f"template in {path} declares {list(template.variables)}; task {task.name!r} fills only "
            f"{{{task.input_variable}}}"
        )
    return template


# --- commands ---------------------------------------------------------------------------------
def cmd_tasks(args) -> int:
    rows = []
    for name in builtin_tasks() + list(args.files or []):
        task = load_task(name)
        examples = load_examples(task)
        splits = split_examples(task, examples)
        counts = label_counts(examples)
        balance = ", ".join(f"{label} {counts.get(label, 0)} ({counts.get(label, 0) / len(examples):.0%})" for label in task.labels)
        rows.append(
            {
                "task": task.name,
                "examples": len(examples),
                "labels": balance,
                "train/dev/test": f"{len(splits.train)}/{len(splits.dev)}/{len(splits.test)}",
                "source": task.data.source,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))
    return 0


def cmd_render(args) -> int:
    task = load_task(args.task)
    template = read_template_file(args.template, task) if args.template else task.seed_template()
    splits = split_examples(task, load_examples(task))
    examples = splits[args.split][: args.n]
    chat = None
    if args.chat:
        from pipelines.models import load_tokenizer

        chat = load_tokenizer(args.model)
    rendered = []
    for example in examples:
        prompt = template.render({task.input_variable: example.text})
        if chat is not None:
            prompt = chat.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        rendered.append({"label": example.label, "prompt": prompt})
    if args.json:
        print(json.dumps({"task": task.name, "template": template.to_dict(), "examples": rendered}, indent=2))
        return 0
    print(f"task {task.name}: template ({len(template.text)} characters, variables {list(template.variables)})")
    print("  " + template.text.replace("\n", "\n  "))
    for i, item in enumerate(rendered, 1):
        print(f"\n--- example {i} of the {args.split} split (label: {item['label']}) ---")
        print(item["prompt"])
    return 0


def evaluation_report(task: TaskConfig, ev, name: str) -> dict:
    """One template's evaluation as a flat, JSON-ready record."""
    m = ev.measured
    return {
        "task": task.name,
        "template_name": name,
        "template": m.template,
        "split": ev.split,
        "examples": ev.n_examples,
        "valid": m.valid,
        "invalid_reasons": list(m.reasons),
        "reward": {"total": ev.reward.total, "weights": dict(task.reward.weights), "components": dict(ev.reward.components)},
        "metrics": dict(m.metrics),
        "decision_threshold": ev.threshold,
        "pdr": dict(m.pdr),
        "judge": dict(m.judge),
        "template_tokens": m.tokens,
        "latency_ms": dict(ev.latency_ms),
        "render_us_p99": ev.render_us_p99,
        "timing_s": {k: round(v, 3) for k, v in m.timing.items()},
    }


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
    metric_rows = [{"metric": k, "value": v} for k, v in report["metrics"].items()]
    if report["decision_threshold"] is not None:
        metric_rows.append({"metric": "decision threshold (log-odds, fitted on train)", "value": report["decision_threshold"]})
    metric_rows += [{"metric": f"PDR {k}", "value": v} for k, v in report["pdr"].items()]
    metric_rows += [{"metric": f"judge P(yes) {k}", "value": "n/a" if v is None else v} for k, v in report["judge"].items()]
    metric_rows.append({"metric": "template tokens", "value": report["template_tokens"]})
    for k, v in report["latency_ms"].items():
        metric_rows.append({"metric": f"target latency {k} (ms, one request)", "value": v})
    if report["render_us_p99"] is not None:
        metric_rows.append({"metric": "render p99 (us)", "value": report["render_us_p99"]})
    metric_rows += [{"metric": f"timing {k}", "value": v} for k, v in report["timing_s"].items()]
    print(table(metric_rows))


def cmd_eval(args) -> int:
    from pipelines.scoring import CandidateScorer
    from pipelines.models import load_causal_lm

    task = load_task(args.task)
    template = read_template_file(args.template, task) if args.template else task.seed_template()
    splits = split_examples(task, load_examples(task))
    if not args.json:
        print(f"loading target model {args.model} ...", file=sys.stderr)
    t0 = time.perf_counter()
    lm = load_causal_lm(args.model)
    scorer = CandidateScorer(task, splits, lm)
    load_s = time.perf_counter() - t0
    ev = scorer.evaluate(template.text, args.split)
    report = evaluation_report(task, ev, args.template or "seed")
    report["timing_s"]["load_model_s"] = round(load_s, 3)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def cmd_tune(args) -> int:
    from pipelines.loop import RunOptions, tune

    task = load_task(args.task)
    changes = {}
    if args.candidates:
        changes["generation.candidates_per_step"] = args.candidates
    if changes:
        task = task.with_overrides(**changes)
    run_dir = args.run_dir or str(Path("runs") / f"{task.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir, the folder of the run to continue")
    options = RunOptions(
        steps=args.steps, policy_model=args.policy_model, target_model=args.model, judge_model=args.judge_model,
        num_scorers=args.num_scorers, ray_address=args.ray_address, run_dir=run_dir, seed=args.seed,
        dev_examples=args.dev_examples or None, wandb_mode=args.wandb_mode, wandb_project=args.wandb_project,
        wandb_entity=args.wandb_entity, store_url=None if args.no_store else (args.store or default_store_url()),
        promote=not args.no_promote, progress=not args.json,
    )
    if args.backend == "openrlhf":
        from pipelines.openrlhf_job import prepare_job

        return prepare_job(task, options, dry_run=args.dry_run, json_output=args.json)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    log(f"tune-prompts: task {task.name}, {options.steps} steps x {task.generation.candidates_per_step} candidates, run folder {run_dir}")
    report = tune(task, options, resume=args.resume, log=log)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print_final_table(task, report)
    return 0


def print_final_table(task: TaskConfig, report: dict) -> None:
    rows = report["test"]
    metric = task.scoring.metric
    columns = ["template_name", metric, "roc_auc", "accuracy", "macro_f1", "total_reward",
               *task.judge.rubrics, *[k for k in rows[0] if k.startswith("pdr/")], "tokens", "latency_p95_ms"]
    print(f"\nheld-out test split ({task.name}): seed template vs the best tuned candidates")
    print(table(rows, columns))
    seed = rows[0][metric]
    best = max(rows[1:], key=lambda r: r[metric] if r[metric] is not None else -1, default=None)
    if best is not None and seed is not None and best[metric] is not None:
        print(f"\n{metric}: seed {seed:.3f} -> tuned {best[metric]:.3f} ({best[metric] - seed:+.3f}), {best['template_name']}")
    print("\ninstructions:")
    for row in rows:
        print(f"  {row['template_name']}: {row['instruction']!r}")
    if "promotion" in report:
        p = report["promotion"]
        print(f"\nstore: version {p.get('version')} {'PROMOTED' if p['promoted'] else 'not promoted'}; production is version {p['production']}")
        for reason in p["reasons"]:
            print(f"  {reason}")
    print(f"\nreport: {report['run_dir']}/report.json   W&B (offline) run: {report['wandb_folder']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tune-prompts",
        description="Tune LLM prompt templates with reinforcement learning. "
        "With --task and no command, runs the tuning job.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tune-prompts --task risk\n  tune-prompts tasks\n  tune-prompts render --task risk -n 3\n"
        "  tune-prompts eval --task risk --split test",
    )
    parser.add_argument("--task", help=f"the task to tune: a built-in ({', '.join(builtin_tasks())}) or a task YAML file")
    tuning = parser.add_argument_group("tuning (with --task and no command)")
    tuning.add_argument("--steps", type=int, default=6, help="PPO steps (default 6)")
    tuning.add_argument("--candidates", type=int, help="candidates per step (default: the task's, 8)")
    tuning.add_argument("--dev-examples", type=int, default=100, help="dev examples per candidate reward (default 100; 0: all)")
    tuning.add_argument("--run-dir", help="run folder for checkpoints, report and W&B files (default runs/<task>-<time>)")
    tuning.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    tuning.add_argument("--seed", type=int, default=0)
    tuning.add_argument("--backend", choices=["local", "openrlhf"], default="local",
                        help="local: this machine's PPO loop (default); openrlhf: write the train_ppo_ray job and submit it")
    tuning.add_argument("--dry-run", action="store_true", help="with --backend openrlhf: print the job instead of submitting it")
    tuning.add_argument("--ray-address", help="Ray cluster address (default: a local Ray)")
    tuning.add_argument("--num-scorers", type=int, default=1, help="Ray scoring actors (default 1)")
    tuning.add_argument("--policy-model", default=EMBEDDED, help="the policy that writes instructions")
    tuning.add_argument("--model", default=EMBEDDED, help="the target model (and judge, unless --judge-model)")
    tuning.add_argument("--judge-model", help="a separate judge model")
    tuning.add_argument("--store", help="template store URL (default sqlite:///$TUNE_PROMPTS_HOME/store.sqlite)")
    tuning.add_argument("--no-store", action="store_true", help="do not record the result in the store")
    tuning.add_argument("--no-promote", action="store_true", help="record the result but never move production")
    tuning.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default="offline")
    tuning.add_argument("--wandb-project", default="tune-prompts")
    tuning.add_argument("--wandb-entity")
    tuning.add_argument("--json", action="store_true", help="print the final report as JSON")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("tasks", help="list tasks with data sizes and label balance")
    p.add_argument("files", nargs="*", help="extra task YAML files to include")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("render", help="show a template rendered on a few examples")
    p.add_argument("--task", required=True, help=f"a built-in task ({', '.join(builtin_tasks())}) or a task YAML file")
    p.add_argument("--template", help="a template file (YAML record or plain text); default: the task's seed template")
    p.add_argument("--split", default="dev", choices=["train", "dev", "test"])
    p.add_argument("-n", type=int, default=3, help="how many examples (default 3)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target model's chat template")
    p.add_argument("--model", default=None, help="model whose chat template --chat uses (default: the embedded one)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("eval", help="score a template: every reward component on the dev or test split, with timing")
    p.add_argument("--task", required=True, help="a built-in task or a task YAML file")
    p.add_argument("--template", help="a template file (YAML record or plain text); default: the task's seed template")
    p.add_argument("--split", default="dev", choices=["dev", "test"])
    p.add_argument("--model", default=EMBEDDED, help=f"target and judge model (default {EMBEDDED})")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    cli_store.register(sub).set_defaults(func=cli_store.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        if not args.task:
            parser.print_help()
            return 2
        args.func = cmd_tune
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
