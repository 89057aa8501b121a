"""The versioned store on real SQLite files and a real PostgreSQL server (the ``backend`` fixture in
conftest.py), with real processes for concurrency and crashes.

The module is long because every test here runs on both back ends through one fixture, and the store's
guarantees (append-only versions, labels, A/B shares, rollback, concurrent writers, a crash mid-write) are
checked against the same public API; the on-disk format has its own file (test_store_fixture.py)."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from templates.gate import Decision
from templates.routing import Canary
from templates.store import StoreError, TemplateStore, default_store_url
from templates.template import Constraint, Template

REPO = Path(__file__).resolve().parents[1]
PASSED = Decision(True, ("pass: every check",))
REFUSED = Decision(False, ("pass: template_tokens 10 <= 400", "fail: error_rate 0.5 > 0.02"))


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def add(store: TemplateStore, text: str, task: str = "risk", **kwargs) -> int:
    kwargs.setdefault("decision", PASSED)
    return store.add_version(task, Template.from_text(text + " {text}"), **kwargs).id


def python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def store(backend):
    with TemplateStore(backend.url) as s:
        yield s


# --- versions ---


def test_a_version_round_trips_with_everything_it_carries(store):
    template = Template("Label {text} as {choice}", ("text", "choice"), (Constraint("choice", "in", ["a", "b"]),))
    parent = add(store, "seed")
    v = store.add_version(
        "risk", template, parent_id=parent, run_id="run-7",
        scores={"dev": {"instruction_following": 0.9}, "test": {"balanced_accuracy": 0.8}},
        latency={"template_tokens": 12, "latency_p95_ms": 130.5, "render_us_p99": 4.2, "error_rate": 0.0},
        decision=REFUSED,
    )
    again = store.get_version(v.id)
    assert again == v
    assert again.template == template and again.template.render(text="x", choice="a") == "Label x as a"
    assert again.parent_id == parent and again.run_id == "run-7"
    assert again.scores == {"dev": {"instruction_following": 0.9}, "test": {"balanced_accuracy": 0.8}}
    assert again.latency["latency_p95_ms"] == 130.5
    assert again.decision == REFUSED
    assert len(again.content_hash) == 12
    assert again.to_dict()["template"] == template.to_dict()


def test_ids_rise_and_the_content_hash_depends_only_on_the_template(store):
    a = store.add_version("risk", Template.from_text("A {text}"), run_id="x")
    b = store.add_version("risk", Template.from_text("B {text}"))
    c = store.add_version("risk", Template.from_text("A {text}"), run_id="y")
    assert a.id < b.id < c.id
    assert a.content_hash == c.content_hash != b.content_hash


def test_list_versions_is_per_task_oldest_first(store):
    ids = [add(store, "r1"), add(store, "s1", task="summarize"), add(store, "r2")]
    assert [v.id for v in store.list_versions("risk")] == [ids[0], ids[2]]
    assert store.list_versions("nope") == []
    assert store.tasks() == ["risk", "summarize"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scores": {"train": {"a": 1.0}}}, "unknown split"),
        ({"scores": {"dev": {"a": float("nan")}}}, "not a finite number"),
        ({"latency": {"latency_p95_ms": float("inf")}}, "not a finite number"),
        ({"latency": {"latency_p95_ms": "fast"}}, "not a finite number"),
        ({"parent_id": 999}, "parent version 999 does not exist"),
    ],
)
def test_bad_version_records_are_refused_and_nothing_is_written(store, kwargs, message):
    with pytest.raises(StoreError, match=message):
        store.add_version("risk", Template.from_text("x {text}"), **kwargs)
    assert store.list_versions("risk") == []


def test_get_template_returns_just_the_compiled_template(store):
    v = store.add_version("risk", Template.from_text("Just {text}"), scores={"dev": {"a": 0.5}})
    assert store.get_template(v.id) == v.template


def test_unknown_version_is_a_clear_error(store):
    with pytest.raises(StoreError, match="no version 42"):
        store.get_version(42)
    with pytest.raises(StoreError, match="no version 42"):
        store.get_template(42)


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE versions SET template = '{}'",
        "DELETE FROM versions",
        "UPDATE label_history SET version_id = 1",
        "DELETE FROM label_history",
    ],
)
def test_versions_and_label_history_cannot_be_changed_even_with_raw_sql(backend, sql):
    with TemplateStore(backend.url) as s:
        s.promote("risk", add(s, "v1"))
    raw = backend.connect()
    with pytest.raises(backend.integrity_error, match="append-only"):
        raw.execute(sql)
    raw.close()


@pytest.mark.parametrize("table", ["versions", "label_history"])
def test_postgresql_refuses_truncate_too(postgres, table):
    with TemplateStore(postgres.url) as s:
        s.promote("risk", add(s, "v1"))
    raw = postgres.connect()
    with pytest.raises(postgres.integrity_error, match="append-only"):
        raw.execute(f"TRUNCATE {table} CASCADE")
    raw.close()
    with TemplateStore(postgres.url) as s:
        assert s.labels("risk") == {"production": 1}


# --- labels, promotion, rollback ---


def test_promote_moves_production_and_counts_a_change(store):
    v1, v2 = add(store, "v1"), add(store, "v2")
    assert store.get_label("risk", "production") is None
    assert store.generation() == 0
    store.promote("risk", v1)
    assert store.get_label("risk", "production").id == v1
    assert store.generation() == 1
    store.promote("risk", v2)
    assert store.labels("risk") == {"production": v2}
    assert store.generation() == 2


def test_adding_a_version_moves_no_label(store):
    store.promote("risk", add(store, "v1"))
    before = store.generation()
    add(store, "v2")
    assert store.generation() == before


def test_label_moves_lists_the_moves_after_a_seq_oldest_first_with_their_template_records(store):
    v1, v2 = add(store, "v1"), add(store, "v2")
    start = store.generation()
    assert store.label_moves(start) == []
    store.promote("risk", v1)
    store.set_canary("risk", v2, 0.05)
    store.set_label("risk", "staging", v2)
    store.promote("risk", v2)  # ends the canary in the same transaction
    store.rollback("risk")
    moves = store.label_moves(start)
    assert [move[1:4] for move in moves] == [("risk", "production", v1), ("risk", "canary", v2),
                                             ("risk", "staging", v2), ("risk", "production", v2),
                                             ("risk", "canary", None), ("risk", "production", v1)]
    seqs = [move[0] for move in moves]
    assert seqs == sorted(set(seqs)) and seqs[-1] == store.generation()
    assert store.label_moves(seqs[2]) == moves[3:] and store.label_moves(seqs[-1]) == []
    for _, _, _, version_id, record in moves:  # the record of the version moved to: what a reader compiles
        if version_id is None:
            assert record is None
        else:
            assert store.decode_template(version_id, record) == store.get_template(version_id)
    with pytest.raises(StoreError, match="version 7 in the store at .* is damaged .*restore it from a backup"):
        store.decode_template(7, "{not json")


def test_promote_refuses_what_the_gate_refused_unless_forced(store):
    refused = add(store, "bad", decision=REFUSED)
    never_gated = add(store, "seed", decision=None)
    with pytest.raises(StoreError, match=r"refused by the gate: fail: error_rate 0.5 > 0.02; pass force=True"):
        store.promote("risk", refused)
    with pytest.raises(StoreError, match="never gated"):
        store.promote("risk", never_gated)
    assert store.labels("risk") == {}
    store.promote("risk", never_gated, force=True)
    assert store.get_label("risk", "production").id == never_gated


def test_promote_checks_the_task_and_the_current_label(store):
    other = add(store, "s", task="summarize")
    v1 = add(store, "v1")
    with pytest.raises(StoreError, match="belongs to task 'summarize'"):
        store.promote("risk", other)
    store.promote("risk", v1)
    with pytest.raises(StoreError, match="already production"):
        store.promote("risk", v1)
    assert store.generation() == 1


def test_rollback_undoes_promotions_newest_first(store):
    v1, v2, v3, v4 = (add(store, f"v{i}") for i in range(1, 5))
    for v in (v1, v2, v3):
        store.promote("risk", v)
    assert store.rollback("risk").id == v2
    assert store.rollback("risk").id == v1
    with pytest.raises(StoreError, match="production holds version 1 and no earlier version"):
        store.rollback("risk")
    store.promote("risk", v4)
    assert store.rollback("risk").id == v1
    assert store.get_label("risk", "production").id == v1


def test_rollback_with_nothing_promoted_is_a_clear_error(store):
    add(store, "v1")
    with pytest.raises(StoreError, match="production holds nothing"):
        store.rollback("risk")


def test_other_labels_move_with_set_label(store):
    v1, v2 = add(store, "v1"), add(store, "v2")
    store.set_label("risk", "staging", v1)
    store.set_label("risk", "staging", v2)
    store.set_label("risk", "shadow-2", v1)
    assert store.labels("risk") == {"shadow-2": v1, "staging": v2}
    assert store.get_label("risk", "staging").id == v2
    assert store.label_target("risk", "staging") == v2
    assert store.get_label("risk", "nope") is None and store.label_target("risk", "nope") is None
    assert store.labels("summarize") == {}


@pytest.mark.parametrize(
    "label, message",
    [("Prod", r"must match \[a-z\]"), ("1st", "must match"), ("", "must match"),
     ("production", "use promote"), ("canary", "use set_canary")],
)
def test_set_label_refuses_bad_and_reserved_names(store, label, message):
    v1 = add(store, "v1")
    with pytest.raises(StoreError, match=message):
        store.set_label("risk", label, v1)
    assert store.labels("risk") == {}


# --- canary ---


def test_canary_ramp_and_promotion_ends_it(store):
    v1, v2 = add(store, "v1"), add(store, "v2")
    store.promote("risk", v1)
    assert store.canary("risk") is None
    assert store.set_canary("risk", v2) == Canary(v2, 0.05)
    assert store.canary("risk") == Canary(v2, 0.05)
    assert store.advance_canary("risk").share == 0.20
    assert store.advance_canary("risk").share == 1.0
    with pytest.raises(StoreError, match=f"ramp is complete at 100%; promote version {v2}"):
        store.advance_canary("risk")
    gen = store.generation()
    store.promote("risk", v2)
    assert store.generation() == gen + 2  # the production move and the canary's end, in one transaction
    assert store.canary("risk") is None
    assert store.labels("risk") == {"production": v2}
    with pytest.raises(StoreError, match="no canary to advance"):
        store.advance_canary("risk")


def test_canary_with_own_share_and_ramp_and_ending_it(store):
    v1, v2 = add(store, "v1"), add(store, "v2")
    store.promote("risk", v1)
    store.set_canary("risk", v2, 0.01, (0.01, 0.1, 0.5))
    assert store.advance_canary("risk") == Canary(v2, 0.1, (0.01, 0.1, 0.5))
    store.end_canary("risk")
    assert store.canary("risk") is None and store.labels("risk") == {"production": v1}
    with pytest.raises(StoreError, match="no canary to end"):
        store.end_canary("risk")


@pytest.mark.parametrize(
    "share, ramp, message",
    [(1.5, (0.05, 1.0), "between 0 and 1"), (None, (), "at least one step"), (0.1, (0.5, 0.2), "increasing")],
)
def test_bad_canary_settings_are_refused(store, share, ramp, message):
    store.promote("risk", add(store, "v1"))
    v2 = add(store, "v2")
    with pytest.raises(StoreError, match=message):
        store.set_canary("risk", v2, share, ramp)
    assert store.canary("risk") is None


def test_canary_on_the_production_version_is_refused(store):
    v1 = add(store, "v1")
    store.promote("risk", v1)
    with pytest.raises(StoreError, match="already production"):
        store.set_canary("risk", v1)


def test_diff_shows_text_and_figure_deltas(store):
    a = store.add_version("risk", Template.from_text("Classify {text}\nBe brief."),
                          scores={"test": {"balanced_accuracy": 0.70, "only_a": 1.0}}, latency={"latency_p95_ms": 100})
    b = store.add_version("risk", Template.from_text("Classify {text}\nBe exact."),
                          scores={"test": {"balanced_accuracy": 0.75}}, latency={"latency_p95_ms": 90})
    d = store.diff(a.id, b.id)
    assert "-Be brief.\n+Be exact." in d["text_diff"]
    assert d["score_deltas"]["test"]["balanced_accuracy"] == pytest.approx(0.05)
    assert d["score_deltas"]["test"]["only_a"] is None
    assert d["latency_deltas"] == {"latency_p95_ms": -10}


# --- opening: URLs, missing, locked and foreign files ---


def test_default_store_url_follows_tune_prompts_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNE_PROMPTS_HOME", str(tmp_path / "home"))
    assert default_store_url() == f"sqlite:///{tmp_path}/home/store.sqlite"
    with TemplateStore(default_store_url()) as s:  # creates the directory
        add(s, "v1")
    assert (tmp_path / "home" / "store.sqlite").exists()


def test_url_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with TemplateStore("sqlite:///relative.sqlite") as s:
        add(s, "v1")
    assert (tmp_path / "relative.sqlite").exists()
    with TemplateStore(str(tmp_path / "relative.sqlite"), create=False) as s:  # a plain path works too
        assert len(s.list_versions("risk")) == 1


@pytest.mark.parametrize(
    "url, message",
    [
        ("mysql://db/prompts", "use sqlite:///.* or postgresql://user:password@host:port/database"),
        ("sqlite://", "use sqlite:///"),
    ],
)
def test_unsupported_urls_are_clear_errors(url, message):
    with pytest.raises(StoreError, match=message):
        TemplateStore(url)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql://user@127.0.0.1:1/prompts", "postgresql://user@127.0.0.1:1/prompts"),
        ("postgres://user:s3cret@127.0.0.1:1/prompts", "postgres://user:***@127.0.0.1:1/prompts"),
        ("postgresql://127.0.0.1:1/prompts?user=u&password=s3cret", "postgresql://127.0.0.1:1/prompts?user=u&password=***"),
    ],
)
def test_an_unreachable_postgresql_server_is_a_clear_error_without_the_password(url, shown):
    with pytest.raises(StoreError) as exc:
        TemplateStore(url)
    assert str(exc.value) == (f"cannot connect to PostgreSQL for {shown}: connection refused; "
                              "start the server or fix the host and port in the URL")


def test_postgresql_without_the_driver_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # what a missing package looks like to import
    with pytest.raises(StoreError, match=r"PostgreSQL stores need the psycopg driver: pip install 'psycopg\[binary\]'"):
        TemplateStore("postgresql://user@127.0.0.1:1/prompts")


def test_postgresql_login_and_database_errors_are_clear(postgres):
    parts = urlsplit(postgres.admin_url)
    host = parts.netloc.rpartition("@")[2]
    no_role = parts._replace(netloc=f"no_such_role@{host}").geturl()
    with pytest.raises(StoreError, match=r'PostgreSQL refused the login for .*: role "no_such_role" does not exist; '
                                         "check the user and password in the URL"):
        TemplateStore(no_role)
    no_db = parts._replace(path="/no_such_database", query="").geturl()
    for create in (True, False):
        with pytest.raises(StoreError, match=r'database "no_such_database" does not exist; create the database first'):
            TemplateStore(no_db, create=create)


def test_create_false_refuses_a_missing_store_and_creates_nothing(backend):
    with pytest.raises(StoreError, match=f"no store at {re.escape(backend.location)}: check --store"):
        TemplateStore(backend.url, create=False)
    assert backend.snapshot() == {}


def test_an_sqlite_file_without_tables_becomes_a_store(tmp_path):
    # What a crash between creating the file and committing the schema leaves behind.
    path = tmp_path / "store.sqlite"
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA journal_mode = WAL")
    raw.close()
    with TemplateStore(url_of(path)) as s:
        assert add(s, "v1") == 1


@pytest.mark.parametrize("lock", ["write", "exclusive"])
def test_a_locked_store_gives_a_clear_error_and_changes_nothing(backend, lock):
    with TemplateStore(backend.url) as s:
        v1, v2 = add(s, "v1"), add(s, "v2")
        s.promote("risk", v1)
    holder = backend.connect()
    for statement in backend.locks[lock]:
        holder.execute(statement)
    try:
        with TemplateStore(backend.url, busy_timeout_s=0.1) as s:
            assert s.get_label("risk", "production").id == v1  # reads still work (WAL; PostgreSQL's MVCC)
            for write in (lambda: add(s, "v3"), lambda: s.promote("risk", v2), lambda: s.rollback("risk")):
                started = time.monotonic()
                with pytest.raises(StoreError, match=f"the store at {re.escape(backend.location)} is locked by "
                                                     r"another process; retry, or raise the busy timeout \(now 0.1 s\)"):
                    write()
                assert time.monotonic() - started < 2
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with TemplateStore(backend.url) as s:
        assert [v.id for v in s.list_versions("risk")] == [v1, v2]
        assert s.labels("risk") == {"production": v1}
        assert s.generation() == 1


def test_random_bytes_are_not_a_store_and_stay_untouched(tmp_path):
    path = tmp_path / "store.sqlite"
    path.write_bytes(os.urandom(8192))
    before = files_in(tmp_path)
    for create in (True, False):
        with pytest.raises(StoreError, match=r"is not a tune-prompts store \(file is not a database\): restore it"):
            TemplateStore(url_of(path), create=create)
    assert files_in(tmp_path) == before


@pytest.mark.parametrize("table, statements", [
    ("users", ["CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)", "INSERT INTO users (id, name) VALUES (1, 'ada')"]),
    ("meta", ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
              "INSERT INTO meta (key, value) VALUES ('app', 'someone-else')"]),  # our table's name, not our app
], ids=["another-apps-table", "another-apps-meta-table"])
def test_another_apps_data_is_not_a_store_and_stays_untouched(backend, table, statements):
    raw = backend.connect()
    for statement in statements:
        raw.execute(statement)
    raw.close()
    before = backend.snapshot()
    assert before  # the other app's table and row are there to be left alone
    for create in (True, False):
        with pytest.raises(StoreError, match=rf"not a tune-prompts store \(schema missing: it holds tables \['{table}'\]\)"):
            TemplateStore(backend.url, create=create)
    assert backend.snapshot() == before


# --- real processes ---

WRITER = """
import sys
from templates.gate import Decision
from templates.store import TemplateStore
from templates.template import Template
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = TemplateStore(url, busy_timeout_s=30)
for i in range(n):
    v = store.add_version("risk", Template.from_text(f"{name} {i}: {{text}}"), run_id=name,
                          decision=Decision(True, ("pass",)))
    store.promote("risk", v.id)
    print("promoted", v.id, flush=True)
    if i % 4 == 3:
        print("rolled back to", store.rollback("risk").id, flush=True)
"""


def test_concurrent_writers_lose_no_version_and_keep_labels_consistent(backend):
    # Four processes create the same new store at once, then add, promote and roll back interleaved.
    writers, per_writer = 4, 12
    procs = [python(WRITER, backend.url, f"w{w}", str(per_writer)) for w in range(writers)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * writers, [err for _, err in outputs]
    promoted = [int(line.split()[1]) for out, _ in outputs for line in out.splitlines() if line.startswith("promoted")]

    with TemplateStore(backend.url) as s:
        versions = s.list_versions("risk")
        assert sorted(promoted) == [v.id for v in versions] == list(range(1, writers * per_writer + 1))
        for w in range(writers):
            texts = [v.template.text for v in versions if v.run_id == f"w{w}"]
            assert texts == [f"w{w} {i}: {{text}}" for i in range(per_writer)]
        # Replay the production history independently: every rollback returned to the version
        # below the top of the stack, and the label now is the stack's top.
        raw = backend.connect()
        history = raw.execute("SELECT version_id, action FROM label_history WHERE label = 'production' ORDER BY seq")
        stack = []
        for version_id, action in history.fetchall():
            if action == "rollback":
                stack.pop()
                assert stack[-1] == version_id
            else:
                assert action == "promote"
                stack.append(version_id)
        raw.close()
        assert s.get_label("risk", "production").id == stack[-1]
        rollbacks = writers * (per_writer // 4)
        assert s.generation() == writers * per_writer + rollbacks


PAUSE_BEFORE_COMMIT = (Path(__file__).parent / "pause_before_commit.py").read_text()


@pytest.mark.parametrize("operation", ["promote", "add_version"])
def test_a_writer_killed_before_commit_leaves_the_old_state(backend, operation):
    with TemplateStore(backend.url) as s:
        v1, v2 = add(s, "v1"), add(s, "v2")
        s.promote("risk", v1)
        s.set_canary("risk", v2, 0.05)
        gen = s.generation()

    child = python(PAUSE_BEFORE_COMMIT, backend.url, operation, str(v2))
    try:
        assert child.stdout.readline().strip() == "written, not committed", child.stderr.read()
        with TemplateStore(backend.url) as s:  # while it holds the write lock, others read the old state
            assert s.labels("risk") == {"production": v1, "canary": v2}
            assert len(s.list_versions("risk")) == 2
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL

    with TemplateStore(backend.url, busy_timeout_s=1) as s:
        assert s.labels("risk") == {"production": v1, "canary": v2}
        assert s.canary("risk") == Canary(v2, 0.05)
        assert [v.id for v in s.list_versions("risk")] == [v1, v2]
        assert s.generation() == gen
        s.promote("risk", v2)  # the lock died with the process
        assert s.labels("risk") == {"production": v2}
    if backend.name == "sqlite":
        assert sqlite3.connect(backend.location).execute("PRAGMA integrity_check").fetchone() == ("ok",)
