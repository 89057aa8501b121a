"""Benchmark: pairs/s and tokens/s through an OpenAI-compatible server, at client concurrency 1 and 8, in one run.

A target behind vLLM or a hosted API is scored one HTTP request per (template, example) pair, so what a tuning
run gets from it depends on how many requests the client keeps in flight (``EndpointLabelScorer``'s
``max_concurrency``) and on the network round trip. This measures both on this machine: the loopback server of
the tests (tests/openai_compat_server.py) serving the embedded model (SmolLM2-135M-Instruct, this machine's
dtype), the `risk` task's seed template on its first --examples dev messages, and for each simulated round trip
(--latency-ms, slept by the server outside its model lock, so concurrent requests wait at the same time) and
each client concurrency (--concurrency):
  * score:   ``EndpointLabelScorer.score``: one request per pair, 1 token with the top 20 log-probs;
  * answer:  ``EndpointLabelScorer.answer``: one request per pair, the greedy answer of at most the task's
             ``scoring.answer.max_new_tokens`` tokens (the server decodes with a key/value cache).
Every measurement uses a fresh scorer (an empty cache). tokens/s counts what the server's ``usage`` reported:
prompt tokens (after the chat template) plus generated ones. The server runs one request at a time, as a
single-model CPU server must (it does not batch requests that arrive together, as vLLM would), so concurrency
can hide the round trip but not the model's own time: at concurrency c, a run takes at least the larger of the
model's time and pairs x latency / c. The script checks that every concurrency gives the same labels and answers.
The machine may be shared: the settings to compare run one right after the other, and with --rounds above 1
each figure is the fastest of the rounds. The defaults took 188 s on 2 AVX2 cores (float32) that another job
was using too.

    .venv/bin/python -m bench.endpoints [--examples 48] [--latency-ms 0 50] [--concurrency 1 8] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

from bench import REPO as ROOT
from pipelines.cli import quiet_libraries
from pipelines.cli_output import table


def load_server_module():
    """tests/ is not a package (openrlhf installs one named `tests`): load the loopback server by path."""
    spec = importlib.util.spec_from_file_location("openai_compat_server", ROOT / "tests" / "openai_compat_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()  # before torch loads: idle torch threads must not spin on a shared machine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=48, help="dev messages of the risk task")
    parser.add_argument("--latency-ms", type=int, nargs="+", default=[0, 50],
                        help="simulated network round trips per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="client max_concurrency values")
    parser.add_argument("--threads", type=int, default=1,
                        help="the server's torch threads (1: on a busy 2-core machine, two spin-wait for each other)")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds; each setting's fastest counts")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.examples < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--examples, --threads and --rounds must be at least 1")
    if min(args.concurrency) < 1 or min(args.latency_ms) < 0:
        parser.error("--concurrency values must be at least 1 and --latency-ms values not negative")

    import numpy as np
    import torch

    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.endpoints import EndpointLabelScorer
    from pipelines.engine.models import default_dtype, load_causal_lm

    srv = load_server_module()
    torch.set_num_threads(args.threads)
    task = load_task("risk")
    template = task.seed_template()
    texts = [e.text for e in load_splits(task).dev[: args.examples]]
    verbalizers = [task.labels[name].verbalizer for name in task.labels]
    max_new_tokens = task.scoring.answer.max_new_tokens
    server = srv.OpenAICompatServer(srv.ModelBackend(load_causal_lm()), "smollm2").start()

    def scorer(concurrency: int) -> EndpointLabelScorer:
        # A generous timeout: at concurrency 8 a request waits behind up to 7 others for the model.
        return EndpointLabelScorer(server.base_url, "smollm2", verbalizers, max_concurrency=concurrency, timeout_s=120)

    calls = {
        "score": lambda s: s.score(template, texts),
        "answer": lambda s: [a.text for a in s.answer(template, texts, max_new_tokens)],
    }
    warm = scorer(1)
    warm.score(template, texts[:1])
    warm.answer(template, texts[:1], max_new_tokens)

    best: dict[tuple[str, int, int], dict] = {}
    reference: dict[str, object] = {}  # each call's results at the first setting: every setting must agree
    max_score_diff, answers_differ, answers_compared = 0.0, 0, 0
    started_run = time.perf_counter()
    try:
        for _ in range(args.rounds):
            for latency_ms in args.latency_ms:
                server.faults.latency_s = latency_ms / 1000
                for call, run in calls.items():
                    for concurrency in args.concurrency:
                        s = scorer(concurrency)
                        before = dict(server.usage_totals)
                        started = time.perf_counter()
                        result = run(s)
                        seconds = time.perf_counter() - started
                        if call not in reference:
                            reference[call] = result
                        elif call == "score":
                            max_score_diff = max(max_score_diff, float(np.abs(result - reference[call]).max()))
                        else:
                            answers_differ += sum(a != b for a, b in zip(result, reference[call]))
                            answers_compared += len(result)
                        prompt_tokens = server.usage_totals["prompt_tokens"] - before["prompt_tokens"]
                        completion_tokens = server.usage_totals["completion_tokens"] - before["completion_tokens"]
                        key = (call, latency_ms, concurrency)
                        if key not in best or seconds < best[key]["seconds"]:
                            best[key] = {
                                "call": call, "latency_ms": latency_ms, "concurrency": concurrency,
                                "pairs": len(texts), "seconds": seconds, "pairs_per_s": len(texts) / seconds,
                                "tokens_per_s": (prompt_tokens + completion_tokens) / seconds,
                                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "request_ms_p50": s.stats.as_dict()["request_ms_p50"],
                            }
    finally:
        server.stop()
    run_s = time.perf_counter() - started_run

    rows = list(best.values())
    for row in rows:  # against the first concurrency at the same call and round trip
        base = best[(row["call"], row["latency_ms"], args.concurrency[0])]
        row["speedup"] = base["seconds"] / row["seconds"]
    rows.sort(key=lambda r: (list(calls).index(r["call"]), r["latency_ms"], r["concurrency"]))
    pairs = len(texts)
    answer_rows = [r for r in rows if r["call"] == "answer"]
    summary = {
        "task": "risk", "template": "seed", "examples": pairs, "dtype": default_dtype(), "server_threads": args.threads,
        "rounds": args.rounds, "answer_max_new_tokens": max_new_tokens,
        "prompt_tokens_per_pair": rows[0]["prompt_tokens"] / pairs,
        "answer_tokens_per_pair": answer_rows[0]["completion_tokens"] / pairs if answer_rows else None,
        "max_score_difference_across_settings": max_score_diff, "answers_differing_across_settings": answers_differ,
        "run_seconds": run_s, "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0 if max_score_diff < 1e-4 and answers_differ == 0 else 1
    print(f"risk seed template on {pairs} dev messages through the loopback server: embedded SmolLM2-135M-Instruct, "
          f"{default_dtype()}, {args.threads} torch thread(s), one request at a time in the model; "
          f"{summary['prompt_tokens_per_pair']:.1f} prompt tokens per pair")
    print(f"answers: at most {max_new_tokens} new tokens, {summary['answer_tokens_per_pair'] or 0:.2f} on average "
          f"(stop token included); seconds: the fastest of {args.rounds} round(s); "
          f"speedup: against concurrency {args.concurrency[0]} at the same call and round trip")
    columns = ["call", "latency_ms", "concurrency", "pairs", "seconds", "pairs_per_s", "tokens_per_s", "speedup",
               "request_ms_p50"]
    print(table([{c: (round(r[c], 1) if c == "request_ms_p50" else r[c]) for c in columns} for r in rows], columns))
    print(f"\nevery setting gave the same results: labels' largest |log-prob difference| {max_score_diff:.1e}, "
          f"answers that differ {answers_differ} of {answers_compared} compared")
    print(f"whole run {run_s:.0f} s")
    return 0 if max_score_diff < 1e-4 and answers_differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
