"""The tuning run (``tune-prompts --task TASK`` with no command): its flags on the top-level parser, the run or
its ``--estimate``, the tables it prints, and ``tune-prompts report``, which draws a run's page again."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing
from pathlib import Path

from pipelines import cli_store, task_files
from pipelines.cli_flags import add_model_flags, add_task_flag, model_sources, setting
from pipelines.cli_output import escape, table
from pipelines.config import (ConfigError, Endpoint, FlagSettings, GenerationConfig, PPOConfig, RunOptions,
                              SelectionConfig, TaskConfig)
from pipelines.data import load_examples, split_examples
from pipelines.engine.models import EMBEDDED
from pipelines.task_files import load_task
from templates.store import default_store_url


def add_tuning_flags(parser: argparse.ArgumentParser) -> None:
    """The top level's flags: the task, and how a run tunes it (steps, models, budget, store, W&B)."""
    # the help's example defaults (YAML and pydantic, no data), from task_files itself: a command's load_task may
    # be replaced (tests do) without breaking the parser
    risk = task_files.load_task("risk")
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
    tuning.add_argument("--update", choices=typing.get_args(PPOConfig.model_fields["update"].annotation),
                        help="how the policy learns from each step's rewards (default: the task's ppo.update; risk: "
                        f"{risk.ppo.update}): none samples the untrained policy (best-of-N), ppo trains it with "
                        "OpenRLHF's PPO, expert_iteration with a supervised step on each step's best samples")
    tuning.add_argument("--run-dir", help="run folder for checkpoints, report and W&B files (default runs/<task>-<time>)")
    tuning.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    tuning.add_argument("--seed", type=setting(PPOConfig, "seed"), help="the run's seed: sampling and PPO minibatch order (default: the "
                        f"task's ppo.seed; risk: {risk.ppo.seed}); the data split has its own, split.seed")
    tuning.add_argument("--backend", choices=["local", "openrlhf"], default="local",
                        help="local: this machine's loop (default); openrlhf: write OpenRLHF's train_ppo_ray job (PPO) and "
                        "submit it")
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
    tuning.add_argument("--stop-after", choices=["steps", "choice"],
                        help="end the run early: after the tuning steps (the learning table; no choice), or after the "
                             "choice on dev (the finalists and every bar; no held-out test). Neither writes the store")
    tuning.add_argument("--no-store", action="store_true", help="do not record the result in the store")
    tuning.add_argument("--no-promote", action="store_true", help="record the result but never move production")
    tuning.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=RunOptions.wandb_mode,
                        help="W&B logging (default %(default)s: files in the run folder, nothing sent)")
    tuning.add_argument("--wandb-project", default=RunOptions.wandb_project, help="(default %(default)s)")
    tuning.add_argument("--wandb-entity")
    cli_store.add_json_flag(tuning, "the final report")


def tuning_setup(args, store_url: str | None) -> tuple[TaskConfig, RunOptions]:
    """The task (with the flags that override it) and the run options of a tuning run."""
    task = load_task(args.task)
    changes = {}
    if args.candidates is not None:
        changes["generation.candidates_per_step"] = args.candidates
    if args.seed is not None:
        changes["ppo.seed"] = args.seed
    if args.update is not None:
        changes["ppo.update"] = args.update
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
        stop_after=args.stop_after,
    )
    return task, options


def run_tuning(task: TaskConfig, options: RunOptions, *, resume: bool, json_output: bool) -> dict:
    """The local tuning run, with its progress on the terminal and its final table (unless JSON is wanted)."""
    from pipelines.loop import tune

    log = (lambda *a: print(*a, file=sys.stderr)) if json_output else print
    log(f"tune-prompts: task {task.name}, {options.steps} steps x {task.generation.candidates_per_step} candidates, "
        f"update {task.ppo.update}, run folder {options.run_dir}")
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
        timing = Timing.scaled(calibrate(task, splits, options.target), min(options.num_scorers, os.cpu_count() or 1),
                               task.ppo.update)
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
    if not rows:  # --stop-after: the run ended before its held-out test
        print(f"\nstopped after the {report['stopped_after']} (--stop-after): no held-out test, gate or store")
        if report.get("choice") and not report["choice"]["chosen"]:
            print(report["choice"]["verdict"])
        print(f"report: {report['run_dir']}/report.json   W&B (offline) run: {report['wandb_folder']}")
        return
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


def register_report(sub: argparse._SubParsersAction) -> None:
    """Add the ``report`` command to the CLI's commands."""
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
