"""The versioned template store: append-only versions, labels that move, a change counter.

It is long because one append-only API sits on two databases, SQLite and PostgreSQL (each connected,
created, locked and with its errors turned into a message that names the fix), and every refusal of the
API says what to do instead.

Layout (the same on SQLite and PostgreSQL, opened by URL: ``sqlite:///PATH`` or
``postgresql://user:pass@host:port/db``):

* ``versions``: one immutable row per template version: the template record, its parent, the
  run that made it, scores per split, latency figures and the gate's decision. Triggers refuse
  every UPDATE and DELETE.
* ``label_history``: every label move ever made, also append-only. A label's current version is
  its newest row (``version_id`` NULL means the label was removed; only the canary is removed,
  by ``end_canary`` or when a promotion ends its ramp). Canary rows also carry the traffic share and the ramp.
  Because nothing else changes, ``max(seq)`` of this table is the store's change counter, and the rows
  above the seq a reader has seen are exactly the moves it has missed (``label_moves``): they commit
  in the same transaction as the move and cannot drift from it.

Labels ``production`` and ``canary`` move only through ``promote``/``rollback`` and
``set_canary``/``advance_canary``/``end_canary``, so each has one way to change and the
production history stays a clean stack for rollbacks. Other labels move with ``set_label``.

Every write is one transaction that first takes the store's write lock (SQLite: ``BEGIN
IMMEDIATE``; PostgreSQL: ``LOCK TABLE ... IN SHARE ROW EXCLUSIVE MODE``, which readers do not wait
for): concurrent writers queue on it (up to the busy timeout) and a writer killed mid-way leaves the
store as it was before. The queries are one text for both databases; ``_Dialect`` holds the few
statements that differ.

Hostile input stops at the API: ids outside 1..2**63-1 and names that are not UTF-8 text are refused
(``check_id``, ``check_name``). A stored row that does not decode is a StoreError naming it, and every
write refuses until the store is repaired. A row that decodes but breaks its schema (a non-finite score, a
time that is not ISO 8601, control characters in a name) is read with ``Version.damage`` naming each field:
``store show`` marks it, ``predict`` refuses to serve it, ``check_rows`` (``store doctor``) lists every one. An
SQLite store in a folder (or a file) this user cannot write, or whose write bits are all cleared, is opened
read-only (``mode=ro``) and creates nothing beside it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote, urlsplit

from templates.gate import Decision
from templates.routing import DEFAULT_RAMP, Canary
from templates.template import Template

SCHEMA_VERSION = 1
LABEL_NAME = re.compile(r"[a-z][a-z0-9_-]*")
SPLITS = ("dev", "test")
MAX_ID = 2**63 - 1  # ids are signed 64-bit integers in both databases
MAX_NAME_CHARS = 200

# The tables, for both databases; {id} is each one's auto-numbered key. The queries are standard
# SQL (RETURNING, no INSERT OR REPLACE, no database functions) written with ? parameters, which
# _PostgresConnection turns into psycopg's %s. Statements are split on ";\n" and run one by one
# because sqlite3's executescript() would COMMIT the surrounding BEGIN IMMEDIATE.
_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE versions (
    id {id},
    task TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    template TEXT NOT NULL,
    parent_id BIGINT REFERENCES versions(id),
    run_id TEXT,
    scores TEXT NOT NULL,
    latency TEXT NOT NULL,
    decision TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX versions_by_task ON versions(task, id);
CREATE TABLE label_history (
    seq {id},
    task TEXT NOT NULL,
    label TEXT NOT NULL,
    version_id BIGINT REFERENCES versions(id),
    action TEXT NOT NULL,
    share DOUBLE PRECISION,
    ramp TEXT,
    moved_at TEXT NOT NULL
);
CREATE INDEX label_history_by_label ON label_history(task, label, seq);
"""
_SQLITE_TRIGGERS = """
CREATE TRIGGER versions_no_update BEFORE UPDATE ON versions
    BEGIN SELECT RAISE(ABORT, 'template versions are append-only'); END;
CREATE TRIGGER versions_no_delete BEFORE DELETE ON versions
    BEGIN SELECT RAISE(ABORT, 'template versions are append-only'); END;
CREATE TRIGGER label_history_no_update BEFORE UPDATE ON label_history
    BEGIN SELECT RAISE(ABORT, 'label history is append-only'); END;
CREATE TRIGGER label_history_no_delete BEFORE DELETE ON label_history
    BEGIN SELECT RAISE(ABORT, 'label history is append-only'); END;
"""
# Statement triggers, so that TRUNCATE is refused too; the error is an IntegrityError, as in SQLite.
_POSTGRESQL_TRIGGERS = """
CREATE FUNCTION tune_prompts_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION USING MESSAGE = TG_ARGV[0], ERRCODE = 'integrity_constraint_violation'; END $$;
CREATE TRIGGER versions_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON versions
    FOR EACH STATEMENT EXECUTE FUNCTION tune_prompts_refuse_change('template versions are append-only');
CREATE TRIGGER label_history_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON label_history
    FOR EACH STATEMENT EXECUTE FUNCTION tune_prompts_refuse_change('label history is append-only');
"""


@dataclass(frozen=True)
class _Dialect:
    """The statements that differ between SQLite and PostgreSQL; every query is shared."""

    schema: str  # DDL, statements separated by ";\n"
    begin_write: tuple[str, ...]  # start a write transaction that queues other writers but no reader
    begin_create: tuple[str, ...]  # the same before the tables exist, to create them once
    list_tables: str  # the tables of the file (SQLite); the tables and views of the current schema (PostgreSQL)


_SQLITE = _Dialect(
    schema=_TABLES.format(id="INTEGER PRIMARY KEY") + _SQLITE_TRIGGERS,
    begin_write=("BEGIN IMMEDIATE",),
    begin_create=("BEGIN IMMEDIATE",),
    list_tables="SELECT name FROM sqlite_master WHERE type = 'table'",
)
# Writers lock both tables in a mode that conflicts with itself and with other writes but not with
# plain SELECTs. Serialised writers also keep the change counter honest: ids and seqs come from
# sequences when a row is inserted, so without the lock a writer could commit seq 7 after a reader
# has seen seq 8, and the reader would never notice that change. Before the tables exist there is
# nothing to lock, so creators take a transaction-scoped advisory lock (per database; any constant
# key, here "tuneprom" in ASCII).
_POSTGRESQL = _Dialect(
    schema=_TABLES.format(id="BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY") + _POSTGRESQL_TRIGGERS,
    begin_write=("BEGIN", "LOCK TABLE versions, label_history IN SHARE ROW EXCLUSIVE MODE"),
    begin_create=("BEGIN", "SELECT pg_advisory_xact_lock(8391147083478871917)"),
    list_tables="SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
                " AND relkind IN ('r', 'p', 'v', 'm', 'f')",
)

_COLUMNS = ("id", "task", "content_hash", "template", "parent_id", "run_id", "scores", "latency", "decision", "created_at")
_VERSION_COLUMNS = ", ".join(_COLUMNS)
# A label's state is its newest history row.
_CURRENT = "SELECT version_id, share, ramp FROM label_history WHERE task = ? AND label = ? ORDER BY seq DESC LIMIT 1"


class StoreError(Exception):
    """The store cannot do what was asked; the message names the problem and the fix."""


def check_id(version_id: object) -> int:
    """A version id as given, refused before it reaches a database that cannot hold it."""
    if isinstance(version_id, bool) or not isinstance(version_id, int) or not 0 < version_id <= MAX_ID:
        raise StoreError(f"version id {version_id!r} is out of range: ids are whole numbers from 1 to {MAX_ID}; "
                         "`tune-prompts store list TASK` shows them")
    return version_id


def check_name(name: object, what: str, *, new: bool = False) -> str:
    """A task name, label or caller key as given: text both databases can store and look up. A ``new`` name,
    one about to be stored, must also be printable, so that no table or message shows it as something else."""
    if not isinstance(name, str) or not name:
        raise StoreError(f"{what} must be non-empty text; give one")
    if len(name) > MAX_NAME_CHARS:
        raise StoreError(f"{what} {name[:40]!a}... has {len(name)} characters; use at most {MAX_NAME_CHARS}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise StoreError(f"{what} {name!a} is not valid UTF-8 (it came from undecodable bytes); "
                         "retype it in UTF-8") from None
    if "\x00" in name or (new and not name.isprintable()):
        raise StoreError(f"{what} {name!a} has control characters; use printable characters only")
    return name


def _writable(path: str) -> bool:
    """Whether this process may write ``path`` and its mode says anyone may: root ignores permissions, but a
    file or folder with every write bit cleared was made read-only on purpose, and is opened read-only (``mode=ro``,
    so that SQLite creates no -wal or -shm beside it)."""
    return os.access(path, os.W_OK) and bool(os.stat(path).st_mode & 0o222)


def _is_lock_error(exc: Exception) -> bool:
    text = str(exc)
    return isinstance(exc, sqlite3.Error) and ("locked" in text or "busy" in text)


def default_store_url() -> str:
    """``sqlite:////<TUNE_PROMPTS_HOME>/store.sqlite``, TUNE_PROMPTS_HOME defaulting to ~/.tune-prompts."""
    home = Path(os.environ.get("TUNE_PROMPTS_HOME") or Path.home() / ".tune-prompts")
    return f"sqlite:///{home.expanduser().resolve() / 'store.sqlite'}"


@dataclass(frozen=True)
class Version:
    """One immutable template version as stored."""

    id: int
    task: str
    content_hash: str  # first 12 hex digits of the sha256 of the template record
    template: Template
    parent_id: int | None
    run_id: str | None
    scores: dict[str, dict[str, float]]  # split ("dev", "test") -> component -> score
    latency: dict[str, float]  # e.g. template_tokens, latency_p95_ms, render_us_p99, error_rate
    decision: Decision | None  # the gate's decision; None for a version that was never gated (a seed)
    created_at: str  # ISO 8601, UTC
    # What in the row breaks its own schema but still decodes ("scores.test.roc_auc: nan is not a finite number"),
    # from a row written outside the store's code: shown marked, never served (``check_rows``, ``store doctor``).
    damage: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "task": self.task,
            "content_hash": self.content_hash,
            "template": self.template.to_dict(),
            "parent_id": self.parent_id,
            "run_id": self.run_id,
            "scores": self.scores,
            "latency": self.latency,
            "decision": None if self.decision is None else {
                "promote": self.decision.promote, "reasons": list(self.decision.reasons)},
            "created_at": self.created_at,
            **({"damage": list(self.damage)} if self.damage else {}),
        }


# What decoding a stored row raises when the row was written outside the store or damaged on disk.
_DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError)  # json's and TemplateError are ValueErrors


def _damaged(what: str, where: str, exc: Exception) -> StoreError:
    reason = " ".join(str(exc).split())[:120] or type(exc).__name__
    return StoreError(f"{what} in the store at {where} is damaged ({reason}); the store needs repair: "
                      "restore it from a backup")


def _is_figures(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values())


def _figure_damage(field: str, figures: dict) -> list[str]:
    return [f"{field}.{name}: {value!r} is not a finite number" for name, value in figures.items()
            if not math.isfinite(value)]


def _name_damage(field: str, value: object, *, optional: bool = False) -> list[str]:
    """A stored name the store would refuse today: not text, empty, too long, or with control characters."""
    if value is None and optional:
        return []
    if not isinstance(value, str) or not value:
        return [f"{field}: {value!r} is not a name"]
    if len(value) > MAX_NAME_CHARS or not value.isprintable():
        return [f"{field}: {value[:40]!a} has control characters or over {MAX_NAME_CHARS} characters"]
    return []


def _time_damage(field: str, value: object) -> list[str]:
    try:
        datetime.fromisoformat(value)  # type: ignore[arg-type]
        return []
    except (TypeError, ValueError):
        return [f"{field}: {str(value)[:40]!a} is not an ISO 8601 time"]


def _soft_damage(task: object, run_id: object, scores: dict, latency: dict, created_at: object) -> list[str]:
    """What breaks a decoded version row's schema without stopping it from being read."""
    return (_name_damage("task", task) + _name_damage("run_id", run_id, optional=True)
            + [d for split, figures in scores.items() for d in _figure_damage(f"scores.{split}", figures)]
            + _figure_damage("latency", latency) + _time_damage("created_at", created_at))


@dataclass(frozen=True)
class Promotion(Version):
    """The version ``promote`` made production, and what the move replaced, both read in its transaction."""

    previous_id: int | None = None  # production before the move
    ended_canary_id: int | None = None  # the canary the move ended


def _version_from_row(row: tuple, where: str) -> Version:
    id_, task, content_hash, template, parent_id, run_id, scores, latency, decision, created_at = row
    try:
        scores, latency = json.loads(scores), json.loads(latency)
        decision = None if decision is None else json.loads(decision)
        if not (_is_figures(latency) and isinstance(scores, dict) and all(map(_is_figures, scores.values()))):
            raise ValueError("scores or latency are not figures")
        for name, value, kinds in (("task", task, str), ("content_hash", content_hash, str),
                                   ("created_at", created_at, str), ("run_id", run_id, (str, type(None))),
                                   ("parent_id", parent_id, (int, type(None)))):
            if not isinstance(value, kinds):
                raise ValueError(f"{name} has the wrong type: {type(value).__name__}")
        return Version(
            id=id_, task=task, content_hash=content_hash, template=Template.from_dict(json.loads(template)),
            parent_id=parent_id, run_id=run_id, scores=scores, latency=latency,
            decision=None if decision is None else Decision(bool(decision["promote"]), tuple(decision["reasons"])),
            created_at=created_at, damage=tuple(_soft_damage(task, run_id, scores, latency, created_at)),
        )
    except _DECODE_ERRORS as exc:
        raise _damaged(f"version {id_}", where, exc) from None


def _history_damage(row: tuple) -> list[str]:
    """What breaks a label history row's schema (seq, task, label, version_id, share, ramp, moved_at)."""
    _, task, label, version_id, share, ramp, moved_at = row
    out = _name_damage("task", task) + _name_damage("label", label) + _time_damage("moved_at", moved_at)
    if not (version_id is None or (isinstance(version_id, int) and not isinstance(version_id, bool))):
        out.append(f"version_id: {str(version_id)[:40]!a} is not a version id")
    if share is not None and not (isinstance(share, (int, float)) and 0 <= share <= 1):
        out.append(f"share: {share!r} is not a fraction from 0 to 1")
    if ramp is not None:
        try:
            steps = json.loads(ramp)
            if not (isinstance(steps, list) and all(isinstance(x, (int, float)) and 0 < x <= 1 for x in steps)):
                raise ValueError
        except (TypeError, ValueError, RecursionError):
            out.append(f"ramp: {str(ramp)[:40]!a} is not a list of fractions")
    return out


def _canary_from_row(task: str, row: tuple, where: str) -> Canary:
    try:
        return Canary(row[0], row[1], tuple(json.loads(row[2])))
    except _DECODE_ERRORS as exc:
        raise _damaged(f"the canary of {task!r}", where, exc) from None


def _finite_figures(figures: Mapping[str, Any], what: str) -> dict[str, float]:
    out = {}
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise StoreError(f"{what}: {name}={value!r} is not a finite number; store only measured figures")
        out[str(name)] = value
    return out


def _not_a_store(path: str, tables: set[str]) -> StoreError:
    return StoreError(
        f"{path} is not a tune-prompts store (schema missing: it holds tables {sorted(tables)}): "
        "restore it from a backup or point --store at another path"
    )


def _without_password(url: str) -> str:
    """The URL to show in messages: any password replaced by ***."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return url.replace(parts.netloc, f"{user.partition(':')[0]}:***@{host}", 1)


def _postgres_connect_error(exc: Exception, where: str, timeout_s: float) -> StoreError:
    # Errors before a session exists carry no SQLSTATE, only libpq's text:
    # 'connection failed: connection to server at "h", port p failed: REASON'.
    reason = " ".join(str(exc).split()).rpartition(" failed: ")[2].removeprefix("FATAL: ").strip()
    if "Connection refused" in reason:
        return StoreError(f"cannot connect to PostgreSQL for {where}: connection refused; "
                          "start the server or fix the host and port in the URL")
    if "timeout expired" in reason:
        return StoreError(f"cannot connect to PostgreSQL for {where}: no answer within {timeout_s:g} s; "
                          "check the host and port in the URL and that the server is up")
    if any(word in reason for word in ("password", "authentication", "pg_hba.conf")) or (
            "role" in reason and "does not exist" in reason):
        return StoreError(f"PostgreSQL refused the login for {where}: {reason}; check the user and password in the URL")
    if "resolve host" in reason or "translate host name" in reason:
        return StoreError(f"cannot connect to PostgreSQL for {where}: {reason}; fix the host in the URL")
    if "database" in reason and "does not exist" in reason:
        return StoreError(f"cannot open {where}: {reason}; create the database first (createdb NAME) "
                          "or fix its name in the URL")
    return StoreError(f"cannot connect to PostgreSQL for {where}: {reason}")


class _PostgresConnection:
    """A psycopg connection shaped like sqlite3's as the store uses it: ``?`` parameters, explicit
    BEGIN/COMMIT (autocommit mode, like ``isolation_level=None``) and ``in_transaction``."""

    def __init__(self, conn: Any, idle: Any) -> None:
        self._conn, self._idle = conn, idle

    def execute(self, sql: str, params: tuple | None = None) -> Any:
        return self._conn.execute(sql.replace("?", "%s"), params)

    @property
    def in_transaction(self) -> bool:
        return self._conn.info.transaction_status != self._idle

    def close(self) -> None:
        self._conn.close()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class TemplateStore:
    """A template store opened from a URL: ``sqlite:///relative.sqlite`` or ``sqlite:////absolute.sqlite``
    (SQLAlchemy's convention), a plain file path, or ``postgresql://user:pass@host:port/db`` (the
    store's tables go in the database's current schema, which must hold no other tables).

    ``create=False`` refuses to create a missing store (readers and the CLI use it, so a mistyped
    path is an error rather than a new empty store). One connection, guarded by a lock, so an
    instance may be shared between threads.
    """

    def __init__(self, url: str, *, busy_timeout_s: float = 5.0, create: bool = True) -> None:
        self.url = url
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        self._intact_through = (0, 0)  # (version id, label history seq) up to which every row decodes
        self._read_only = False  # an SQLite store whose folder or file this process may not write
        scheme, sep, rest = url.partition("://")
        if sep and scheme in ("postgresql", "postgres"):
            self._dialect = _POSTGRESQL
            self._path, self._conn = self._connect_postgresql(url, create)
        else:
            self._dialect, self._db_error = _SQLITE, sqlite3.Error
            self._path, self._conn = self._connect_sqlite(url, create)

    # --- connection and dialect: the one place that knows which database the store is in ---

    # Parallel by design to _connect_postgresql (look for the schema, refuse or create, close on error), for sqlite3.
    def _connect_sqlite(self, url: str, create: bool) -> tuple[str, sqlite3.Connection]:
        scheme, sep, rest = url.partition("://")
        if not sep:
            scheme, rest = "sqlite", "/" + url  # a plain path
        if scheme != "sqlite" or not rest.startswith("/") or len(rest) < 2:
            raise StoreError(
                f"cannot open store {url!r}: use sqlite:///relative/path.sqlite, sqlite:////absolute/path.sqlite "
                "or postgresql://user:password@host:port/database"
            )
        path = os.path.abspath(rest[1:])
        # SQLite answers some lock conflicts at creation at once instead of through its busy timeout (switching a
        # new file to WAL while another process opens it): retry those until the busy timeout has passed.
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return path, self._open_sqlite(path, create)
            except sqlite3.Error as exc:  # only lock errors get here
                if time.monotonic() >= deadline:
                    raise self._error(exc, path) from None
                time.sleep(0.02)

    def _open_sqlite(self, path: str, create: bool) -> sqlite3.Connection:
        """Open (and create, if allowed and missing) the store file; lock errors are raised as they are."""
        if os.path.exists(path) and not (_writable(path) and _writable(os.path.dirname(path))):
            return self._open_sqlite_read_only(path)
        # Look before writing anything: a read-only connection cannot change a file that is not ours.
        has_schema = os.path.exists(path) and os.path.getsize(path) > 0 and self._check_file_is_store(path)
        if not has_schema and not create:
            raise StoreError(f"no store at {path}: check --store / the URL, or create it by adding a version")
        if not has_schema:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            conn = sqlite3.connect(path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            if _is_lock_error(exc):
                raise
            raise self._error(exc, path) from None
        with self._closed_on_error(conn, path):
            conn.execute("PRAGMA foreign_keys = ON")
            if not has_schema:
                self._create_schema(conn, path)
            # Read once: only a connection that has read removes, when it closes last, the -wal and -shm
            # files that the read-only look above created; a refused command then leaves the folder as it was.
            conn.execute("SELECT 1 FROM meta").fetchall()
        return conn

    @contextmanager
    def _closed_on_error(self, conn: sqlite3.Connection, path: str):
        """Close ``conn`` if the block fails: lock errors go up as they are (the caller retries), other SQLite
        errors as a StoreError naming the file."""
        try:
            yield
        except sqlite3.Error as exc:
            conn.close()
            if _is_lock_error(exc):
                raise
            raise self._error(exc, path) from None
        except StoreError:
            conn.close()
            raise

    def _open_sqlite_read_only(self, path: str) -> sqlite3.Connection:
        """A store in a folder (or a file) we may not write: it can be read, and nothing is created beside it.

        SQLite reads a WAL store through its -shm file, which it cannot create here. With no -wal file nobody has
        the store open, so it is read as immutable (a reader then sees no later change: reopen it for those);
        a store open elsewhere has its -wal and -shm, and is read through them.
        """
        self._read_only = True
        immutable = "" if os.path.exists(path + "-wal") else "&immutable=1"
        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro{immutable}", uri=True, timeout=self.busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        with self._closed_on_error(conn, path):
            if not self._is_store(conn, path):
                raise StoreError(f"no store at {path}: check --store / the URL")
        return conn

    def _check_file_is_store(self, path: str) -> bool:
        """``_is_store`` through a read-only connection, which cannot change a file that is not ours."""
        try:
            conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=self.busy_timeout_s)
            try:
                return self._is_store(conn, path)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            if _is_lock_error(exc):
                raise
            raise self._error(exc, path) from None

    # Parallel by design to _connect_sqlite/_open_sqlite above, with psycopg's errors and connect timeout.
    def _connect_postgresql(self, url: str, create: bool) -> tuple[str, _PostgresConnection]:
        where = _without_password(url)
        try:
            import psycopg  # only PostgreSQL stores need the driver
        except ImportError:
            raise StoreError(f"cannot open {where}: PostgreSQL stores need the psycopg driver: "
                             "pip install 'psycopg[binary]' (scripts/setup.sh installs it)") from None
        self._db_error = psycopg.Error
        timeout_s = max(2, math.ceil(self.busy_timeout_s))  # libpq's smallest connect timeout is 2 s
        try:
            raw = psycopg.connect(url, autocommit=True, connect_timeout=timeout_s, application_name="tune-prompts")
        except psycopg.Error as exc:
            raise _postgres_connect_error(exc, where, timeout_s) from None
        conn = _PostgresConnection(raw, psycopg.pq.TransactionStatus.IDLE)
        try:
            # A writer waits for the write lock up to the busy timeout, as SQLite's busy timeout does.
            conn.execute(f"SET lock_timeout = {max(1, round(self.busy_timeout_s * 1000))}")
            # Only reads until we know the schema holds no other tables.
            has_schema = self._is_store(conn, where)
            if not has_schema and not create:
                raise StoreError(f"no store at {where}: check --store / the URL, or create it by adding a version")
            if not has_schema:
                self._create_schema(conn, where)
        except psycopg.Error as exc:
            conn.close()
            raise self._error(exc, where) from None
        except StoreError:
            conn.close()
            raise
        return where, conn

    def _is_store(self, conn: Any, path: str) -> bool:
        """True for a tune-prompts store, False for a database (or schema) with no tables at all, such as
        a store whose creation has not committed yet; raises StoreError for anything else. Only reads."""
        tables = {name for (name,) in conn.execute(self._dialect.list_tables)}
        app = conn.execute("SELECT value FROM meta WHERE key = 'app'").fetchone() if "meta" in tables else None
        if tables and tuple(app or ()) != ("tune-prompts",):
            raise _not_a_store(path, tables)
        return bool(tables)

    def _create_schema(self, conn: Any, path: str) -> None:
        if self._dialect is _SQLITE:
            conn.execute("PRAGMA journal_mode = WAL")  # persistent: readers never wait for a writer
        try:
            for statement in self._dialect.begin_create:
                conn.execute(statement)
            # Another process may have created the store since we looked; look again under the lock.
            if not self._is_store(conn, path):
                for statement in self._dialect.schema.split(";\n"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?), (?, ?)",
                    ("app", "tune-prompts", "schema_version", str(SCHEMA_VERSION)),
                )
            conn.execute("COMMIT")
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    def _error(self, exc: Exception, path: str | None = None) -> StoreError:
        path = path or self._path
        text = " ".join(str(exc).split())
        if isinstance(exc, sqlite3.Error):
            locked, not_a_database = _is_lock_error(exc), "not a database" in text or "malformed" in text
        else:  # psycopg: lock_not_available is what lock_timeout raises
            locked, not_a_database = getattr(exc, "sqlstate", None) == "55P03", False
        if locked:
            return StoreError(
                f"the store at {path} is locked by another process; retry, or raise the busy timeout "
                f"(now {self.busy_timeout_s:g} s)"
            )
        if not_a_database:
            return StoreError(
                f"{path} is not a tune-prompts store (file is not a database): "
                "restore it from a backup or point --store at another path"
            )
        return StoreError(f"store at {path}: {text}")

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        """One write transaction; everything inside commits together or not at all."""
        if self._read_only:
            raise StoreError(f"the store at {self._path} is read-only here (this user may not write its file or "
                             "folder): make both writable to change it; list, show, diff and route still read it")
        with self._lock:
            try:
                try:
                    for statement in self._dialect.begin_write:
                        self._conn.execute(statement)
                    self._refuse_if_damaged(self._conn)
                    yield self._conn
                    self._conn.execute("COMMIT")
                finally:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
            except self._db_error as exc:
                raise self._error(exc) from None

    def _refuse_if_damaged(self, conn: Any) -> None:
        """No change on top of a row that does not decode (one written outside the store, or damaged on disk):
        every write refuses until the store is repaired. Rows never change, so each is decoded once per store
        object; under the write lock, so no row can appear meanwhile."""
        version_id, seq = self._intact_through
        try:
            for row in conn.execute(f"SELECT {_VERSION_COLUMNS} FROM versions WHERE id > ? ORDER BY id",
                                    (version_id,)).fetchall():
                version_id = _version_from_row(row, self._path).id
            for seq, task, *canary in conn.execute(
                    "SELECT seq, task, version_id, share, ramp FROM label_history WHERE seq > ? AND label = 'canary'"
                    " AND version_id IS NOT NULL ORDER BY seq", (seq,)).fetchall():
                _canary_from_row(task, canary, self._path)
        except StoreError as exc:
            raise StoreError(f"cannot change the store: {exc}") from None
        self._intact_through = (version_id, seq)

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, params).fetchall()
            except self._db_error as exc:
                raise self._error(exc) from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "TemplateStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- versions ---

    def add_version(
        self,
        task: str,
        template: Template,
        *,
        parent_id: int | None = None,
        run_id: str | None = None,
        scores: Mapping[str, Mapping[str, float]] | None = None,
        latency: Mapping[str, float] | None = None,
        decision: Decision | None = None,
    ) -> Version:
        """Append a new immutable version and return it."""
        check_name(task, "task name", new=True)
        if run_id is not None:
            check_name(run_id, "run id", new=True)
        if parent_id is not None:
            check_id(parent_id)
        scores = scores or {}
        unknown = sorted(set(scores) - set(SPLITS))
        if unknown:
            raise StoreError(f"scores has unknown split(s) {unknown}; use {list(SPLITS)}")
        scores = {split: _finite_figures(scores.get(split, {}), f"scores[{split!r}]") for split in SPLITS}
        latency = _finite_figures(latency or {}, "latency")
        record = json.dumps(template.to_dict(), sort_keys=True)
        content_hash = hashlib.sha256(record.encode()).hexdigest()[:12]
        decision_json = None if decision is None else json.dumps(
            {"promote": bool(decision.promote), "reasons": list(decision.reasons)})
        row = (task, content_hash, record, parent_id, run_id, json.dumps(scores), json.dumps(latency),
               decision_json, _now())
        with self._transaction() as conn:
            if parent_id is not None and not conn.execute("SELECT 1 FROM versions WHERE id = ?", (parent_id,)).fetchone():
                raise StoreError(f"parent version {parent_id} does not exist; pass the id of a stored version or None")
            (version_id,) = conn.execute(
                "INSERT INTO versions (task, content_hash, template, parent_id, run_id, scores, latency, decision,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                row,
            ).fetchone()
        return _version_from_row((version_id, *row), self._path)

    def get_version(self, version_id: int) -> Version:
        check_id(version_id)
        rows = self._query(f"SELECT {_VERSION_COLUMNS} FROM versions WHERE id = ?", (version_id,))
        if not rows:
            raise StoreError(f"no version {version_id} in the store at {self._path}; `tune-prompts store list` shows them")
        return _version_from_row(rows[0], self._path)

    def get_template(self, version_id: int) -> Template:
        """A version's template alone: what serving needs, without decoding scores and the decision."""
        check_id(version_id)
        rows = self._query("SELECT template FROM versions WHERE id = ?", (version_id,))
        if not rows:
            raise StoreError(f"no version {version_id} in the store at {self._path}; `tune-prompts store list` shows them")
        return self.decode_template(version_id, rows[0][0])

    def decode_template(self, version_id: int, record: Any) -> Template:
        """Version ``version_id``'s template from its stored record; a record that does not decode is a StoreError."""
        try:
            return Template.from_dict(json.loads(record))
        except _DECODE_ERRORS as exc:
            raise _damaged(f"version {version_id}", self._path, exc) from None

    def list_versions(self, task: str) -> list[Version]:
        """A task's versions, oldest first; empty for an unknown task."""
        check_name(task, "task name")
        rows = self._query(f"SELECT {_VERSION_COLUMNS} FROM versions WHERE task = ? ORDER BY id", (task,))
        return [_version_from_row(row, self._path) for row in rows]

    def tasks(self) -> list[str]:
        # Sorted here: ORDER BY on text follows the database's collation, which differs between databases.
        return sorted(task for (task,) in self._query("SELECT DISTINCT task FROM versions"))

    def diff(self, a_id: int, b_id: int) -> dict:
        """Unified diff of the template texts of versions ``a_id`` -> ``b_id``, and ``b - a`` for every
        score and latency figure (None where only one side has it)."""
        a, b = self.get_version(a_id), self.get_version(b_id)

        def deltas(x: Mapping[str, float], y: Mapping[str, float]) -> dict[str, float | None]:
            return {k: (y[k] - x[k] if k in x and k in y else None) for k in sorted({*x, *y})}

        text_diff = "\n".join(difflib.unified_diff(
            a.template.text.splitlines(), b.template.text.splitlines(),
            fromfile=f"version {a.id}", tofile=f"version {b.id}", lineterm="",
        ))
        return {
            "a": a.id,
            "b": b.id,
            "text_diff": text_diff,
            "score_deltas": {s: deltas(a.scores.get(s, {}), b.scores.get(s, {})) for s in SPLITS},
            "latency_deltas": deltas(a.latency, b.latency),
        }

    # --- labels ---

    def _version_for_task(self, conn: Any, task: str, version_id: int) -> tuple:
        check_name(task, "task name")
        check_id(version_id)
        row = conn.execute(f"SELECT {_VERSION_COLUMNS} FROM versions WHERE id = ?", (version_id,)).fetchone()
        if row is None:
            raise StoreError(f"no version {version_id} in the store at {self._path}; `tune-prompts store list {task}` shows them")
        if row[1] != task:
            raise StoreError(f"version {version_id} belongs to task {row[1]!r}, not {task!r}; pick a version of {task!r}")
        return row

    def _move(self, conn: Any, task: str, label: str, version_id: int | None, action: str,
              canary: Canary | None = None) -> None:
        conn.execute(
            "INSERT INTO label_history (task, label, version_id, action, share, ramp, moved_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (task, label, version_id, action, None if canary is None else canary.share,
             None if canary is None else json.dumps(canary.ramp), _now()),
        )

    def set_label(self, task: str, label: str, version_id: int) -> None:
        """Point ``label`` (e.g. ``staging``) at a version of ``task``."""
        if not isinstance(label, str) or not LABEL_NAME.fullmatch(label):
            raise StoreError(f"label {label!r} must match [a-z][a-z0-9_-]*, e.g. 'staging'")
        if label == "production":
            raise StoreError("production moves only by promotion: use promote (or rollback)")
        if label == "canary":
            raise StoreError("the canary label moves with its traffic share: use set_canary")
        with self._transaction() as conn:
            self._version_for_task(conn, task, version_id)
            self._move(conn, task, label, version_id, "set")

    def label_target(self, task: str, label: str) -> int | None:
        """The id of the version ``label`` points at for ``task``, or None; one indexed lookup."""
        check_name(task, "task name")
        check_name(label, "label")
        rows = self._query(_CURRENT, (task, label))
        return rows[0][0] if rows else None

    def get_label(self, task: str, label: str) -> Version | None:
        version_id = self.label_target(task, label)
        return None if version_id is None else self.get_version(version_id)  # versions never change: no race

    def labels(self, task: str) -> dict[str, int]:
        """Every label of ``task`` that points at a version now: label -> version id."""
        check_name(task, "task name")
        rows = self._query(
            "SELECT h.label, h.version_id FROM label_history h JOIN"
            " (SELECT max(seq) AS seq FROM label_history WHERE task = ? GROUP BY label) newest ON newest.seq = h.seq",
            (task,),
        )
        return {label: version_id for label, version_id in sorted(rows) if version_id is not None}

    def promote(self, task: str, version_id: int, *, force: bool = False) -> Promotion:
        """Make a version ``production`` and end any canary ramp, in one transaction.

        A version the gate refused (or never saw) needs ``force=True``; the move is recorded as forced.
        """
        with self._transaction() as conn:
            version = _version_from_row(self._version_for_task(conn, task, version_id), self._path)
            if not force and (version.decision is None or not version.decision.promote):
                why = "was never gated" if version.decision is None else "was refused by the gate: " + "; ".join(
                    r for r in version.decision.reasons if r.startswith("fail"))
                raise StoreError(f"version {version_id} {why}; pass force=True (--force) to promote it anyway")
            current = conn.execute(_CURRENT, (task, "production")).fetchone()
            if current is not None and current[0] == version_id:
                raise StoreError(f"version {version_id} is already production for {task!r}; nothing to do")
            self._move(conn, task, "production", version_id, "force-promote" if force else "promote")
            canary = conn.execute(_CURRENT, (task, "canary")).fetchone()
            if canary is not None and canary[0] is not None:
                self._move(conn, task, "canary", None, "end-canary")
        return Promotion(**vars(version), previous_id=None if current is None else current[0],
                         ended_canary_id=None if canary is None else canary[0])

    def rollback(self, task: str) -> Version:
        """Undo the newest promotion not yet undone: ``production`` returns to the version it held before.

        The production history is a stack: each promotion pushes, each rollback pops. After promoting
        1, 2, 3, rollbacks go to 2, then 1, then fail; promoting 4 after that and rolling back returns to 1.
        """
        check_name(task, "task name")
        with self._transaction() as conn:
            stack: list[int] = []
            for version_id, action in conn.execute(
                "SELECT version_id, action FROM label_history WHERE task = ? AND label = 'production' ORDER BY seq",
                (task,),
            ):
                if action == "rollback":
                    stack.pop()
                else:
                    stack.append(version_id)
            if len(stack) < 2:
                now = f"version {stack[-1]}" if stack else "nothing"
                raise StoreError(f"cannot roll back {task!r}: production holds {now} and no earlier version to return to")
            self._move(conn, task, "production", stack[-2], "rollback")
            return _version_from_row(self._version_for_task(conn, task, stack[-2]), self._path)

    # --- canary routing ---

    def set_canary(self, task: str, version_id: int, share: float | None = None,
                   ramp: tuple[float, ...] = DEFAULT_RAMP) -> Canary:
        """Route ``share`` of the task's callers (default: the ramp's first step) to a version."""
        try:
            canary = Canary(version_id, ramp[0] if share is None else share, tuple(ramp))
        except (ValueError, IndexError) as exc:
            raise StoreError(str(exc) if isinstance(exc, ValueError) else "the canary ramp needs at least one step") from None
        with self._transaction() as conn:
            self._version_for_task(conn, task, version_id)
            production = conn.execute(_CURRENT, (task, "production")).fetchone()
            if production is not None and production[0] == version_id:
                raise StoreError(f"version {version_id} is already production for {task!r}; canary a different version")
            self._move(conn, task, "canary", version_id, "canary", canary)
        return canary

    def canary(self, task: str) -> Canary | None:
        check_name(task, "task name")
        rows = self._query(_CURRENT, (task, "canary"))
        row = rows[0] if rows else None
        if row is None or row[0] is None:
            return None
        return _canary_from_row(task, row, self._path)

    def advance_canary(self, task: str) -> Canary:
        """Move the canary's share to the next step of its ramp."""
        check_name(task, "task name")
        with self._transaction() as conn:
            row = conn.execute(_CURRENT, (task, "canary")).fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"task {task!r} has no canary to advance; start one with set_canary (route --canary)")
            try:
                canary = _canary_from_row(task, row, self._path).advance()
            except ValueError as exc:
                raise StoreError(str(exc)) from None
            self._move(conn, task, "canary", canary.version_id, "advance", canary)
        return canary

    def end_canary(self, task: str) -> None:
        """Send every caller to production again."""
        check_name(task, "task name")
        with self._transaction() as conn:
            row = conn.execute(_CURRENT, (task, "canary")).fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"task {task!r} has no canary to end")
            self._move(conn, task, "canary", None, "end-canary")

    def generation(self) -> int:
        """A number that rises with every label or canary change: the newest move's seq (0 before any)."""
        return self._query("SELECT coalesce(max(seq), 0) FROM label_history")[0][0]

    def label_moves(self, after_seq: int) -> list[tuple[int, str, str, int | None, str | None]]:
        """Every label move newer than seq ``after_seq`` (a ``generation()``), oldest first, as (seq, task, label,
        version id or None where the label was removed, that version's template record for ``decode_template``).
        One range query on the history's key, which finds no rows when nothing moved: readers poll it and update
        their caches in place, and compile a version new to them without asking again."""
        return self._query(
            "SELECT h.seq, h.task, h.label, h.version_id, v.template FROM label_history h"
            " LEFT JOIN versions v ON v.id = h.version_id WHERE h.seq > ? ORDER BY h.seq", (after_seq,))

    def check_rows(self) -> list[tuple[str, int, str]]:
        """Every row that breaks its own schema, as (table, version id or history seq, "field: problem"), in table
        and id order; empty for a sound store. Reads every row: for ``store doctor``, not for serving."""
        found = []
        for row in self._query(f"SELECT {_VERSION_COLUMNS} FROM versions ORDER BY id"):
            try:
                damage = _version_from_row(row, self._path).damage
            except StoreError as exc:
                damage = (str(exc).partition(" is damaged (")[2].rpartition("); the store needs repair")[0],)
            found += [("versions", row[0], problem) for problem in damage]
        for row in self._query("SELECT seq, task, label, version_id, share, ramp, moved_at FROM label_history ORDER BY seq"):
            found += [("label_history", row[0], problem) for problem in _history_damage(row)]
        return found
