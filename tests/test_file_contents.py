"""Files that are not what a flag or a setting expects (issue #41): a file of `name:hash` lines given as a task
file, a template file or a template section file comes back in no error, only its name and a line number; YAML
tags other than plain ones, nesting past the limit and over-large or over-deep output contracts are refused in
one line; a verbalizer of whitespace is refused.
"""

import json

import pytest
import yaml

from pipelines.cli import main
from templates.contract import MAX_SCHEMA_DEPTH, ContractError, OutputContract

USERS = ["alice", "bob", "mallory"]
HASHES = [f"$6$Salt{i}Qx$Hash{i}VeryPrivateDigestZq{i}" for i in range(3)]
# the distinctive tokens of the file: none of them may be printed
TOKENS = USERS + [h.split("$")[2] for h in HASHES] + [h.split("$")[3] for h in HASHES]


def shadow(colon_joined: bool = True) -> str:
    """/etc/shadow-like lines (name:hash:...); or name: hash, which YAML reads as a mapping of those names."""
    if colon_joined:
        return "".join(f"{user}:{digest}:19000:0:99999:7:::\n" for user, digest in zip(USERS, HASHES))
    return "".join(f"{user}: {digest}\n" for user, digest in zip(USERS, HASHES))


def task_dict(**changes) -> dict:
    task = {
        "name": "cases", "description": "Is an inbound case risky?",
        "data": {"source": "cases.csv"},
        "labels": {"high": {"values": ["fraud"], "verbalizer": "yes"}, "low": {"values": ["ok"], "verbalizer": "no"}},
        "positive_label": "high",
        "split": {"seed": 3, "train": 4, "dev": 4, "test": 4},
        "template": {"skeleton": "{instruction}\nCase: {text}\nRisky? Answer yes or no.",
                     "seed_instruction": "You screen cases for a bank."},
        "judge": {"rubrics": {}},
        "reward": {"weights": {"task_metric": 1.0}},
    }
    for dotted, value in changes.items():
        node = task
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return task


@pytest.fixture
def folder(tmp_path):
    rows = [("fraud", f"Send your PIN to claim prize {i}") for i in range(8)] + [
        ("ok", f"See you at lunch on day {i}") for i in range(8)]
    (tmp_path / "cases.csv").write_text("label,text\n" + "".join(f"{label},{text}\n" for label, text in rows))
    return tmp_path


def refused(argv, capsys) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert "Traceback" not in captured.err and len(captured.err) < 500, captured.err
    return captured.err


def hidden(err: str, allowed: tuple[str, ...] = ()) -> None:
    shown = [token for token in TOKENS if token in err and token not in allowed]
    assert not shown, (shown, err)


@pytest.mark.parametrize("suffix", [".yaml", ".txt", ""])
@pytest.mark.parametrize("command", ["render", "eval"])
def test_a_shadow_file_as_a_template_file_shows_nothing_of_it(folder, capsys, suffix, command):
    path = folder / f"shadow{suffix}"
    path.write_text(shadow())
    (folder / "task.yaml").write_text(yaml.safe_dump(task_dict()))
    err = refused([command, "--task", folder / "task.yaml", "--template", path], capsys)
    hidden(err)
    if suffix == ".yaml":
        assert "is not a template file (line 1 is not `key: value`)" in err


@pytest.mark.parametrize("command", [["render", "--task"], ["validate"], ["tasks"], ["--estimate", "--task"]])
def test_a_shadow_file_as_a_task_file_shows_nothing_of_it(folder, capsys, command):
    path = folder / "shadow.yaml"
    path.write_text(shadow())
    err = refused([*command, path], capsys)
    assert "is not a task file (line 1 is not `key: value`)" in err
    hidden(err)


def test_a_shadow_file_as_the_template_section_shows_nothing_of_it(folder, capsys):
    (folder / "section.yaml").write_text(shadow())
    (folder / "task.yaml").write_text(yaml.safe_dump(task_dict(template="section.yaml")))
    err = refused(["render", "--task", folder / "task.yaml"], capsys)
    assert "is not a template file (line 1 is not `key: value`)" in err
    hidden(err)


@pytest.mark.parametrize("where", ["task", "section", "record"])
def test_name_value_lines_are_counted_and_only_the_first_name_shown(folder, capsys, where):
    (folder / "other.yaml").write_text(shadow(colon_joined=False))
    task = task_dict(template="other.yaml") if where == "section" else task_dict()
    (folder / "task.yaml").write_text(yaml.safe_dump(task) + (shadow(colon_joined=False) if where == "task" else ""))
    argv = ["render", "--task", folder / "task.yaml"] + (["--template", folder / "other.yaml"] if where == "record" else [])
    err = refused(argv, capsys)
    assert "3 unknown" in err and "(the first: alice)" in err
    hidden(err, allowed=("alice",))


@pytest.mark.parametrize("value", ["!!binary aGVsbG8=", "!!set {a, b}", "!!timestamp 2001-12-14",
                                   "!!python/object/apply:os.system ['echo pwned']", "!!python/name:os.system",
                                   "!custom value", "!!omap [{a: 1}]"])
@pytest.mark.parametrize("where", ["description", "template.seed_instruction", "judge.rubrics"])
def test_yaml_tags_are_refused(folder, capsys, value, where):
    text = yaml.safe_dump(task_dict(**{where: "TAGGED"})).replace("TAGGED", value)
    (folder / "task.yaml").write_text(text)
    err = refused(["render", "--task", folder / "task.yaml"], capsys)
    assert "YAML tags" in err and "line " in err and "pwned" not in err


def test_plain_tags_still_load(folder, capsys):
    text = yaml.safe_dump(task_dict(description="TAGGED")).replace("TAGGED", "!!str 12")
    (folder / "task.yaml").write_text(text)
    assert main(["render", "--task", str(folder / "task.yaml"), "-n", "1"]) == 0


def deep_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_deep_contract_schema_in_a_task_file_is_refused(folder, capsys):
    task = yaml.safe_load(open("tests/data/transactions_json.yaml"))
    task["output"]["contract"]["schema"] = deep_schema(300)
    (folder / "task.yaml").write_text(json.dumps(task))  # JSON is YAML: a flow mapping 600 levels deep
    err = refused(["render", "--task", folder / "task.yaml"], capsys)
    assert "nested too deep" in err


@pytest.mark.parametrize("schema, words", [
    (deep_schema(300), f"nested deeper than {MAX_SCHEMA_DEPTH} levels"),
    (deep_schema(MAX_SCHEMA_DEPTH + 1), f"nested deeper than {MAX_SCHEMA_DEPTH} levels"),
    ({"type": "object", "description": "x" * 70_000}, "over the limit of 65,536"),
])
def test_a_contract_schema_too_deep_or_too_large_is_refused_short(schema, words):
    with pytest.raises(ContractError) as refused:
        OutputContract("json", schema=schema)
    assert words in str(refused.value) and len(str(refused.value)) < 300


def test_a_schema_as_deep_as_the_limit_is_accepted():
    OutputContract("json", schema=deep_schema(MAX_SCHEMA_DEPTH))


def test_a_bad_schema_value_is_shown_short():
    with pytest.raises(ContractError) as refused:
        OutputContract("json", schema={"minLength": "SECRET" * 1000})
    assert len(str(refused.value)) < 200


@pytest.mark.parametrize("verbalizer", [" ", "\t\n", "   "])
def test_a_whitespace_verbalizer_is_refused(folder, capsys, verbalizer):
    (folder / "task.yaml").write_text(yaml.safe_dump(task_dict(**{"labels.high.verbalizer": verbalizer})))
    err = refused(["render", "--task", folder / "task.yaml"], capsys)
    assert "labels.high.verbalizer" in err and "whitespace" in err
