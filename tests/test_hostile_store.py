"""`tune-prompts store ...` given hostile or broken input (issue #16): every command exits 0 or 2, an exit 2
prints one line naming the problem and the fix, no traceback, and a refused write leaves the store's bytes
as they were. On SQLite and PostgreSQL (the ``backend`` fixture in conftest.py) where the input reaches both."""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipelines import cli_store
from templates.gate import Decision
from templates.store import StoreError, TemplateStore
from templates.template import Template

PASSED = Decision(True, ("pass: instruction_following 0.9 >= 0.82",))


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tune-prompts")
    cli_store.register(parser.add_subparsers(dest="command"))
    return cli_store.run(parser.parse_args(list(argv)))


def refused(capsys, *argv: str) -> str:
    """Run a command that must fail; its one line of stderr."""
    assert cli(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured
    return captured.err


@pytest.fixture
def store_url(backend):
    """risk: v1 in production, v2 gated and passed."""
    with TemplateStore(backend.url) as store:
        v1 = store.add_version("risk", Template.from_text("Classify {text}"), decision=PASSED)
        store.add_version("risk", Template.from_text("Classify carefully {text}"), parent_id=v1.id, decision=PASSED)
        store.promote("risk", v1.id)
    return backend.url


BIG = "99999999999999999999999"


@pytest.mark.parametrize("argv", [
    ["show", BIG], ["show", "9223372036854775808"], ["diff", "1", BIG], ["promote", "risk", BIG],
    ["label", "risk", "staging", BIG], ["route", "risk", "--canary", BIG], ["show", "0"], ["show", "1" * 5000],
])
def test_version_ids_beyond_64_bits_are_refused(backend, store_url, capsys, argv):
    before = backend.snapshot()
    err = refused(capsys, "store", *argv, "--store", store_url)
    assert "is out of range: ids are whole numbers from 1 to 9223372036854775807" in err
    assert backend.snapshot() == before


def test_non_ascii_digits_are_not_version_ids(store_url, capsys):
    assert "is not a version" in refused(capsys, "store", "show", "²", "--store", store_url)


BAD_UTF8 = "\udcff"  # what Python makes of the byte 0xff in argv under a UTF-8 locale


@pytest.mark.parametrize("argv, what", [
    (["list", BAD_UTF8], "task name"), (["show", f"risk@{BAD_UTF8}"], "label"),
    (["show", f"{BAD_UTF8}@production"], "task name"), (["promote", BAD_UTF8, "1"], "task name"),
    (["rollback", BAD_UTF8], "task name"), (["label", BAD_UTF8, "staging", "1"], "task name"),
    (["route", BAD_UTF8], "task name"), (["route", "risk", "--key", f"user-{BAD_UTF8}"], "caller key"),
])
def test_undecodable_names_are_refused(backend, store_url, capsys, argv, what):
    before = backend.snapshot()
    err = refused(capsys, "store", *argv, "--store", store_url)
    assert f"{what} " in err and "is not valid UTF-8" in err and "retype it in UTF-8" in err
    assert backend.snapshot() == before


@pytest.mark.parametrize("task, message", [
    ("risk\x1b[31m", "has control characters"), ("a\nb", "has control characters"), ("nul\x00", "control characters"),
    ("x" * 201, "has 201 characters; use at most 200"), (BAD_UTF8, "is not valid UTF-8"), ("", "must be non-empty text; give one"),
])
def test_new_task_names_must_be_printable_text_of_sane_length(backend, task, message):
    with TemplateStore(backend.url) as store:
        with pytest.raises(StoreError, match=message):
            store.add_version(task, Template.from_text("x {text}"))
        with pytest.raises(StoreError, match="run id"):
            store.add_version("risk", Template.from_text("x {text}"), run_id=task or "\n")
        assert store.tasks() == []


def insert_raw(backend, sql: str) -> None:
    """A row written outside the store's code (the store's triggers refuse UPDATE, not INSERT)."""
    conn = backend.connect()
    try:
        conn.execute(sql)
    finally:
        conn.close()


DAMAGED_VERSIONS = {
    "template not JSON": "'{not json', '{}', '{}', NULL",
    "template not a record": "'[1, 2]', '{}', '{}', NULL",
    "scores not figures": """'{"text": "x {text}"}', '{"test": {"balanced_accuracy": "high"}}', '{}', NULL""",
    "decision not JSON": """'{"text": "x {text}"}', '{}', '{}', 'promote!'""",
}


@pytest.mark.parametrize("values", DAMAGED_VERSIONS.values(), ids=DAMAGED_VERSIONS)
def test_a_damaged_version_is_named_on_read_and_blocks_every_write(backend, store_url, capsys, values):
    insert_raw(backend, "INSERT INTO versions (task, content_hash, template, scores, latency, decision, created_at)"
                        f" VALUES ('risk', 'abc', {values}, '2026-01-01T00:00:00')")
    before = backend.snapshot()
    for argv in (["list", "risk"], ["show", "3"], ["diff", "1", "3"], ["promote", "risk", "3", "--force"]):
        err = refused(capsys, "store", *argv, "--store", store_url)
        assert "version 3 in the store at " in err and "is damaged (" in err and "restore it from a backup" in err
    for argv in (["promote", "risk", "2"], ["label", "risk", "staging", "1"], ["route", "risk", "--canary", "2"]):
        err = refused(capsys, "store", *argv, "--store", store_url)
        assert err.startswith("error: cannot change the store: version 3 in the store at ") and "is damaged" in err
    assert backend.snapshot() == before
    # Reads of the other versions still work.
    assert cli("store", "show", "2", "--store", store_url) == 0
    assert cli("store", "diff", "1", "2", "--store", store_url) == 0
    with TemplateStore(store_url) as store:
        assert store.get_template(1).text == "Classify {text}"
        with pytest.raises(StoreError, match="cannot change the store: version 3"):
            store.add_version("risk", Template.from_text("new {text}"))
    assert backend.snapshot() == before


def test_a_damaged_canary_row_is_named_on_read_and_blocks_every_write(backend, store_url, capsys):
    insert_raw(backend, "INSERT INTO label_history (task, label, version_id, action, share, ramp, moved_at)"
                        " VALUES ('risk', 'canary', 2, 'canary', 0.05, '[0.05, oops', '2026-01-01T00:00:00')")
    before = backend.snapshot()
    err = refused(capsys, "store", "route", "risk", "--store", store_url)
    assert "the canary of 'risk' in the store at " in err and "restore it from a backup" in err
    err = refused(capsys, "store", "rollback", "risk", "--store", store_url)
    assert err.startswith("error: cannot change the store: the canary of 'risk'")
    assert backend.snapshot() == before
    assert cli("store", "show", "risk@production", "--store", store_url) == 0


READ_COMMANDS = (["list"], ["list", "risk"], ["show", "risk@production"], ["diff", "1", "2"],
                 ["route", "risk", "--key", "user-17"])


def as_a_reader(folder, *argv: str) -> subprocess.CompletedProcess:
    """`tune-prompts store ARGV` in another process whose user may read ``folder`` but not write it:
    as root (who ignores permissions) the user nobody; otherwise this user, with the folder made read-only."""
    code = ("import argparse, sys; from pipelines import cli_store; p = argparse.ArgumentParser(); "
            "cli_store.register(p.add_subparsers(dest='command')); sys.exit(cli_store.run(p.parse_args()))")
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    return subprocess.run([*user, sys.executable, "-c", code, "store", *argv, "--store", str(folder / "store.sqlite")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(cli_store.__file__).parents[1])})


@pytest.fixture
def read_only_folder():
    """A folder holding a filled store that as_a_reader's user cannot write."""
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: no user to whom a folder is read-only")
    folder = Path(tempfile.mkdtemp(prefix="tune-prompts-ro-"))
    with TemplateStore(f"sqlite:///{folder / 'store.sqlite'}") as store:
        v1 = store.add_version("risk", Template.from_text("Classify {text}"), decision=PASSED)
        store.add_version("risk", Template.from_text("Classify carefully {text}"), parent_id=v1.id, decision=PASSED)
        store.promote("risk", v1.id)
    folder.chmod(0o755 if os.geteuid() == 0 else 0o555)  # root's folder is read-only to nobody
    yield folder
    folder.chmod(0o755)
    shutil.rmtree(folder)


def test_reads_work_from_a_read_only_folder_and_create_nothing(read_only_folder):
    before = {p.name: p.read_bytes() for p in read_only_folder.iterdir()}
    assert list(before) == ["store.sqlite"]  # no -wal or -shm: nobody has the store open
    for argv in READ_COMMANDS:
        done = as_a_reader(read_only_folder, *argv)
        assert (done.returncode, done.stderr) == (0, ""), argv
    assert "production=1" in as_a_reader(read_only_folder, "list").stdout
    done = as_a_reader(read_only_folder, "promote", "risk", "2")
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: the store at ") and "is read-only here" in done.stderr
    assert {p.name: p.read_bytes() for p in read_only_folder.iterdir()} == before


def test_a_store_open_elsewhere_is_read_through_its_wal_from_a_read_only_folder(read_only_folder):
    with TemplateStore(f"sqlite:///{read_only_folder / 'store.sqlite'}", create=False) as writer:
        if os.geteuid() != 0:
            pytest.skip("the writer would need the folder it has just made read-only")
        writer.promote("risk", 2)  # in the -wal file until the writer closes
        assert (read_only_folder / "store.sqlite-wal").exists()
        done = as_a_reader(read_only_folder, "list")
        assert done.returncode == 0 and "production=2" in done.stdout, done.stderr


FORGED = "evil\n1   forged  -  run  promote  production"


def test_control_characters_in_stored_names_are_escaped_in_every_table_and_message(backend, store_url, capsys):
    # Names the store refuses now, written as an older version or another program might have.
    insert_raw(backend, "INSERT INTO versions (task, content_hash, template, run_id, scores, latency, created_at)"
                        f" VALUES ('{FORGED}', 'abc', '{{\"text\": \"x {{text}}\"}}', 'run\x1b[2J', '{{}}', '{{}}',"
                        " '2026-01-01T00:00:00')")
    insert_raw(backend, "INSERT INTO label_history (task, label, version_id, action, moved_at)"
                        " VALUES ('risk', 'red\x1b[31m', 1, 'set', '2026-01-01T00:00:00')")
    outputs = []
    for argv in (["list"], ["list", "risk"], ["show", "3"], ["show", "1"], ["diff", "1", "3"],
                 ["route", "risk", "--key", "user\x1b[31m"], ["label", "risk", "staging", "3"]):
        code = cli("store", *argv, "--store", store_url)
        captured = capsys.readouterr()
        outputs.append(captured.out + captured.err)
        assert code in (0, 2) and "\x1b" not in outputs[-1], argv
        assert not any(line.startswith("1   forged") for line in outputs[-1].splitlines()), argv
    assert outputs[0].count("\n") == 3  # header, evil..., risk: no forged row
    assert "evil\\n1   forged" in outputs[0] and "red\\x1b[31m=1" in outputs[0]
    assert "run\\x1b[2J" in outputs[2] and "user\\x1b[31m -> production" in outputs[5]
    assert "belongs to task 'evil\\n1   forged" in outputs[6]


def test_promote_reports_the_production_its_own_move_replaced(backend, store_url, capsys, monkeypatch):
    with TemplateStore(store_url) as store:
        store.add_version("risk", Template.from_text("Classify briefly {text}"), decision=PASSED)
        store.set_canary("risk", 2)
    promote = TemplateStore.promote

    def promote_after_another_process(self, task, version_id, **kwargs):
        with TemplateStore(store_url) as other:  # between the command's start and its move
            promote(other, "risk", 2)
            other.set_canary("risk", 1)
        return promote(self, task, version_id, **kwargs)

    monkeypatch.setattr(TemplateStore, "promote", promote_after_another_process)
    assert cli("store", "promote", "risk", "3", "--store", store_url) == 0
    assert capsys.readouterr().out == "risk: production 2 -> 3; canary 1 ended\n"
