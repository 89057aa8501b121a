"""``tune-prompts tasks``, ``render`` and ``validate``: the commands that read task files and data and load no
model (``render --chat`` loads a tokenizer, ``validate`` the embedded one's to count tokens)."""

from __future__ import annotations

import argparse
import json

from pipelines import cli_store
from pipelines.cli_flags import add_task_flag, add_template_flag, number
from pipelines.cli_output import escape, table
from pipelines.data import load_examples, split_examples
from pipelines.task_files import builtin_tasks, load_task, read_template_file
from pipelines.validate import summarize, validate_task

MAX_RENDER_EXAMPLES = 1000
example_count = number(int, 1, MAX_RENDER_EXAMPLES)  # render's -n


def cmd_tasks(args) -> int:
    rows = []
    for name in builtin_tasks() + list(args.files or []):
        s, _ = summarize(load_task(name))
        rows.append(
            {
                "task": s["task"],
                "examples": s["examples"],
                "labels": s["output"] or balance(s),
                "train/dev/test": "/".join(str(n) for n in s["splits"].values()),
                "source": s["source"],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in rows]))
    return 0


def balance(summary: dict) -> str:
    """``summarize``'s label counts as 'high_risk 561 (12%), low_risk 3973 (88%)'."""
    n = summary["examples"]
    return ", ".join(f"{label} {count} ({count / n:.0%})" for label, count in summary["labels"].items())


def cmd_validate(args) -> int:
    from functools import cache

    from pipelines.engine.models import load_tokenizer

    # the embedded target's tokenizer counts template tokens, as a run's scorer does; loaded once, and only
    # when a file gets that far (a broken file is refused without it)
    tokenizer = cache(load_tokenizer)
    count_tokens = lambda text: len(tokenizer()(text, add_special_tokens=False).input_ids)  # noqa: E731
    reports = []
    for path in args.files:
        r = validate_task(path, count_tokens)
        reports.append(r)
        if args.json:
            continue
        expected = (f"reference {json.dumps(r['example']['reference'], ensure_ascii=False)}" if r["output"]
                    else f"label {r['example']['label']}")
        print(f"task {escape(r['task'])} ({escape(r['file'])})")
        print(f"  data: {r['examples']} examples from {escape(r['source'])}: {escape(r['output'] or balance(r))}")
        print("  splits: " + ", ".join(f"{name} {n}" for name, n in r["splits"].items()))
        print(f"  seed template: {r['template_tokens']} of {r['max_tokens']} tokens; on the first dev example "
              f"({escape(expected)}):")
        print("    " + escape(r["example"]["prompt"], keep="\n\t").replace("\n", "\n    "))
        print("ok")
    if args.json:
        print(json.dumps(reports, indent=2, ensure_ascii=False))
    return 0


def cmd_render(args) -> int:
    task = load_task(args.task)
    template = read_template_file(args.template, task) if args.template else task.seed_template()
    splits = split_examples(task, load_examples(task))
    examples = splits[args.split][: args.n]
    chat = None
    if args.chat:
        from pipelines.engine.models import load_tokenizer

        chat = load_tokenizer(args.model)
    rendered = []
    for example in examples:
        prompt = template.render(example.inputs(task.input_variable))
        if chat is not None:
            prompt = chat.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        expected = {"reference": example.reference} if task.is_generation else {"label": example.label}
        rendered.append({**expected, "prompt": prompt})
    if args.json:
        print(json.dumps({"task": task.name, "template": template.to_dict(), "examples": rendered}, indent=2))
        return 0
    # Data and template text are printed as they are, line breaks and tabs included, but escaped where they hold
    # terminal escapes or lone surrogates (which JSON data can carry and printing cannot encode).
    print(f"task {escape(task.name)}: template ({len(template.text)} characters, variables {list(template.variables)})")
    print("  " + escape(template.text, keep="\n\t").replace("\n", "\n  "))
    for i, item in enumerate(rendered, 1):
        answer = (f"reference: {json.dumps(item['reference'], ensure_ascii=False)}" if task.is_generation
                  else f"label: {item['label']}")
        print(f"\n--- example {i} of the {args.split} split ({escape(answer)}) ---")
        print(escape(item["prompt"], keep="\n\t"))
    return 0


def register_tasks(sub: argparse._SubParsersAction) -> None:
    """Add the ``tasks`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "tasks", help="list tasks with data sizes and label balance", formatter_class=raw,
        description="List the built-in tasks, and the task files given: examples, label balance (a generation\n"
        "task: its output contract), train/dev/test sizes and data source. Reads the data; loads no model.",
        epilog="examples:\n  tune-prompts tasks\n  tune-prompts tasks my_task/task.yaml --json")
    p.add_argument("files", nargs="*", help="extra task YAML files to include")
    cli_store.add_json_flag(p, "one record per task")
    p.set_defaults(func=cmd_tasks)


def register_render(sub: argparse._SubParsersAction) -> None:
    """Add the ``render`` command to the CLI's commands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "render", help="show a template rendered on a few examples", formatter_class=raw,
        description="Render a template (the task's seed, or --template FILE) on the first examples of a split and\n"
        "print each prompt as the target model receives it, with its expected label or reference. Loads no model\n"
        "(--chat loads the model's tokenizer, for its chat template).",
        epilog="examples:\n  tune-prompts render --task risk -n 3\n"
        "  tune-prompts render --task risk --template my_template.txt --split test --chat")
    add_task_flag(p)
    add_template_flag(p)
    p.add_argument("--split", default="dev", choices=["train", "dev", "test"], help="(default %(default)s)")
    p.add_argument("-n", type=example_count, default=3,
                   help=f"how many examples, 1 to {MAX_RENDER_EXAMPLES} (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target model's chat template")
    p.add_argument("--model", default=None, help="model whose chat template --chat uses (default: the embedded one)")
    cli_store.add_json_flag(p, "the template and the rendered prompts")
    p.set_defaults(func=cmd_render)


def register_validate(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` command to the CLI's commands."""
    p = sub.add_parser(
        "validate", help="check task files as a run reads them (data, labels, splits, seed template), loading no model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load each task file with the code a run uses, read its data, map its labels, make the\n"
        "splits, render the seed template on one example and count its tokens against template.max_tokens\n"
        "(with the embedded model's tokenizer; no model weights are loaded). Prints a short summary per file\n"
        "and 'ok'. Exit 0: every file is usable; 2: the first problem, in one line naming the fix.",
        epilog="examples:\n  tune-prompts validate my_task/task.yaml\n"
        "  tune-prompts validate --json risk tests/data/cases_4label.yaml")
    p.add_argument("files", nargs="+", metavar="TASK.yaml", help="task YAML files (or built-in task names: risk, ...)")
    cli_store.add_json_flag(p, "one record per file")
    p.set_defaults(func=cmd_validate)
