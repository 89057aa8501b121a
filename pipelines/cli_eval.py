"""``tune-prompts eval``: score one template as a tuning run scores a candidate, and print every part of it."""

from __future__ import annotations

import argparse
import json
import sys
import time

from pipelines import cli_store
from pipelines.cli_flags import add_model_flags, add_task_flag, add_template_flag, model_sources
from pipelines.cli_output import table
from pipelines.config import ConfigError, Endpoint, TaskConfig
from pipelines.data import load_examples, split_examples
from pipelines.task_files import load_task, read_template_file


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


def register_eval(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
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
    add_template_flag(p)
    p.add_argument("--split", default="dev", choices=["dev", "test"], help="(default %(default)s)")
    cli_store.add_json_flag(p, "the evaluation report")
    add_model_flags(p, command=True)
    p.set_defaults(func=cmd_eval)
