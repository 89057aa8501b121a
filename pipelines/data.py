"""Task data: read a CSV/TSV/JSONL file, map raw labels to task labels, split deterministically.

Splits are stratified by label and depend only on the data and ``split.seed``. With
``split.balanced`` each split takes the same number of examples from every label, which
keeps metrics on a rare positive class (risky messages are about 13% of the SMS data) from
resting on a handful of examples. The test split is held out: tuning never reads it.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipelines.config import TaskConfig, resolve_source


@dataclass(frozen=True)
class Example:
    text: str
    label: str  # a task label name, e.g. "high_risk"


@dataclass(frozen=True)
class Splits:
    train: tuple[Example, ...]
    dev: tuple[Example, ...]
    test: tuple[Example, ...]

    def __getitem__(self, name: str) -> tuple[Example, ...]:
        if name not in ("train", "dev", "test"):
            raise KeyError(f"unknown split {name!r}; use train, dev or test")
        return getattr(self, name)


class DataError(ValueError):
    """The task's data cannot be used; the message names the file and the fix."""


def _open_text(path: Path) -> io.TextIOBase:
    opener = {".bz2": bz2.open, ".gz": gzip.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8", errors="replace", newline="")


def read_rows(task: TaskConfig) -> list[dict[str, str]]:
    cfg = task.data
    path = resolve_source(cfg.source, task.base_dir)
    if not path.is_file():
        raise DataError(f"task {task.name!r}: data file {path} does not exist; fix data.source")
    rows: list[dict[str, str]] = []
    with _open_text(path) as fh:
        if cfg.format == "jsonl":
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{lineno}: each line must be a JSON object")
                rows.append({str(k): "" if v is None else str(v) for k, v in record.items()})
        else:
            quoting = csv.QUOTE_NONE if cfg.delimiter == "\t" else csv.QUOTE_MINIMAL
            if cfg.header:
                reader = csv.DictReader(fh, delimiter=cfg.delimiter, quoting=quoting)
                rows = [dict(r) for r in reader]
            else:
                if not cfg.columns:
                    raise DataError(f"task {task.name!r}: data.header is false, so give data.columns")
                for values in csv.reader(fh, delimiter=cfg.delimiter, quoting=quoting):
                    if values:
                        rows.append(dict(zip(cfg.columns, values)))
    if not rows:
        raise DataError(f"task {task.name!r}: data file {path} holds no rows")
    for column in (cfg.text_column, cfg.label_column):
        if not any(column in row for row in rows[:50]):
            raise DataError(
                f"task {task.name!r}: column {column!r} not found in {path}; "
                f"columns are {sorted(rows[0])}: fix data.text_column / data.label_column"
            )
    return rows


def load_examples(task: TaskConfig) -> list[Example]:
    """All usable examples of a task, raw labels mapped to task labels, repeats dropped."""
    cfg = task.data
    to_label = {value: name for name, spec in task.labels.items() for value in spec.values}
    examples: list[Example] = []
    seen: set[str] = set()
    unknown: Counter[str] = Counter()
    for row in read_rows(task):
        raw = (row.get(cfg.label_column) or "").strip()
        text = (row.get(cfg.text_column) or "").strip()
        if raw in cfg.drop_values or not text:
            continue
        if raw not in to_label:
            unknown[raw] += 1
            continue
        if cfg.dedupe:
            if text in seen:
                continue
            seen.add(text)
        examples.append(Example(text[: cfg.max_chars], to_label[raw]))
    if unknown:
        values = ", ".join(f"{v!r} ({n})" for v, n in unknown.most_common(5))
        raise DataError(
            f"task {task.name!r}: label value(s) {values} are not mapped to any label; "
            f"add them to labels.<name>.values or to data.drop_values"
        )
    counts = Counter(e.label for e in examples)
    if not examples:
        raise DataError(f"task {task.name!r}: no usable examples in the data")
    missing = [name for name in task.labels if counts[name] == 0]
    if missing:
        raise DataError(
            f"task {task.name!r}: label(s) {missing} have no examples ({dict(counts)}); "
            "a task needs examples of every label to measure anything"
        )
    return examples


def split_examples(task: TaskConfig, examples: list[Example]) -> Splits:
    """Deterministic stratified train/dev/test splits (sizes from ``task.split``)."""
    cfg = task.split
    by_label: dict[str, list[Example]] = {name: [] for name in task.labels}
    for example in examples:
        by_label[example.label].append(example)
    rng = random.Random(cfg.seed)
    for name in by_label:  # sort first so the split does not depend on file order
        by_label[name].sort(key=lambda e: e.text)
        rng.shuffle(by_label[name])
    share = {name: len(pool) / len(examples) for name, pool in by_label.items()}
    parts: dict[str, list[Example]] = {"test": [], "dev": [], "train": []}
    # Test is carved out first so that changing train/dev sizes never moves an example into test.
    for split in ("test", "dev", "train"):
        size = getattr(cfg, split)
        for name, pool in by_label.items():
            if cfg.balanced:
                want = size // len(by_label)
            else:
                want = max(1, round(size * share[name]))
            if len(pool) < want:
                raise DataError(
                    f"task {task.name!r}: split {split!r} needs {want} examples of label {name!r} "
                    f"but only {len(pool)} are left; lower split.{split} or add data"
                )
            parts[split].extend(pool[:want])
            del pool[:want]
    for split in parts:
        parts[split].sort(key=lambda e: (e.label, e.text))
        random.Random(f"{cfg.seed}-{split}").shuffle(parts[split])
    return Splits(tuple(parts["train"]), tuple(parts["dev"]), tuple(parts["test"]))


def load_splits(task: TaskConfig) -> Splits:
    return split_examples(task, load_examples(task))


def label_counts(examples) -> dict[str, int]:
    return dict(Counter(e.label for e in examples))
