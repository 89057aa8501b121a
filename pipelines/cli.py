"""The `tune-prompts` command line.

    tune-prompts --task risk                 tune the risk task's template (the main job)
    tune-prompts tasks                       list tasks with data sizes and label balance
    tune-prompts validate TASK.yaml          check a task file as a run reads it, loading no model
    tune-prompts render --task risk          show the seed template rendered on a few examples
    tune-prompts eval --task risk            score a template: every reward component, with timing
    tune-prompts store list|show|...         the versioned template store
    tune-prompts check --task risk           drift check of the production template (exit 1 when below its bars)
    tune-prompts predict --task risk --text  what production receives: the stored version's decision on one input
    tune-prompts serve --task risk           the prompt gateway: predict and render over HTTP, on Ray Serve
    tune-prompts schedule --task risk ...    submit check-and-tune jobs to a Ray cluster on a cron schedule
    tune-prompts report RUN_DIR              a run's report.html: learning curves, candidates, test, gate, store

Every command exits 0 on success, 2 on bad input (with one line saying what to fix), 1 on a failure.
An unexpected exception is also one line and exit 2; ``--debug`` (or TUNE_PROMPTS_DEBUG=1) shows its traceback.

This module is the entry point: the top-level parser, which adds each command from the module that runs it, and
``main``'s exit codes. The tuning run's flags and tables are in ``cli_tune.py``; tasks, render and validate in
``cli_tasks.py``; eval in ``cli_eval.py``; predict, check and schedule in ``cli_production.py``; serve in ``cli_serve.py``; store in
``cli_store.py``; the flags several commands share in ``cli_flags.py``; escaping and tables in ``cli_output.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
import warnings
from typing import Sequence

from pipelines import cli_eval, cli_production, cli_serve, cli_store, cli_tasks, cli_tune
from pipelines.budget import BudgetError
from pipelines.cli_output import one_line
from pipelines.config import ConfigError
from pipelines.data import DataError
from pipelines.engine.endpoints import EndpointError
from pipelines.engine.models import ModelLoadError
from pipelines.schedule import CronError, ScheduleError
from rewards.judge import JudgeError
from templates.decision import DecisionError
from templates.store import StoreError
from templates.template import TemplateError

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


class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (still exit 2); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message, 300)}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tune-prompts",
        description="Tune LLM prompt templates with reinforcement learning. With --task and no command, runs the\n"
        "tuning job: a policy model writes candidate instructions, each is scored on the task's data (its metric,\n"
        "an LLM judge, robustness, tokens, latency), the best are kept (the task's ppo.update can train the policy\n"
        "on the rewards with PPO or expert iteration; by default it does not), and the candidate chosen on dev is\n"
        "tested and put through the promotion gate into the template store. Each command's --help has examples.\n"
        "Exit 0: done; 2: bad input (one line saying what to fix); 1: a failure (check: below a bar).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tune-prompts --task risk\n  tune-prompts --task risk --estimate\n"
        "  tune-prompts --task risk --steps 1 --candidates 4 --dev-examples 0 --no-store\n"
        "  tune-prompts --task risk --target-url http://localhost:8000/v1 "
        "--target-model HuggingFaceTB/SmolLM2-135M-Instruct\n"
        "  tune-prompts tasks\n  tune-prompts render --task risk -n 3\n  tune-prompts eval --task risk --split test",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an unexpected error (also TUNE_PROMPTS_DEBUG=1)")
    cli_tune.add_tuning_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # in the order `tune-prompts --help` lists them
    cli_tasks.register_tasks(sub)
    cli_tasks.register_render(sub)
    cli_eval.register_eval(sub)
    cli_production.register_check(sub)
    cli_production.register_predict(sub)
    cli_production.register_schedule(sub)
    cli_serve.register_serve(sub)
    cli_tasks.register_validate(sub)
    cli_tune.register_report(sub)
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
        args.func = cli_tune.cmd_tune
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
