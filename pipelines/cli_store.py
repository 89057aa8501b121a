"""``tune-prompts store ...``: inspect versions, promote, roll back, label, and route canary traffic.

    tune-prompts store list [TASK]                  tasks, or one task's versions
    tune-prompts store show VERSION                 one version: template, scores, latency, gate reasons
    tune-prompts store diff VERSION VERSION         template diff and score deltas
    tune-prompts store promote TASK VERSION [--force]
    tune-prompts store rollback TASK
    tune-prompts store label TASK LABEL VERSION
    tune-prompts store route TASK                   who gets what: production, canary, share, ramp
    tune-prompts store route TASK --key user-17     which template this caller gets
    tune-prompts store route TASK --canary VERSION [--share 0.05] [--ramp 0.05,0.2,1]
    tune-prompts store route TASK --advance | --end
    tune-prompts store doctor                       every stored row that breaks its schema (exit 2 if any)

VERSION is a version id or TASK@LABEL (``risk@production``). Every command takes ``--store URL``
(default ``$TUNE_PROMPTS_HOME/store.sqlite``) and ``--json``. Errors print one line to stderr
and exit with 2, having changed nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipelines.cli_flags import number
from templates.routing import BUCKETS, DEFAULT_RAMP, MAX_RAMP_STEPS, bucket, takes_canary
from templates.store import MAX_ID, StoreError, TemplateStore, Version, check_name, default_store_url


def add_store_flag(parser, note: str = "") -> None:
    """``--store URL``, as every command that reads or writes the template store takes it."""
    parser.add_argument("--store", metavar="URL", help="template store: sqlite:///PATH or postgresql://USER@HOST/DB "
                        f"(default: sqlite:///$TUNE_PROMPTS_HOME/store.sqlite){note}")


def add_json_flag(parser, what: str = "the result") -> None:
    """``--json``, as every command that prints a result takes it (here, because this module is also registered
    on its own and the main CLI imports it)."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``store`` command to a CLI's subparsers; run the parsed args with ``run(args)``."""
    common = argparse.ArgumentParser(add_help=False)
    add_store_flag(common)
    add_json_flag(common)
    raw = argparse.RawDescriptionHelpFormatter

    parser = subparsers.add_parser(
        "store", help="inspect and move template versions and labels", formatter_class=raw,
        description="The versioned template store. A tuning run records the candidate it chose as a version (text,\n"
        "scores, latency, the gate's decision, its parent); labels such as production point at versions and move,\n"
        "versions never change. VERSION is a version id or TASK@LABEL (risk@production). Every command takes\n"
        "--store URL and --json; an error is one line on stderr and exit 2, having changed nothing.",
        epilog="examples:\n  tune-prompts store list\n  tune-prompts store list risk\n"
        "  tune-prompts store show risk@production\n  tune-prompts store route risk --canary 2 --share 0.05")
    commands = parser.add_subparsers(dest="store_command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "list", parents=[common], help="tasks, or the versions of one task", formatter_class=raw,
        description="Without TASK: each task with its number of versions, its production version, canary and labels.\n"
        "With TASK: its versions, each with its content hash, parent, run, gate decision, labels, creation time\n"
        "and test scores.",
        epilog="examples:\n  tune-prompts store list\n  tune-prompts store list risk --json")
    p.add_argument("task", nargs="?")
    p.set_defaults(store_handler=_list)

    p = commands.add_parser(
        "show", parents=[common], help="one version in full", formatter_class=raw,
        description="One version in full: its task, labels, parent and run, the decision rule production applies\n"
        "with it, its dev and test scores, latency, the gate's decision with every reason, and the template text.",
        epilog="examples:\n  tune-prompts store show 2\n  tune-prompts store show risk@production --json")
    p.add_argument("version", help="version id or TASK@LABEL")
    p.set_defaults(store_handler=_show)

    p = commands.add_parser(
        "diff", parents=[common], help="template diff and score deltas between two versions", formatter_class=raw,
        description="The unified diff of two versions' template texts (A -> B), and B minus A for every score and\n"
        "latency figure (none where only one of them has it).",
        epilog="examples:\n  tune-prompts store diff 1 2\n  tune-prompts store diff risk@production risk@staging")
    p.add_argument("a", help="version id or TASK@LABEL")
    p.add_argument("b", help="version id or TASK@LABEL")
    p.set_defaults(store_handler=_diff)

    p = commands.add_parser(
        "promote", parents=[common], help="make a version production (ends any canary)", formatter_class=raw,
        description="Point TASK's production label at VERSION and end any canary, in one transaction. A version\n"
        "the promotion gate refused, or never saw, needs --force (the move is recorded as forced).",
        epilog="examples:\n  tune-prompts store promote risk 2\n  tune-prompts store promote risk risk@staging --force")
    p.add_argument("task")
    p.add_argument("version", help="version id or TASK@LABEL")
    p.add_argument("--force", action="store_true", help="promote a version the gate refused or never saw")
    p.set_defaults(store_handler=_promote)

    p = commands.add_parser(
        "rollback", parents=[common], help="production back to the version before the last promotion",
        formatter_class=raw,
        description="Undo the newest promotion not yet undone: production returns to the version it held before.\n"
        "Promotions stack: after promoting 1, 2, 3, rollbacks go to 2, then 1, then fail.",
        epilog="examples:\n  tune-prompts store rollback risk")
    p.add_argument("task")
    p.set_defaults(store_handler=_rollback)

    p = commands.add_parser(
        "label", parents=[common], help="point a label such as staging at a version", formatter_class=raw,
        description="Point a label of TASK (such as staging) at VERSION; `tune-prompts predict --label LABEL` reads\n"
        "it. production moves only by promote and rollback, canary only by route.",
        epilog="examples:\n  tune-prompts store label risk staging 3\n  tune-prompts store label risk staging risk@production")
    p.add_argument("task")
    p.add_argument("label")
    p.add_argument("version", help="version id or TASK@LABEL")
    p.set_defaults(store_handler=_label)

    p = commands.add_parser(
        "route", parents=[common], help="show or change canary routing", formatter_class=raw,
        description="A/B routing between TASK's production and canary versions. A caller key hashes (with the task)\n"
        f"into one of {BUCKETS} buckets and the canary takes those below its share, so raising the share only adds\n"
        "callers. Without an action: who gets what; --key: which version one caller gets.",
        epilog="examples:\n  tune-prompts store route risk\n  tune-prompts store route risk --key user-17\n"
        "  tune-prompts store route risk --canary 3 --share 0.05 --ramp 0.05,0.2,1\n"
        "  tune-prompts store route risk --advance\n  tune-prompts store route risk --end")
    p.add_argument("task")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--key", help="show which template this caller key gets")
    action.add_argument("--canary", metavar="VERSION", help="start (or move) a canary on this version")
    action.add_argument("--advance", action="store_true", help="move the canary share to the ramp's next step")
    action.add_argument("--end", action="store_true", help="stop the canary; everyone gets production")
    p.add_argument("--share", type=number(float, 0.0, 1.0),
                   help="canary share with --canary, 0..1 (default: the ramp's first step)")
    p.add_argument("--ramp", type=_ramp, help=f"canary ramp with --canary, up to {MAX_RAMP_STEPS} increasing fractions, "
                   f"e.g. 0.05,0.5,1 (default: {','.join(f'{step:g}' for step in DEFAULT_RAMP)})")
    p.set_defaults(store_handler=_route)

    p = commands.add_parser(
        "doctor", parents=[common], help="list every damaged row (exit 0 when there is none, 2 otherwise)",
        formatter_class=raw,
        description="Read every version and label move and list each one that breaks its own schema, by table, id\n"
        "and field: a score that is not a finite number, a time that is not ISO 8601, control characters in a\n"
        "name, a record that does not decode. Such rows were written outside tune-prompts or damaged on disk;\n"
        "predict refuses to serve a damaged version. Exit 0 when every row is sound, 2 when any is damaged.",
        epilog="examples:\n  tune-prompts store doctor\n  tune-prompts store doctor --store sqlite:///backup.sqlite --json")
    p.set_defaults(store_handler=_doctor)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``store`` command; 0 on success, 2 on an error (printed to stderr)."""
    try:
        with TemplateStore(args.store or default_store_url(), create=False) as store:
            return args.store_handler(store, args) or 0
    except StoreError as exc:
        message = _escaped(str(exc))
        print(f"error: {message if len(message) <= 500 else message[:497] + '...'}", file=sys.stderr)
        return 2


def _ramp(text: str) -> tuple[float, ...]:
    """A ramp of at most MAX_RAMP_STEPS fractions; the store's ``Canary`` checks their order and range."""
    steps = text.split(",", MAX_RAMP_STEPS)
    if len(steps) > MAX_RAMP_STEPS:
        raise argparse.ArgumentTypeError(f"the ramp has more than {MAX_RAMP_STEPS} steps; give fewer, e.g. 0.05,0.2,1")
    fraction = number(float, 0.0, 1.0)
    try:
        return tuple(fraction(step) for step in steps)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"the ramp {text[:40]!r}: {exc}; give increasing fractions, "
                                         "e.g. 0.05,0.2,1") from None


def _resolve(store: TemplateStore, ref: str) -> Version:
    """A version from an id or TASK@LABEL."""
    if "@" in ref:
        task, label = ref.split("@", 1)
        version = store.get_label(task, label)
        if version is None:
            raise StoreError(f"task {task!r} has no label {label!r}; its labels are {sorted(store.labels(task)) or 'none'}")
        return version
    if not (ref.isascii() and ref.isdigit()):
        raise StoreError(f"{ref!r} is not a version: give a version id such as 7, or TASK@LABEL such as risk@production")
    if len(ref) > 30:  # int() refuses numbers of thousands of digits; any id past 19 is out of range anyway
        raise StoreError(f"version id {ref[:30]}... ({len(ref)} digits) is out of range: ids are whole numbers "
                         f"from 1 to {MAX_ID}; `tune-prompts store list TASK` shows them")
    return store.get_version(int(ref))


def _known_task(store: TemplateStore, task: str) -> None:
    check_name(task, "task name")
    tasks = store.tasks()
    if task not in tasks:
        raise StoreError(f"unknown task {task!r}; the store has {', '.join(tasks) or 'no tasks yet'}")


def _escaped(text: str) -> str:
    """``text`` with every control character (ANSI escapes, newlines, ...) written as its escape sequence, so that
    a stored name cannot colour the terminal or forge a row."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [["-" if c is None else _escaped(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _figures(figures: dict) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in figures.items())


def _gate(version: Version) -> str:
    return "-" if version.decision is None else "promote" if version.decision.promote else "refuse"


def _print(args: argparse.Namespace, data: object, text: str) -> None:
    """JSON (which escapes control characters itself) or the text; every stored name or caller's text in it
    has been through _escaped, and each line is escaped once more in case one was missed."""
    print(json.dumps(data, indent=2) if args.json else "\n".join(map(_escaped, text.split("\n"))))


def _list(store: TemplateStore, args: argparse.Namespace) -> None:
    if args.task is None:
        rows = []
        for task in store.tasks():
            labels, canary = store.labels(task), store.canary(task)
            rows.append({
                "task": task,
                "versions": len(store.list_versions(task)),
                "labels": labels,
                "canary_share": None if canary is None else canary.share,
            })
        _print(args, rows, _table(
            ["TASK", "VERSIONS", "PRODUCTION", "CANARY", "LABELS"],
            [[r["task"], r["versions"], r["labels"].get("production"),
              None if r["canary_share"] is None else f"{r['labels']['canary']} at {r['canary_share']:.0%}",
              " ".join(f"{k}={v}" for k, v in r["labels"].items())] for r in rows],
        ))
        return
    _known_task(store, args.task)
    versions, labels = store.list_versions(args.task), store.labels(args.task)
    by_version: dict[int, list[str]] = {}
    for label, version_id in labels.items():
        by_version.setdefault(version_id, []).append(label)
    _print(
        args,
        [{**v.to_dict(), "labels": by_version.get(v.id, [])} for v in versions],
        _table(
            ["ID", "HASH", "PARENT", "RUN", "GATE", "LABELS", "CREATED", "TEST SCORES"],
            [[f"{v.id} {_damage_mark(v)}" if v.damage else v.id, v.content_hash, v.parent_id, v.run_id, _gate(v),
              ",".join(by_version.get(v.id, [])) or None,
              v.created_at[:19], _figures(v.scores.get("test", {})) or None] for v in versions],
        ),
    )


def _show(store: TemplateStore, args: argparse.Namespace) -> None:
    v = _resolve(store, args.version)
    labels = [label for label, version_id in store.labels(v.task).items() if version_id == v.id]
    fields = [
        ("version", f"{v.id} ({v.content_hash})"),
        ("task", v.task),
        ("labels", ", ".join(labels) or "-"),
        ("parent", "-" if v.parent_id is None else v.parent_id),
        ("run", v.run_id or "-"),
        ("created", v.created_at),
        ("variables", ", ".join(v.template.variables)),
        ("decision", _decision_text(v.template.decision)),
        ("dev scores", _figures(v.scores.get("dev", {})) or "-"),
        ("test scores", _figures(v.scores.get("test", {})) or "-"),
        ("latency", _figures(v.latency) or "-"),
        ("gate", _gate(v)),
    ]
    if v.damage:
        fields.insert(0, ("DAMAGED", f"{'; '.join(v.damage)} (predict refuses it; `tune-prompts store doctor` lists "
                                     "every damaged row)"))
    lines = [f"{name:<13}{_escaped(str(value))}" for name, value in fields]
    lines += [f"  {_escaped(reason)}" for reason in (v.decision.reasons if v.decision else ())]
    lines += ["template:", *[f"  {line}" for line in v.template.text.splitlines()]]
    _print(args, {**v.to_dict(), "labels": labels}, "\n".join(lines))


def _damage_mark(version: Version) -> str:
    """What a damaged version's ID cell adds: the fields that break its schema."""
    return "DAMAGED(" + ",".join(d.partition(":")[0] for d in version.damage) + ")"


def _doctor(store: TemplateStore, args: argparse.Namespace) -> int:
    rows = store.check_rows()
    found = [{"table": table, "id": row_id, "problem": problem} for table, row_id, problem in rows]
    _print(args, {"damaged": found},
           _table(["TABLE", "ID", "FIELD: PROBLEM"], [[r["table"], r["id"], r["problem"]] for r in found])
           + f"\n{len(found)} damaged field(s) in {len({(r['table'], r['id']) for r in found})} row(s): the rows were "
           "written outside tune-prompts or damaged on disk; restore the store from a backup"
           if found else "every row is sound")
    return 2 if found else 0


def _decision_text(rule) -> str:
    """What production applies for this version, in one line."""
    if rule is None:
        return "- (stored without one: predict refuses it)"
    return rule.describe()


def _diff(store: TemplateStore, args: argparse.Namespace) -> None:
    result = store.diff(_resolve(store, args.a).id, _resolve(store, args.b).id)
    rows = [[split, name, delta if delta is None else f"{delta:+.4g}"]
            for split, deltas in result["score_deltas"].items() for name, delta in deltas.items()]
    rows += [["latency", name, delta if delta is None else f"{delta:+.4g}"]
             for name, delta in result["latency_deltas"].items()]
    text = (result["text_diff"] or f"(templates of {result['a']} and {result['b']} are identical)") + "\n\n" + _table(
        ["SPLIT", "FIGURE", f"DELTA ({result['b']} - {result['a']})"], rows)
    _print(args, result, text)


def _promote(store: TemplateStore, args: argparse.Namespace) -> None:
    moved = store.promote(args.task, _resolve(store, args.version).id, force=args.force)
    ended = moved.ended_canary_id is not None
    _print(
        args,
        {"task": args.task, "production": moved.id, "previous": moved.previous_id, "canary_ended": ended,
         "forced": args.force},
        f"{_escaped(args.task)}: production {moved.previous_id or '-'} -> {moved.id}"
        + (" (forced past the gate)" if args.force else "") + (f"; canary {moved.ended_canary_id} ended" if ended else ""),
    )


def _rollback(store: TemplateStore, args: argparse.Namespace) -> None:
    _known_task(store, args.task)
    before = store.labels(args.task).get("production")
    version = store.rollback(args.task)
    _print(args, {"task": args.task, "production": version.id, "previous": before},
           f"{_escaped(args.task)}: production rolled back {before} -> {version.id}")


def _label(store: TemplateStore, args: argparse.Namespace) -> None:
    version = _resolve(store, args.version)
    store.set_label(args.task, args.label, version.id)
    _print(args, {"task": args.task, "label": args.label, "version": version.id},
           f"{_escaped(args.task)}: {_escaped(args.label)} -> {version.id}")


def _route(store: TemplateStore, args: argparse.Namespace) -> None:
    _known_task(store, args.task)
    if args.canary is not None:
        store.set_canary(args.task, _resolve(store, args.canary).id, args.share, args.ramp or DEFAULT_RAMP)
    elif args.advance:
        store.advance_canary(args.task)
    elif args.end:
        store.end_canary(args.task)
    elif args.share is not None or args.ramp is not None:
        raise StoreError("--share and --ramp set up a canary: use them with --canary VERSION")
    production, canary = store.get_label(args.task, "production"), store.canary(args.task)
    state = {
        "task": args.task,
        "production": None if production is None else production.id,
        "canary": None if canary is None else {"version": canary.version_id, "share": canary.share,
                                               "ramp": list(canary.ramp)},
    }
    text = f"{_escaped(args.task)}: production {state['production'] or '-'}; " + (
        "no canary" if canary is None else
        f"canary {canary.version_id} gets {canary.share:.0%} (ramp {', '.join(f'{s:.0%}' for s in canary.ramp)})"
    )
    if args.key is not None:
        check_name(args.key, "caller key")
        to_canary = canary is not None and takes_canary(args.task, args.key, canary.share)
        if not to_canary and production is None:
            raise StoreError(f"task {args.task!r} has no production template; promote a version first")
        cut = 0 if canary is None else round(canary.share * BUCKETS)
        state |= {"key": args.key, "bucket": bucket(args.task, args.key), "route": "canary" if to_canary else "production",
                  "version": canary.version_id if to_canary else production.id}
        text = (f"{_escaped(args.key)} -> {state['route']} (version {state['version']}; bucket {state['bucket']} "
                f"{'<' if to_canary else '>='} {cut} of {BUCKETS})\n{text}")
    _print(args, state, text)
