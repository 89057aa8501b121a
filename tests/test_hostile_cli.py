"""Hostile and broken input through `tune-prompts` in-process (issue #16): every command exits 0 or 2, exit 2
comes with one line on stderr, no traceback, nothing unprintable on the terminal, and a refused store write
leaves the store file as it was.

The plain tests pin one fixed bug each; the property tests (hypothesis) feed random and adversarial template
text, template files, task files, data files and store arguments through ``main(argv)``.
"""

import io
import json
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines import cli_tasks
from pipelines.cli import main
from pipelines.cli_output import table
from templates.gate import Decision
from templates.store import TemplateStore
from templates.template import Template

# Per example: a bound on one command (a hang fails the test), few enough examples for < 60 s in all on a busy
# 2-core machine, and no example database written into the checkout.
PROPERTY = settings(max_examples=60, deadline=5000, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TASK = {
    "name": "cases",
    "description": "Is an inbound case risky?",
    "data": {"source": "cases.jsonl", "format": "jsonl"},
    "labels": {"high": {"values": ["fraud"], "verbalizer": "yes"}, "low": {"values": ["ok"], "verbalizer": "no"}},
    "positive_label": "high",
    "split": {"seed": 3, "train": 10, "dev": 10, "test": 10},
    "template": {"skeleton": "{instruction}\nCase: {text}\nIs this case risky? Answer yes or no.",
                 "seed_instruction": "You screen cases for a bank.", "constraints": {"text": {"max_chars": 500}}},
    "judge": {"rubrics": {"coherence": "Is the answer a clear yes or no?"}},
    "reward": {"weights": {"task_metric": 1.0, "instruction_following": 0.5}},
}


def run(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr encoding strictly to UTF-8 bytes, as a terminal does."""
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: a usage error (2) or --help (0)
            code = exc.code
        out.flush()
        err.flush()
    return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


# Found by these properties in code other branches of issue #16 are fixing (the task and data files, the store):
# they end in main()'s catch-all line, which keeps the contract but names no fix. Drop each once its fix is merged.
OWNED_ELSEWHERE: tuple[str, ...] = ()  # catch-all messages of other parts still to be fixed (none now)


def check(code: int, out: str, err: str) -> None:
    """The contract of every command on any input."""
    assert code in (0, 2), (code, err)
    # Python's own header, not the bare word: generated input may name a key "Traceback", and the error names it.
    assert "Traceback (most recent call last)" not in out + err
    if code == 2:
        assert len(err.splitlines()) == 1 and err.endswith("\n"), err
        assert len(err) <= 700, "an error line echoes more than a short excerpt"
        assert not any(ch in err[:-1] for ch in "\x1b\r\n\x00"), err
        # main()'s catch-all keeps the contract, but its line names no fix: input reaching it is an unchecked case.
        assert "rerun with --debug" not in err or any(known in err for known in OWNED_ELSEWHERE), err


def write_task(folder: Path, rows=None, **changes) -> Path:
    rows = rows if rows is not None else [("fraud" if i % 2 else "ok", f"case number {i}") for i in range(40)]
    (folder / "cases.jsonl").write_text("".join(json.dumps({"label": l, "text": t}) + "\n" for l, t in rows))
    task = folder / "task.yaml"
    task.write_text(yaml.safe_dump({**TASK, **changes}))
    return task


@pytest.fixture
def folder():
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


# --- one test per fixed bug ---------------------------------------------------------------------------------------
def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch):
    def boom(name):
        raise RuntimeError("boom\nsecond line \x1b[31m")

    monkeypatch.setattr(cli_tasks, "load_task", boom)
    code, _, err = run("render", "--task", "risk")
    assert code == 2 and err == "error: RuntimeError: boom; rerun with --debug for the traceback\n"

    code, _, err = run("--debug", "render", "--task", "risk")
    assert code == 2 and "Traceback" in err and "RuntimeError: boom" in err
    monkeypatch.setenv("TUNE_PROMPTS_DEBUG", "1")
    assert "Traceback" in run("render", "--task", "risk")[2]


def test_interrupt_is_exit_2_in_one_line(monkeypatch):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_tasks, "load_task", interrupted)
    assert run("render", "--task", "risk") == (2, "", "error: interrupted\n")


def test_argparse_usage_errors_are_one_line_and_help_still_works():
    code, out, err = run("render")
    check(code, out, err)
    assert "--task" in err and "--help" in err
    code, out, _ = run("render", "--help")
    assert code == 0 and "usage:" in out
    code, out, err = run()  # no command: the help, and one line saying what to give
    assert code == 2 and "usage:" in out and err.splitlines() == ["error: give a COMMAND, or --task TASK to tune"]


@pytest.mark.parametrize("n", ["-1", "0", "1001", "x"])
def test_render_n_must_be_1_to_1000(n):
    code, out, err = run("render", "--task", "risk", "-n", n)
    check(code, out, err)
    assert code == 2 and "argument -n" in err


def test_text_template_file_with_a_bad_brace_is_one_line(folder):
    (folder / "t.txt").write_text("Say {text.__class__}\n")
    code, out, err = run("render", "--task", "risk", "--template", str(folder / "t.txt"))
    check(code, out, err)
    assert code == 2 and "unsupported brace" in err


def test_template_file_that_is_not_utf8_is_one_line(folder):
    (folder / "t.txt").write_bytes(b"Say \xff\xfe {text}")
    code, out, err = run("render", "--task", "risk", "--template", str(folder / "t.txt"))
    check(code, out, err)
    assert code == 2 and "not UTF-8" in err


def test_render_prints_terminal_escapes_escaped_and_refuses_lone_surrogates(folder):
    rows = [("fraud" if i % 2 else "ok", f"case \x1b[2J {i}") for i in range(40)]
    code, out, err = run("render", "--task", str(write_task(folder, rows)), "-n", "2")
    check(code, out, err)
    assert code == 0 and "\\x1b[2J" in out and "\x1b" not in out
    # An unpaired surrogate is not Unicode text: the data is refused by line (pipelines/data.py reads strictly)
    rows = [("fraud" if i % 2 else "ok", f"case \ud800 {i}") for i in range(40)]
    code, out, err = run("render", "--task", str(write_task(folder, rows)), "-n", "2")
    check(code, out, err)
    assert code == 2 and "line 1" in err


def test_a_yaml_template_record_keeps_the_tasks_constraints(folder):
    (folder / "t.yaml").write_text(yaml.safe_dump({"text": "Q: {text}"}))
    code, out, _ = run("render", "--task", "risk", "--template", str(folder / "t.yaml"), "--json", "-n", "1")
    assert code == 0
    assert {"variable": "text", "op": "max_chars", "arg": 2000} in json.loads(out)["template"]["constraints"]

    rows = [("fraud" if i % 2 else "ok", "x" * 600 + str(i)) for i in range(40)]  # the task allows 500 characters
    code, out, err = run("render", "--task", str(write_task(folder, rows)), "--template", str(folder / "t.yaml"))
    check(code, out, err)
    assert code == 2 and "more than 500" in err


def test_table_cells_cannot_forge_rows_or_colours():
    text = table([{"name": "ok\n--- forged row", "value": "\x1b[31mred\x1b[0m"}])
    assert len(text.splitlines()) == 3
    assert "\x1b" not in text and "\\x1b[31mred" in text and "ok\\n--- forged row" in text


# --- properties -------------------------------------------------------------------------------------------------
PIECES = ["{text}", "{", "}", "{{", "}}", "{text.__class__}", "{0}", "{text:{width}}", "{% if x %}", "{instruction}",
          "{ text }", "\x1b[31m", "\n", "\r", "\x00", "\ud800", "\u202e", "é", "%s", "\\", "'", '"', "text"]
template_text = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(PIECES) | st.text(max_size=5), max_size=30).map("".join))
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                          max_leaves=12)
PATTERNS = ["(a+)+$", "(a)\\1", "(?=x)", "[", "a{1001}", ".*", "\\d+", "(?P<x>a)", "[[:alpha:]]", "\ud800"]
constraint_spec = st.dictionaries(
    st.sampled_from(["text", "other"]) | st.text(max_size=5),
    st.dictionaries(st.sampled_from(["in", "regex", "max_chars"]) | st.text(max_size=5),
                    st.sampled_from(PATTERNS) | json_value, max_size=3),
    max_size=2)


class NoAliasDumper(yaml.SafeDumper):
    """YAML without anchors or aliases (alias bombs are the task-file checks' business, not this generator's)."""

    def ignore_aliases(self, data):
        return True


def safe_dump(data) -> str:
    return yaml.dump(data, Dumper=NoAliasDumper, allow_unicode=True)


@PROPERTY
@given(text=template_text)
def test_any_text_template_file(folder, text):
    path = folder / "t.txt"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check(*run("render", "--task", "risk", "--template", str(path), "-n", "2"))


@PROPERTY
@given(content=st.binary(max_size=300), suffix=st.sampled_from([".txt", ".yaml"]))
def test_any_template_file_bytes(folder, content, suffix):
    path = folder / f"t{suffix}"
    path.write_bytes(content)
    check(*run("render", "--task", "risk", "--template", str(path), "-n", "2"))


@PROPERTY
@given(record=st.fixed_dictionaries({"text": template_text},
                                    optional={"variables": st.lists(st.text(max_size=8), max_size=3) | json_value,
                                              "constraints": constraint_spec | json_value, "decision": json_value}))
def test_any_yaml_template_record(folder, record):
    path = folder / "t.yaml"
    path.write_text(safe_dump(record), encoding="utf-8", errors="surrogatepass")
    check(*run("render", "--task", "risk", "--template", str(path), "-n", "2"))


def mutated_task(keys, value):
    """The valid task with one setting (at any depth) replaced by ``value``."""
    task = json.loads(json.dumps(TASK))
    node = task
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return task


TASK_PATHS = [("name",), ("description",), ("data",), ("data", "source"), ("data", "format"), ("labels",),
              ("labels", "high"), ("labels", "high", "values"), ("positive_label",), ("split",), ("split", "train"),
              ("split", "seed"), ("template",), ("template", "skeleton"), ("template", "seed_instruction"),
              ("template", "constraints"), ("template", "constraints", "text"), ("judge",), ("reward",),
              ("reward", "weights"), ("scoring",), ("surprise",)]


@PROPERTY
@given(content=st.one_of(
    st.binary(max_size=300).map(lambda b: ("bytes", b)),
    st.text(max_size=300).map(lambda t: ("text", t)),
    st.dictionaries(st.text(max_size=10), json_value, max_size=6).map(lambda d: ("mapping", d)),
    st.tuples(st.sampled_from(TASK_PATHS), json_value | template_text | constraint_spec).map(
        lambda pv: ("mapping", mutated_task(*pv)))))
def test_any_task_file(folder, content):
    write_task(folder)  # the data file a mutated task points at
    kind, value = content
    path = folder / "task.yaml"
    if kind == "bytes":
        path.write_bytes(value)
    elif kind == "text":
        path.write_text(value, encoding="utf-8", errors="surrogatepass")
    else:
        path.write_text(safe_dump(value), encoding="utf-8", errors="surrogatepass")
    check(*run("render", "--task", str(path), "-n", "2"))


row_text = st.text(max_size=60) | st.lists(st.sampled_from(PIECES), max_size=8).map("".join)


@PROPERTY
@given(data=st.one_of(
    st.binary(max_size=400).map(lambda b: ("raw", b)),
    st.lists(json_value, max_size=20).map(lambda vs: ("jsonl", vs)),
    st.lists(row_text, min_size=1, max_size=6).map(lambda ts: ("rows", ts))),
    fmt=st.sampled_from(["csv", "jsonl"]))
def test_any_data_file(folder, data, fmt):
    kind, value = data
    source = folder / f"cases.{fmt}"
    if kind == "raw":
        content = value
    elif kind == "jsonl":
        content = "".join(json.dumps(v) + "\n" for v in value).encode()
    else:  # 40 rows of hostile texts, enough to split, so render prints them
        rows = [("fraud" if i % 2 else "ok", f"{value[i % len(value)]} {i}") for i in range(40)]
        if fmt == "jsonl":
            content = "".join(json.dumps({"label": l, "text": t}) + "\n" for l, t in rows).encode()
        else:
            content = ("label,text\n" + "".join(f'{l},"{t.replace(chr(34), chr(34) * 2)}"\n' for l, t in rows)).encode(
                "utf-8", "surrogatepass")
    task = write_task(folder, data={"source": source.name, "format": fmt})
    source.write_bytes(content)
    check(*run("render", "--task", str(task), "-n", "2"))


PASSED = Decision(True, ("pass",))
REFUSED_REASON = "fail"  # with a terminal escape it shows in stderr: test_store_output_escapes_stored_text


@pytest.fixture
def store_file():
    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / "store.sqlite"
        with TemplateStore(f"sqlite:///{path}") as store:
            v1 = store.add_version("risk", Template.from_text("Classify {text}"), decision=PASSED)
            store.add_version("risk", Template.from_text("Classify \x1b[31m{text}\n--- forged"), parent_id=v1.id,
                              decision=Decision(False, (REFUSED_REASON,)))
            store.promote("risk", v1.id)
        yield path


ref = st.sampled_from(["1", "2", "3", "risk@production", "risk@nope", "-1", "0", "99999999999999999999", "@", "risk@", ""]
                     ) | st.text(max_size=12)
task_name = st.sampled_from(["risk", "nope", "", "-", "--json"]) | st.text(max_size=12)
label = st.sampled_from(["production", "staging", "canary", ""]) | st.text(max_size=12)
# Each command with its own arity most of the time (so the store is reached), any words some of the time.
store_argv = st.one_of(
    st.tuples(st.just("list")) | st.tuples(st.just("list"), task_name),
    st.tuples(st.just("show"), ref),
    st.tuples(st.just("diff"), ref, ref),
    st.tuples(st.just("promote"), task_name, ref) | st.tuples(st.just("promote"), task_name, ref, st.just("--force")),
    st.tuples(st.just("rollback"), task_name),
    st.tuples(st.just("label"), task_name, label, ref),
    st.tuples(st.just("route"), task_name, st.sampled_from([(), ("--advance",), ("--end",), ("--key", "k")]))
    .map(lambda t: (t[0], t[1], *t[2])),
    st.tuples(st.just("route"), task_name, st.just("--canary"), ref, st.sampled_from(["--share", "--ramp"]),
              st.sampled_from(["0.5", "2", "-1", "nan", "inf", "0.05,0.2,1", "1,0.5", ""]) | st.text(max_size=8)),
    st.tuples(st.sampled_from(["list", "show", "diff", "promote", "rollback", "label", "route"]),
              st.lists(ref | task_name, max_size=4)).map(lambda t: (t[0], *t[1])),
)
WRITES = {"promote", "rollback", "label", "route"}


@PROPERTY
@given(argv=store_argv, as_json=st.booleans())
def test_any_store_arguments(store_file, argv, as_json):
    before = store_file.read_bytes()
    code, out, err = run("store", *argv, *(["--json"] if as_json else []), "--store", f"sqlite:///{store_file}")
    check(code, out, err)
    if code == 2 and argv[0] in WRITES:
        assert store_file.read_bytes() == before, "a refused store write changed the store file"


def test_store_output_escapes_stored_text(store_file):
    for argv in (("show", "2"), ("diff", "1", "2"), ("list", "risk")):
        code, out, err = run("store", *argv, "--store", f"sqlite:///{store_file}")
        assert code == 0 and "\x1b" not in out, (argv, out)
    with TemplateStore(f"sqlite:///{store_file}") as store:
        store.add_version("risk", Template.from_text("Guess {text}"), decision=Decision(False, ("fail\x1b[2J",)))
    check(*run("store", "promote", "risk", "3", "--store", f"sqlite:///{store_file}"))  # the gate's reason, escaped
