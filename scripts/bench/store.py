"""Benchmark the template store's serving path on a temporary SQLite store.

    python -m bench.store [--calls 100000] [--loads 200] [--promotions 100]

Prints p50/p99 of a cached lookup+render, of a routing decision, of the first lookup after a
label move (the "hot load"), and the time from a promotion in one process to its visibility in a
reader in another process, each next to its target. Versions carry what a tuning run stores with
them: a calibrated decision rule and an input constraint.

The hot load is measured for both kinds of reader:
  * watch=False: the first lookup after a move checks for it (the query for label moves, which brings
    the version's template record along) and compiles a version the reader has not seen;
  * watch=True (the default): a watcher thread does both; the figure is the first lookup that serves the
    new version, in a busy service (a lookup every 0.2 ms), and below it every lookup made from the move
    until then, so time the watcher holds the interpreter counts.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import subprocess
import sys
import tempfile
import time

from bench import REPO
from templates.decision import DecisionRule
from templates.gate import Decision, percentile
from templates.routing import takes_canary
from templates.serving import TemplateReader
from templates.store import TemplateStore
from templates.template import Template

TEXT = (
    "You are a compliance analyst. Read the customer message below and decide whether it describes a "
    "financial risk (fraud, chargeback, account takeover, sanctions) or not.\n"
    "Answer with exactly one word, {label_a} or {label_b}.\n\nMessage:\n{text}\n\nAnswer:"
)
VALUES = {"label_a": "risk", "label_b": "safe", "text": "Someone used my card in another country an hour ago."}
RULE = DecisionRule("calibrated", ("high_risk", "low_risk"), ("yes", "no"), "high_risk", -0.8125)
CONSTRAINTS = [{"variable": "text", "op": "max_chars", "arg": 2000}]


def version_template(text: str) -> Template:
    """A template as a tuning run stores it: its decision rule and constraints travel in its record."""
    return Template.from_dict({"text": text, "constraints": CONSTRAINTS, "decision": RULE.to_dict()})

# Runs in another process: promote on each line from stdin and print when the promotion started.
PROMOTER = """
import sys, time
from templates.store import TemplateStore
store = TemplateStore(sys.argv[1])
for i, _ in enumerate(sys.stdin):
    started_ns = time.monotonic_ns()
    store.promote("risk", 2 if i % 2 == 0 else 1)
    print(started_ns, flush=True)
"""


def timed_us(call, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def report(name: str, samples: list[float], unit: str, target: str) -> None:
    print(f"{name:<37} p50 {percentile(samples, 50):9.2f} {unit}   p99 {percentile(samples, 99):9.2f} {unit}"
          f"   n={len(samples):<7} {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="timed calls per hot-path figure")
    parser.add_argument("--loads", type=int, default=200, help="hot loads to time, of each kind")
    parser.add_argument("--promotions", type=int, default=100, help="cross-process promotions to time")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/store.sqlite"
        store = TemplateStore(url)
        passed = Decision(True, ("pass: benchmark",))
        v1 = store.add_version("risk", version_template(TEXT), decision=passed)
        v2 = store.add_version("risk", version_template(TEXT.replace("compliance", "fraud")), decision=passed)
        store.promote("risk", v1.id)
        store.set_canary("risk", v2.id, 0.05)
        print(f"store benchmark: SQLite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}, "
              f"template {len(TEXT)} chars / 3 variables")

        reader = TemplateReader(url)  # the default refresh_s
        reader.render("risk", VALUES)
        report("cached lookup+render (production)", timed_us(lambda: reader.render("risk", VALUES), args.calls),
               "us", "aim: p99 < 20 us")
        still = TemplateReader(url, watch=False)
        still.render("risk", VALUES)
        report("  the same, reader with watch=False", timed_us(lambda: still.render("risk", VALUES), args.calls),
               "us", "")
        still.close()
        keys = [f"user-{i}" for i in range(args.calls)]
        it = iter(keys)
        report("for_caller lookup+render (A/B)",
               timed_us(lambda: reader.render("risk", VALUES, key=next(it)), args.calls), "us", "aim: p99 < 20 us")
        it = iter(keys)
        report("routing decision (takes_canary)", timed_us(lambda: takes_canary("risk", next(it), 0.05), args.calls),
               "us", "(part of for_caller)")

        # The first lookup after a label move, checking on access: the query for moves, plus compiling the
        # template when the label now points at a version this reader has not seen.
        cold = TemplateReader(url, refresh_s=1e-9, watch=False)
        for version in (v2, v1):  # so that the label is cached and both versions are seen before the timing
            store.set_label("risk", "staging", version.id)
            cold.get("risk", "staging")
        seen, unseen = [], []
        for i in range(args.loads):
            store.set_label("risk", "staging", v1.id if i % 2 else v2.id)
            seen += timed_us(lambda: cold.get("risk", "staging"), 1)
            new = store.add_version("risk", version_template(f"{TEXT} ({i})"), decision=passed)
            store.set_label("risk", "staging", new.id)
            unseen += timed_us(lambda: cold.get("risk", "staging"), 1)
        report("hot load, watch=False: seen version", seen, "us", "design anchor: < 80 us")
        report("hot load, watch=False: new version", unseen, "us", "design anchor: < 80 us")

        # The same moves under the watcher: every lookup from the move until one serves the new version.
        watched = TemplateReader(url, refresh_s=0.005)  # polls every 5 ms so that the loop below stays short
        watched.get("risk", "staging")
        first, during, waits_ms = [], [], []
        for i in range(args.loads):
            new = store.add_version("risk", version_template(f"{TEXT} [{i}]"), decision=passed)
            store.set_label("risk", "staging", new.id)
            moved = time.perf_counter_ns()
            while True:
                start = time.perf_counter_ns()
                served = watched.get("risk", "staging")
                during.append((time.perf_counter_ns() - start) / 1000)
                if served.text.endswith(f"[{i}]"):
                    break
                time.sleep(0.0002)  # a busy service, as below: a lookup every 0.2 ms
            first.append(during[-1])
            waits_ms.append((time.perf_counter_ns() - moved) / 1e6)
        report("hot load, watch=True: new version", first, "us", "design anchor: < 80 us")
        report("  any lookup while the watcher loads", during, "us", "")
        report("  move -> served (refresh_s 5 ms)", waits_ms, "ms", "")
        watched.close()

        # Promotion in another process -> visible to this process's reader (the default refresh_s).
        child = subprocess.Popen([sys.executable, "-c", PROMOTER, url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO)})
        visible_ms = []
        for _ in range(args.promotions):
            # A busy service (a lookup every 0.2 ms) receives the promotion at a random point of its refresh cycle.
            until = time.monotonic() + random.uniform(0, 0.2)
            before = reader.get("risk").text
            while time.monotonic() < until:
                reader.get("risk")
                time.sleep(0.0002)
            child.stdin.write("go\n")
            child.stdin.flush()
            while reader.get("risk").text == before:
                time.sleep(0.0002)  # a busy service: a lookup every 0.2 ms
            seen_ns = time.monotonic_ns()
            visible_ms.append((seen_ns - int(child.stdout.readline())) / 1e6)
        child.stdin.close()
        child.wait(timeout=30)
        report("promotion -> visible (other process)", visible_ms, "ms", "target: < 100 ms")
        reader.close()
        cold.close()
        store.close()


if __name__ == "__main__":
    main()
