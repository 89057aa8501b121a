"""Write docs/tasks.md: a short guide to task files, then a table of every setting, generated from the pydantic
models of pipelines/config.py (``TaskConfig.model_json_schema()``), so the reference cannot drift from the code.

    python scripts/gen_task_docs.py            write docs/tasks.md
    python scripts/gen_task_docs.py --check    exit 1 if docs/tasks.md differs from what would be written

A setting's description is its ``Field(description=...)`` in pipelines/config.py: edit it there, then run this.
tests/test_docs.py fails when docs/tasks.md is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from pipelines.config import TaskConfig

DOC = REPO / "docs" / "tasks.md"
HIDDEN = {"base_dir"}  # set by the loader (the task file's folder), never written in a task file

GUIDE = """\
# Task files

A task is one YAML file: what the target model decides (or generates), from which data, with which template, and
how candidates are rewarded, chosen and promoted. The built-in tasks are `pipelines/tasks/*.yaml`; a task of your
own is any file you pass by its path (README.md, "Your own task", has a complete one with its data):

```bash
tune-prompts validate my_task/task.yaml   # check it: data, labels, splits, seed template; loads no model
tune-prompts --task my_task/task.yaml     # tune its template
```

Every command that takes `--task` takes a built-in's name or a path. Settings come from the defaults below, then
the task file, then the command line (`--steps`, `--candidates`, `--seed`). Unknown keys are refused, and every
error is one line naming the setting and the fix. Six settings are required: `name`, `description`, `data`,
`template`, `judge` (which may be `{}`) and `reward`; everything else has the default shown in the tables.

## Data

`data.source` is a path relative to the task file, an absolute path, or `package:<package>/<path>`, a file inside
an installed package (the built-ins read their data this way). A CSV file has a header row (or `header: false`
and `columns: [...]`); a TSV file is a CSV with `delimiter: "\\t"`; a JSONL file has one object a line
(`format: jsonl`); a `.gz` or `.bz2` file is decompressed as it is read. Data is read as strict UTF-8, at most
1 MB a line and 512 MB a file. `data.text_column` names the input column, and the template's input placeholder
has the same name (`text` and `{text}` by default); several inputs are `data.input_columns`, one placeholder each.
Rows whose input repeats an earlier row's are dropped (`dedupe`).

## Labels

A classification task has two or more `labels`. Each maps the raw values of `data.label_column` to a label name
and gives its `verbalizer`, the word the target model answers with; a raw value no label maps is an error unless
`data.drop_values` lists it. With two labels, `positive_label` names the one the calibrated threshold decides;
with more, leave it out. A generation task has an `output:` contract instead of labels, and its reference
answers in `data.reference_column`. Splits are stratified: with `split.balanced` (the default) each split takes
the same number of examples of every label, so each label needs at least one example in each of train, dev and
test (three in all, and each split size is at least 2). The test split is never read while tuning.

## The template section

`template.skeleton` is the fixed frame: `{instruction}` first, then the input placeholder(s), each once, and the
question with its answer words; the policy writes only the instruction, so the placeholders and answer words
cannot be lost. `{{` and `}}` are literal braces. `seed_instruction` is the hand-written instruction the run
starts from: the seed template, which every candidate is compared with. `constraints` hold each input's checks
(`max_chars`, `in`, `regex`). `max_tokens` is the token budget of a whole template (the gate's; counted with the
target's tokenizer) and `max_instruction_tokens` bounds what the policy writes. The section may also be the
path of a YAML file holding these keys: `template: my_template.yaml`.

## Checking a task file

`tune-prompts validate TASK.yaml [TASK.yaml ...]` loads each file with the code a run uses, reads its data, maps
its labels, makes the splits, renders the seed template on one example and counts its tokens against
`template.max_tokens` with the embedded model's tokenizer (no model weights are loaded). It prints the task's
name, its examples per label, the split sizes and the rendered example, then `ok`, and exits 0; any problem
exits 2 with one line naming it and the fix. `--json` prints the same as records. `tune-prompts render --task
TASK.yaml -n 5` shows more examples, and `tune-prompts tasks TASK.yaml` lists the task beside the built-ins.
"""

REFERENCE = """\
## Reference

Generated from the pydantic models in `pipelines/config.py` by `scripts/gen_task_docs.py`; do not edit it by
hand: change a setting's `Field(description=...)` there and run `python scripts/gen_task_docs.py`
(`tests/test_docs.py` fails while this file is stale). A section's settings are written under its key, e.g.
`split: {train: 100, dev: 100, test: 200}` or one per line, indented.
"""


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def cell(text: str) -> str:
    """One table cell: pipes escaped, one line, and outside code spans a '<pkg>' kept as text rather than read as
    an HTML tag."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|").replace("\n", " "))
    return "".join(p if p.startswith("`") else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for p in parts)


class Reference:
    """The tables of the schema's sections, in the order a reader meets them (depth first)."""

    def __init__(self, schema: dict) -> None:
        self.defs = schema.get("$defs", {})
        self.sections: list[tuple[str, dict, str]] = []  # (YAML path, the model's schema, the key's description)
        self._add("top level", schema, "")

    def _add(self, path: str, schema: dict, description: str) -> None:
        self.sections.append((path, schema, description))
        for name, prop in schema.get("properties", {}).items():
            if name in HIDDEN:
                continue
            ref, suffix = self._ref(prop)
            if ref is not None:
                child = name if path == "top level" else f"{path}.{name}"
                self._add(child + suffix, self.defs[ref], prop.get("description", ""))

    def _ref(self, prop: dict) -> tuple[str | None, str]:
        """The model a setting holds (its $defs name, and '.<name>' for a mapping of them), or (None, '')."""
        for option in [prop, *prop.get("anyOf", [])]:
            if "$ref" in option:
                return option["$ref"].rsplit("/", 1)[1], ""
            extra = option.get("additionalProperties")
            if isinstance(extra, dict) and "$ref" in extra:
                return extra["$ref"].rsplit("/", 1)[1], ".<name>"
        return None, ""

    def type_of(self, prop: dict, path: str, name: str) -> str:
        ref, suffix = self._ref(prop)
        if ref is not None:
            child = name if path == "top level" else f"{path}.{name}"
            link = f"[`{child + suffix}`](#{anchor(child + suffix)})"
            kind = f"mapping: name -> {link}" if suffix else f"section {link}"
            return kind + (" or null" if any(o.get("type") == "null" for o in prop.get("anyOf", [])) else "")
        if "anyOf" in prop:
            return " or ".join(self.type_of(o, path, name) for o in prop["anyOf"])
        if "enum" in prop:
            return " or ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
        kind = prop.get("type", "any")
        if kind == "array":
            if "prefixItems" in prop:
                kind = "[" + ", ".join(self.type_of(p, path, name) for p in prop["prefixItems"]) + "]"
            else:
                kind = "list of " + self.type_of(prop.get("items", {}), path, name)
        elif kind == "object":
            extra = prop.get("additionalProperties")
            kind = "mapping" + (f" of string -> {self.type_of(extra, path, name)}" if isinstance(extra, dict) else "")
        bounds = [f"{sign} {prop[key]}" for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                            ("maximum", "<="), ("exclusiveMaximum", "<"))
                  if key in prop]
        if prop.get("minLength") == 1 or prop.get("minItems") == 1 and "prefixItems" not in prop:
            bounds.append("not empty")
        if "maxProperties" in prop:
            bounds.append(f"at most {prop['maxProperties']}")
        if "pattern" in prop:
            bounds.append(f"matching `{prop['pattern']}`")
        return kind + (f" ({', '.join(bounds)})" if bounds else "")

    def default_of(self, prop: dict, name: str, required: set[str]) -> str:
        if name in required:
            return "required"
        if "default" not in prop:  # a default_factory: an empty mapping
            return "`{}`"
        if self._ref(prop)[0] is not None and prop["default"] is not None:
            return "see its section"
        return f"`{json.dumps(prop['default'], ensure_ascii=False)}`"

    def markdown(self) -> str:
        out = [REFERENCE]
        for path, schema, description in self.sections:
            out.append(f"### {path if path == 'top level' else f'`{path}`'}\n")
            intro = " ".join(((schema.get("description") if path != "top level" else None) or description).split())
            if intro:
                out.append(intro[0].upper() + intro[1:].rstrip(".") + ".\n")
            rows = ["| setting | type | default | description |", "| --- | --- | --- | --- |"]
            required = set(schema.get("required", []))
            for name, prop in schema.get("properties", {}).items():
                if name in HIDDEN:
                    continue
                rows.append(f"| `{name}` | {cell(self.type_of(prop, path, name))} | "
                            f"{cell(self.default_of(prop, name, required))} | {cell(prop.get('description', ''))} |")
            out.append("\n".join(rows) + "\n")
        return "\n".join(out)


def generate() -> str:
    """The whole of docs/tasks.md."""
    return GUIDE + "\n" + Reference(TaskConfig.model_json_schema()).markdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/tasks.md is not what would be written")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC.relative_to(REPO)} is stale: run python scripts/gen_task_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
