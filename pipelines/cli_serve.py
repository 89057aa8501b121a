"""``tune-prompts serve``: the prompt gateway (``pipelines/gateway.py``) on Ray Serve, until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from pipelines import cli_store
from pipelines.cli_flags import add_model_flags, model_sources, number, setting
from pipelines.config import ConfigError
from pipelines.gateway_requests import GatewaySettings
from pipelines.task_files import builtin_tasks, load_task
from templates.store import StoreError, TemplateStore, default_store_url


def cmd_serve(args) -> int:
    from pipelines import gateway

    if args.task_deadline and not args.task:
        raise ConfigError("--task-deadline needs the tasks it names in --task")
    tasks = {}
    for name in args.task:
        task = load_task(name)
        tasks[task.name] = gateway.ServedTask(task.name, task.template.chat_template, task.scoring.batch_size)
    deadlines = {}
    for item in args.task_deadline or []:
        name, _, ms = item.partition("=")
        if name not in tasks:
            raise ConfigError(f"--task-deadline {item[:80]!r} names no served task; the served tasks are {sorted(tasks)}")
        try:
            deadlines[name] = float(ms)
        except ValueError:
            raise ConfigError(f"--task-deadline {item[:80]!r} is not TASK=MILLISECONDS, e.g. risk=500") from None
    try:
        settings = GatewaySettings(
            replicas=args.replicas, max_batch_size=1 if args.no_batching else args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms, deadline_ms=args.deadline_ms, task_deadlines_ms=deadlines)
    except ValueError as exc:
        raise ConfigError(f"gateway settings: {exc}") from None
    store_url = args.store or default_store_url()
    with TemplateStore(store_url, create=False) as store:  # a missing or unreadable store stops here, before Ray
        stored = set(store.tasks())
    missing = sorted(set(tasks) - stored)
    if missing:
        raise StoreError(f"the store at {store_url} holds no versions of {missing}: tune them into it first "
                         f"(tune-prompts --task {missing[0]} --store {store_url}) or serve the tasks it holds "
                         f"({sorted(stored) or 'none'})")
    target, _ = model_sources(args)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's own start-up lines; ours say the same
    print(f"[serve] starting {settings.replicas} replica(s) of the gateway for {sorted(tasks)} (store {store_url}); "
          "each replica loads the target", file=sys.stderr, flush=True)
    url = gateway.start(store_url, target, tasks, settings, host=args.host, port=args.port,
                        ray_address=args.ray_address)
    print(f"[serve] ready at {url}: POST {url}/v1/predict, POST {url}/v1/render, GET {url}/v1/tasks/TASK, "
          f"GET {url}/healthz, GET {url}/metrics; Ctrl-C stops it", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait(args.for_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        gateway.stop()
        import ray

        if args.ray_address is None:
            ray.shutdown()
    print("[serve] stopped", file=sys.stderr)
    return 0


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` command to the CLI's commands."""
    defaults = GatewaySettings()
    p = sub.add_parser(
        "serve", help="the prompt gateway: HTTP predict and render over the template store, on Ray Serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve the store's templates over HTTP. POST /v1/predict {task, inputs, key?, label?} renders the\n"
        "version the store routes to (production, a label, or the caller key's A/B arm), checks the inputs\n"
        "against the version's constraints, asks the target and applies the version's decision rule: the\n"
        "answer TemplateReader.predict gives. Concurrent requests are batched into one forward pass; a request\n"
        "that cannot be answered within its deadline gets a 504. Promotions, rollbacks and canary ramps in the\n"
        "store are served within 0.05 s of their commit, without a restart. Runs until Ctrl-C.",
        epilog="examples:\n  tune-prompts serve --task risk\n"
        "  tune-prompts serve --task risk --replicas 2 --port 8080 --deadline-ms 500\n"
        "  curl -s localhost:8000/v1/predict -d '{\"task\": \"risk\", \"inputs\": {\"text\": \"WIN a prize!\"}, "
        "\"key\": \"user-17\"}'\n"
        "  tune-prompts serve --task risk --target-url http://localhost:8001/v1 --target-model smollm2")
    p.add_argument("--task", action="append", required=True,
                   help=f"a task to serve: built-in ({', '.join(builtin_tasks())}) or a task YAML file; repeat for "
                   "several")
    cli_store.add_store_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; the default, 127.0.0.1, is this machine only")
    p.add_argument("--port", type=number(int, 1, 65535), default=8000, help="port to listen on (default %(default)s)")
    p.add_argument("--replicas", type=setting(GatewaySettings, "replicas"), default=defaults.replicas,
                   help="gateway replicas, each with its own copy of the target (default %(default)s)")
    p.add_argument("--max-batch-size", type=setting(GatewaySettings, "max_batch_size"),
                   default=defaults.max_batch_size, help="requests scored in one forward pass (default %(default)s)")
    p.add_argument("--batch-wait-ms", type=setting(GatewaySettings, "batch_wait_ms"), default=defaults.batch_wait_ms,
                   help="how long a batch waits to fill (default %(default)s ms)")
    p.add_argument("--no-batching", action="store_true", help="score each request alone (--max-batch-size 1)")
    p.add_argument("--deadline-ms", type=setting(GatewaySettings, "deadline_ms"), default=defaults.deadline_ms,
                   help="a request's time limit in the gateway; past it, a 504 (default %(default)s ms)")
    p.add_argument("--task-deadline", action="append", metavar="TASK=MS",
                   help="a deadline for one task instead of --deadline-ms, e.g. risk=500; repeat for several")
    p.add_argument("--ray-address", help="a Ray cluster to deploy on (e.g. ray://HEAD:10001); default: a local Ray")
    p.add_argument("--for-seconds", type=number(float, 0, 10**7, above=True), default=None,
                   help=argparse.SUPPRESS)  # tests: stop after N s
    add_model_flags(p, command=True)
    p.set_defaults(func=cmd_serve)
