"""Every fault mode of the loopback test server x (eval, predict, tune): exit code, wall time, first line printed.

    python -m bench.faults [--timeout 2] [--deadline 5] [--commands eval,predict,tune]

A scripted server (tests/openai_compat_server.py, no model) breaks every completion request one way
(``FAULT_MODES``); the commands run in this process through ``pipelines.cli.main`` against it, with
``--request-timeout``/``--request-deadline`` as given, and each must end within the deadline plus 1 s of its first
request. predict reads a throwaway store whose production version of tests/data/risk_served.yaml decides on a
threshold; eval scores that task's test split (its wall time includes loading the embedded model for
readability, before the first request). tune runs 1 step of 2 candidates of that task on 4 dev examples (Ray and
the policy model start first, so its wall time is mostly start-up); its scorers count a lying answer as one that
names no label rather than stop, and a server that does not answer stops the run. For tune, the line shown is
its error, or on exit 0 what it did to the store.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO
from pipelines import cli
from pipelines.config import load_task
from templates.decision import DecisionRule
from templates.store import TemplateStore

_spec = importlib.util.spec_from_file_location("openai_compat_server", REPO / "tests" / "openai_compat_server.py")
srv = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = srv
_spec.loader.exec_module(srv)

TASK = str(REPO / "tests" / "data" / "risk_served.yaml")


def rule(prompt: str) -> list[tuple[str, float]]:
    return [("yes", -0.2), ("no", -1.8)] if "WIN" in prompt else [("no", -0.1), ("yes", -2.4)]


def make_store(folder: Path) -> str:
    url = f"sqlite:///{folder / 'store.sqlite'}"
    decision = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), positive="high_risk", threshold=0.0)
    template = dataclasses.replace(load_task(TASK).seed_template(), decision=decision)
    with TemplateStore(url) as store:
        store.promote("risk-served", store.add_version("risk-served", template).id, force=True)
    return url


def run(argv: list[str]) -> tuple[int, float, str]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    wall = time.monotonic() - t0
    printed = (err.getvalue() + out.getvalue()).splitlines()
    lines = [line for line in printed if line.startswith("error: ")] if code else (
        [line for line in printed if line.startswith("store: ")] or printed)
    return code, wall, (lines[0] if lines else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", default="2", help="--request-timeout for every command (default 2)")
    parser.add_argument("--deadline", default="5", help="--request-deadline for every command (default 5)")
    parser.add_argument("--commands", default="eval,predict,tune", help="comma-separated: eval, predict, tune")
    parser.add_argument("--modes", help="comma-separated fault modes to run (default: none and every mode)")
    parser.add_argument("--width", type=int, default=110, help="characters of the first line shown")
    args = parser.parse_args()
    import pipelines.scoring  # noqa: F401 - torch's import, paid once before the first timing

    limits = ["--request-timeout", args.timeout, "--request-deadline", args.deadline]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = make_store(Path(folder))
        modes = (None, *srv.FAULT_MODES) if not args.modes else [None if m == "none" else m for m in args.modes.split(",")]
        for mode in modes:
            for command in args.commands.split(","):
                with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted",
                                            faults=srv.Faults(mode=mode, retry_after="1")) as server:
                    served = ["--target-url", server.base_url, "--target-model", "scripted", *limits]
                    argv = {"predict": ["predict", "--task", TASK, "--store", store, *served, "--text", "WIN a prize now"],
                            "eval": ["eval", "--task", TASK, *served],
                            "tune": ["--task", TASK, "--steps", "1", "--candidates", "2", "--dev-examples", "4",
                                     "--wandb-mode", "disabled", "--store", f"sqlite:///{folder}/tune-{mode}.sqlite",
                                     "--run-dir", f"{folder}/run-{mode}", *served]}[command]
                    code, wall, first = run(argv)
                    since = time.monotonic() - server.request_times[0] if server.request_times else 0.0
                    first = first.replace(server.base_url, "URL")
                rows.append((mode or "(none)", command, code, wall, since, first))
                print(f"{rows[-1][0]:16} {command:8} {code}  {wall:6.2f} s", file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"{cpu}, {len(Path('/proc/cpuinfo').read_text().split('processor')) - 1} cores; "
          f"python -m bench.faults --timeout {args.timeout} --deadline {args.deadline}\n")
    print("| mode | command | exit | wall s | s after 1st request | first line |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, command, code, wall, since, first in rows:
        shown = first if len(first) <= args.width else first[: args.width - 3] + "..."
        print(f"| {mode} | {command} | {code} | {wall:.2f} | {since:.2f} | `{shown.replace('|', '/')}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
