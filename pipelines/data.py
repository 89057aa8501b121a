"""Task data: read a CSV/TSV/JSONL file, map raw labels to task labels, split deterministically.

Splits are stratified by label and depend only on the data and ``split.seed``. With
``split.balanced`` each split takes the same number of examples from every label, which
keeps metrics on a rare positive class (risky messages are about 13% of the SMS data) from
resting on a handful of examples. The test split is held out: tuning never reads it.

Data files are read strictly: UTF-8 only (bad bytes are refused, not replaced), at most MAX_DATA_BYTES
(also after decompression) and MAX_LINE_BYTES a line; every problem is a DataError naming the file and line.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import json
import random
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.config import TaskConfig, excerpt
from pipelines.task_files import check_file, resolve_source
from rewards.entities import find_entities
from templates.template import TemplateError


@dataclass(frozen=True)
class Example:
    text: str
    label: str  # a task label name, e.g. "high_risk"; "" in a generation task
    reference: Any = field(default=None, compare=False)  # generation: the reference answer (parsed JSON or text)
    values: Any = field(default=None, compare=False)  # several inputs: placeholder -> value; ``text`` is their span

    def inputs(self, variable: str) -> dict[str, str]:
        """The template's values for this example (``variable``: the task's only input placeholder)."""
        return dict(self.values) if self.values is not None else {variable: self.text}


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


MAX_DATA_BYTES = 512 * 2**20  # bigger is a mistake or a decompression bomb, not a task's examples
MAX_LINE_BYTES = 2**20  # a line (a JSONL record, a CSV row) this long is not a text to classify


def _lines(path: Path) -> Iterator[str]:
    """The lines of a (.gz or .bz2 compressed) data file, each decoded strictly as UTF-8 (no replacement
    characters: bad bytes are refused). Bad bytes, a corrupt archive, a line over MAX_LINE_BYTES or more than
    MAX_DATA_BYTES in all end in a DataError naming the line. Lines end at \\n (\\r\\n too; not a lone \\r)."""
    name = excerpt(path.name)
    opener = {".bz2": bz2.open, ".gz": gzip.open}.get(path.suffix, open)
    lineno, total = 0, 0
    try:
        with opener(path, "rb") as fh:
            while raw := fh.readline(MAX_LINE_BYTES + 1):
                lineno += 1
                total += len(raw)
                if len(raw) > MAX_LINE_BYTES:
                    raise DataError(f"data file {name}: line {lineno} is over {MAX_LINE_BYTES} bytes "
                                    "(an unclosed quote?); fix the line or shorten the text")
                if total > MAX_DATA_BYTES:
                    raise DataError(f"data file {name}: more than {MAX_DATA_BYTES // 2**20} MB of text by line "
                                    f"{lineno}; give a smaller file")
                yield raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a spreadsheet's byte order mark
    except UnicodeDecodeError:
        raise DataError(f"data file {name}: line {lineno} is not UTF-8 text; save the file as UTF-8") from None
    except (OSError, EOFError, zlib.error) as exc:  # a corrupt or cut-off archive
        raise DataError(f"data file {name}: cannot be read at line {lineno + 1} ({type(exc).__name__}: "
                        f"{excerpt(str(exc))}); give an intact {path.suffix or 'text'} file") from None


def _json_row(line: str, name: str, lineno: int) -> dict[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"data file {name}: line {lineno} is not a JSON object ({exc.msg}); fix the line") from None
    except RecursionError:
        raise DataError(f"data file {name}: line {lineno} is JSON nested too deep; give flat records") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise DataError(f"data file {name}: line {lineno}: {excerpt(str(exc))}; fix the line") from None
    if not isinstance(record, dict):
        raise DataError(f"data file {name}: line {lineno} must be a JSON object such as "
                        '{"text": "...", "label": "..."}')
    # an object or list (a generation task's reference answer) stays JSON text
    row = {str(k): "" if v is None else json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)
           for k, v in record.items()}
    try:  # a JSON escape can make a lone surrogate, which is no text and cannot be printed
        "".join([*row, *row.values()]).encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"data file {name}: line {lineno} holds an unpaired surrogate escape (such as \\ud800); "
                        "fix the text") from None
    return row


def read_rows(task: TaskConfig) -> list[dict[str, str]]:
    cfg = task.data
    path = resolve_source(cfg.source, task.base_dir)
    check_file(path, "data file", MAX_DATA_BYTES)
    name = excerpt(path.name)
    rows: list[dict[str, str]] = []
    if cfg.format == "jsonl":
        for lineno, line in enumerate(_lines(path), 1):
            if line.strip():
                rows.append(_json_row(line, name, lineno))
    else:
        if not cfg.header and not cfg.columns:
            raise DataError(f"task {task.name!r}: data.header is false, so give data.columns")
        quoting = csv.QUOTE_NONE if cfg.delimiter == "\t" else csv.QUOTE_MINIMAL
        reader = csv.reader(_lines(path), delimiter=cfg.delimiter, quoting=quoting)
        try:
            header = cfg.columns if not cfg.header else next(reader, [])
            for values in reader:
                if values:
                    rows.append(dict(zip(header, values)))
        except csv.Error as exc:
            raise DataError(f"data file {name}: line {reader.line_num}: {excerpt(str(exc))}; fix the row "
                            "(an unclosed quote?) or data.delimiter") from None
    if not rows:
        raise DataError(f"task {task.name!r}: data file {name} holds no rows; add examples or fix data.source")
    if not task.is_generation:
        wanted = [cfg.label_column]
    else:  # references read from a column, or found in the input (data.reference_entity)
        wanted = [cfg.reference_column] if cfg.reference_entity is None else []
    for column in (*task.input_variables, *wanted):
        if not any(column in row for row in rows[:50]):
            columns = ", ".join(excerpt(c, 30) for c in list(rows[0])[:5])
            raise DataError(
                f"task {task.name!r}: column {column!r} not found in {name}; its first columns are {columns}: "
                "fix data.text_column / data.label_column / data.reference_column (or data.delimiter, data.header)"
            )
    return rows


def load_examples(task: TaskConfig) -> list[Example]:
    """All usable examples of a task, raw labels mapped to task labels (or, for a generation task, each with its
    reference answer), repeats dropped."""
    if task.is_generation:
        return _generation_examples(task)
    cfg = task.data
    to_label = {value: name for name, spec in task.labels.items() for value in spec.values}
    examples: list[Example] = []
    seen: set[str] = set()
    unknown: Counter[str] = Counter()
    read = _input_reader(task)
    for i, row in enumerate(read_rows(task), 1):
        raw = (row.get(cfg.label_column) or "").strip()
        text, values = read(row, i)
        if raw in cfg.drop_values or not text:
            continue
        if raw not in to_label:
            unknown[raw] += 1
            continue
        if cfg.dedupe:
            if text in seen:
                continue
            seen.add(text)
        examples.append(Example(text if values else text[: cfg.max_chars], to_label[raw], values=values))
    if unknown:
        values = ", ".join(f"{excerpt(v, 30)} ({n})" for v, n in unknown.most_common(3))
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


def _input_reader(task: TaskConfig):
    """``read(row, i) -> (text, values)``: one input column's text (values None), or for several the span of the
    template between its first and last input placeholder rendered with the row's values (the text the scorers
    see; ``Template.input_frame``). Each value is cut to ``data.max_chars``; a value that breaks the template's
    constraints is named with its row."""
    cfg = task.data
    if len(task.input_variables) == 1:
        return lambda row, i: ((row.get(cfg.text_column) or "").strip(), None)
    _, span = task.seed_template().input_frame()

    def read(row: dict, i: int) -> tuple[str, dict | None]:
        values = {name: (row.get(name) or "").strip()[: cfg.max_chars] for name in task.input_variables}
        if not all(values.values()):
            return "", None
        try:
            return span.render(values), values
        except TemplateError as exc:
            raise DataError(f"task {task.name!r}: data row {i}: {excerpt(str(exc), 160)}; fix the row or the "
                            "template's constraints") from None

    return read


def _generation_examples(task: TaskConfig) -> list[Example]:
    """A generation task's examples: input text and reference answer, which must keep the task's contract (a
    reference the contract refuses could never be matched: the row is named, not skipped). With
    ``data.reference_entity`` the reference is the first entity of that type in the input, and rows without one
    are left out."""
    cfg = task.data
    contract = task.output.output_contract()
    examples: list[Example] = []
    seen: set[str] = set()
    read = _input_reader(task)
    for i, row in enumerate(read_rows(task), 1):
        text, values = read(row, i)
        if not text:
            continue
        if cfg.reference_entity is None:
            reference = (row.get(cfg.reference_column) or "").strip()
        else:
            reference = next((e.value for e in find_entities(text[: cfg.max_chars])
                              if e.type == cfg.reference_entity), None)
            if reference is None:
                continue
            reference = json.dumps(reference) if contract.kind == "json" else reference
        parsed = contract.parse(reference)
        if not parsed.ok:
            raise DataError(f"task {task.name!r}: data row {i}: the reference answer breaks the output contract "
                            f"({excerpt(parsed.reason, 120)}); fix the reference or output.contract")
        if cfg.dedupe:
            if text in seen:
                continue
            seen.add(text)
        examples.append(Example(text if values else text[: cfg.max_chars], "", parsed.value, values))
    if not examples:
        raise DataError(f"task {task.name!r}: no usable examples in the data")
    return examples


def split_examples(task: TaskConfig, examples: list[Example]) -> Splits:
    """Deterministic stratified train/dev/test splits (sizes from ``task.split``); a generation task's examples
    are one pool."""
    cfg = task.split
    by_label: dict[str, list[Example]] = {name: [] for name in task.labels or ("",)}
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
        if cfg.balanced and size < len(by_label):  # size // labels would be 0: a split without examples
            raise DataError(f"task {task.name!r}: split.{split} is {size}, fewer than the {len(by_label)} labels, so "
                            f"a balanced split would hold no examples; raise split.{split} to {len(by_label)} or more")
        for name, pool in by_label.items():
            if cfg.balanced:
                want = size // len(by_label)
            else:
                want = max(1, round(size * share[name]))
            if len(pool) < want:
                of_label = f" of label {name!r}" if name else ""
                # one of a label per split is the least there is: only more data helps
                fix = (f"lower split.{split} or add data" if want > 1 else
                       "add data: each label needs at least 3 examples, one each for test, dev and train")
                raise DataError(
                    f"task {task.name!r}: split {split!r} needs {want} examples{of_label} "
                    f"but only {len(pool)} are left; {fix}"
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
