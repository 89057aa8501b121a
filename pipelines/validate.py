"""`tune-prompts validate`: check a task file with the code a run uses, without loading a model.

A run starts with ``load_task`` (the schema and its cross-checks), ``load_examples`` (the data, its labels mapped)
and ``split_examples``; validate does the same, then renders the seed template on one example and counts its
tokens against ``template.max_tokens`` (the gate's budget) with the target's tokenizer, which the caller passes in.
Whatever would stop a run at start-up stops here with the same one-line error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipelines.config import ConfigError, TaskConfig, excerpt
from pipelines.data import Splits, label_counts, load_examples, split_examples
from pipelines.task_files import load_task
from templates.template import validate_candidate


def summarize(task: TaskConfig) -> tuple[dict, Splits]:
    """The task's data as a run reads it: usable examples, their count per label (or a generation task's
    contract), the split sizes; and the splits."""
    examples = load_examples(task)
    splits = split_examples(task, examples)
    counts = label_counts(examples)
    output = None
    if task.is_generation:
        contract = task.output.output_contract()
        fields = (contract.schema or {}).get("required") if contract.kind == "json" else None
        output = f"generation: {contract.kind}" + (f" ({', '.join(fields)})" if fields else "")
    summary = {
        "task": task.name,
        "source": task.data.source,
        "examples": len(examples),
        "labels": {label: counts.get(label, 0) for label in task.labels},
        "output": output,
        "splits": {name: len(splits[name]) for name in ("train", "dev", "test")},
    }
    return summary, splits


def validate_task(path: str | Path, count_tokens: Callable[[str], int]) -> dict:
    """``summarize`` of the task file at ``path``, with its seed template rendered on the first dev example and
    its token count. Raises ConfigError, DataError or TemplateError (one line naming the fix) for any problem."""
    task = load_task(path)
    summary, splits = summarize(task)
    seed = task.seed_template()
    check = validate_candidate(seed.text, task.input_variables, task.template.max_tokens, count_tokens)
    if not check.ok:
        raise ConfigError(f"task file {excerpt(str(path))}: the seed template: {check.reasons[0]}; raise "
                          "template.max_tokens or shorten template.skeleton and template.seed_instruction")
    example = splits.dev[0]
    expected = {"reference": example.reference} if task.is_generation else {"label": example.label}
    return {
        "file": str(path),
        **summary,
        "seed_template": seed.text,
        "template_tokens": check.tokens,
        "max_tokens": task.template.max_tokens,
        "example": {**expected, "prompt": seed.render(example.inputs(task.input_variable))},
        "ok": True,
    }
