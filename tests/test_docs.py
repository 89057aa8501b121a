"""Docs that cannot drift (issue #38): docs/tasks.md is what scripts/gen_task_docs.py generates from the schema,
every YAML example in README.md and docs/*.md is accepted by the code a run uses, and README.md's own task passes
`tune-prompts validate` and its 1-step tuning run exactly as written.

How a ```yaml block is checked depends on the HTML comment on the line just above its fence:
    <!-- file: PATH -->   a file of the example (any language): written to PATH in a fresh folder, with the
                          document's other file blocks, before the document's task blocks are loaded, so that
                          their data exists; a yaml one is a task file too
    <!-- partial -->      a fragment of a task file: it must parse, and its top-level keys must be task settings
    <!-- not-a-task -->   other YAML (a Ray cluster config, ...): it must parse
    none of these         a whole task file, loaded with load_task
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.cli import main
from pipelines.config import TaskConfig, builtin_tasks, load_task

REPO = Path(__file__).resolve().parents[1]
# scripts/ is not a package: the generator is loaded by path
_spec = importlib.util.spec_from_file_location("gen_task_docs", REPO / "scripts" / "gen_task_docs.py")
gen_task_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_task_docs)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FILE_MARK = re.compile(r"<!--\s*file:\s*(\S+)\s*-->")


def blocks(text: str) -> list[dict]:
    """Every fenced block of a markdown text: its language, body, first line number and the line above it."""
    out, lines, current = [], text.splitlines(), None
    for i, line in enumerate(lines):
        if current is None and line.startswith("```"):
            current = {"lang": line[3:].strip(), "line": i + 1, "above": lines[i - 1].strip() if i else "", "body": []}
        elif current is not None and line.strip() == "```":
            out.append({**current, "body": "\n".join(current["body"]) + "\n"})
            current = None
        elif current is not None:
            current["body"].append(line)
    return out


def write_files(found: list[dict], folder: Path) -> None:
    """The blocks marked <!-- file: PATH --> written under ``folder``."""
    for block in found:
        mark = FILE_MARK.fullmatch(block["above"])
        if mark:
            path = Path(mark.group(1))
            assert not path.is_absolute() and ".." not in path.parts, f"file block path {path} must stay in its folder"
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(block["body"], encoding="utf-8")


YAML_BLOCKS = [pytest.param(doc, block, id=f"{doc.relative_to(REPO)}:{block['line']}")
               for doc in DOCS for block in blocks(doc.read_text(encoding="utf-8")) if block["lang"] == "yaml"]


# --- docs/tasks.md ----------------------------------------------------------------------------

def test_tasks_md_is_what_the_generator_writes_from_the_schema():
    assert gen_task_docs.DOC.read_text(encoding="utf-8") == gen_task_docs.generate(), (
        "docs/tasks.md is stale: run python scripts/gen_task_docs.py")


def test_every_setting_has_a_description():
    schema = TaskConfig.model_json_schema()
    for model in [schema, *schema["$defs"].values()]:
        for name, prop in model["properties"].items():
            assert name in gen_task_docs.HIDDEN or prop.get("description"), (
                f"{model['title']}.{name} has no Field(description=...) in pipelines/config.py")


def test_the_check_flag_exits_1_on_a_stale_file_and_0_on_a_fresh_one(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "tasks.md"
    monkeypatch.setattr(gen_task_docs, "DOC", doc)
    monkeypatch.setattr(gen_task_docs, "REPO", tmp_path)
    doc.write_text("# an old version\n")
    assert gen_task_docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stale: run python scripts/gen_task_docs.py" in err
    assert gen_task_docs.main([]) == 0 and gen_task_docs.main(["--check"]) == 0


# --- YAML examples ----------------------------------------------------------------------------

@pytest.mark.parametrize("doc, block", YAML_BLOCKS)
def test_yaml_examples_are_what_the_tool_accepts(doc, block, tmp_path):
    where = f"{doc.relative_to(REPO)} line {block['line']}"
    if block["above"] in ("<!-- partial -->", "<!-- not-a-task -->"):
        data = yaml.safe_load(block["body"])
        assert isinstance(data, dict), f"{where}: not a YAML mapping"
        if block["above"] == "<!-- partial -->":
            unknown = set(data) - set(TaskConfig.model_fields) - gen_task_docs.HIDDEN
            assert not unknown, f"{where}: {sorted(unknown)} are not task settings"
        return
    write_files(blocks(doc.read_text(encoding="utf-8")), tmp_path)
    mark = FILE_MARK.fullmatch(block["above"])
    path = tmp_path / (mark.group(1) if mark else "example.yaml")
    if not mark:
        path.write_text(block["body"], encoding="utf-8")
    try:
        load_task(path)
    except ValueError as exc:
        pytest.fail(f"{where}: a yaml block is loaded as a whole task file and it is not one ({exc}); complete it, "
                    "or mark it <!-- partial --> (or <!-- not-a-task -->) on the line above its fence")


# --- tune-prompts validate --------------------------------------------------------------------

def test_validate_passes_the_built_in_tasks(capsys):
    assert main(["validate", "--json", *builtin_tasks()]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["task"] for r in records] == builtin_tasks()
    for r in records:
        assert r["ok"] and 0 < r["template_tokens"] <= r["max_tokens"]
        assert all(n > 0 for n in r["splits"].values())
        assert "{" not in r["example"]["prompt"].replace("{{", "")  # rendered: no placeholder left


def readme_own_task() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## Your own task\n")
    return text[start : text.index("\n## ", start + 1)]


@pytest.mark.e2e
def test_the_readme_own_task_validates_and_tunes_as_written(tmp_path, monkeypatch, capsys, ray_session):
    section = readme_own_task()
    found = blocks(section)
    write_files(found, tmp_path)
    commands = [line for b in found if b["lang"] == "bash" for line in b["body"].splitlines() if line.strip()]
    assert [shlex.split(c)[:2] for c in commands] == [["tune-prompts", "validate"], ["tune-prompts", "--task"]]
    monkeypatch.chdir(tmp_path)  # the README's paths are relative to a fresh folder

    validate, tune = (shlex.split(c)[1:] for c in commands)
    code = main(validate)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "task card-fraud" in out and "fraud 3 (50%), legit 3 (50%)" in out and out.endswith("ok\n")
    assert "Payment: " in out and "Is this payment fraud? Answer yes or no." in out

    code = main(tune)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out test split (card-fraud)" in out
    report = json.loads((tmp_path / tune[tune.index("--run-dir") + 1] / "report.json").read_text())
    assert report["steps"] == 1 and report["test"][0]["template_name"] == "seed"


# --- links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors a markdown file offers: explicit <a id="..."> ones and GitHub's slugs of its headings."""
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_and_anchor_that_exist(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not this repository's
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name} links to {target}: no such anchor in {path.name}"
