"""The store's database: connecting by URL, creating the schema, the write lock, and errors that name the fix.

One connection to SQLite or PostgreSQL (``StoreDatabase``), shaped so that the registry above it
(``templates/store.py``) runs one text of every query on both. Nothing here knows what a version or a label
means; this module knows the tables, which database holds them and how to talk to it.

Every write is one transaction that first takes the store's write lock (SQLite: ``BEGIN
IMMEDIATE``; PostgreSQL: ``LOCK TABLE ... IN SHARE ROW EXCLUSIVE MODE``, which readers do not wait
for): concurrent writers queue on it (up to the busy timeout) and a writer killed mid-way leaves the
store as it was before. The queries are one text for both databases; ``_Dialect`` holds the few
statements that differ.

The schema is created once, under a lock, by the first writer of an empty file or schema, and is
``SCHEMA_VERSION`` 1: there has been no migration yet, and a store's tables, columns and triggers must stay
as they are (``tests/test_store_fixture.py`` opens a store written before this module existed). A file or
schema holding other tables is refused, never changed. An SQLite store in a folder (or a file) this user
cannot write, or whose write bits are all cleared, is opened read-only (``mode=ro``) and creates nothing
beside it.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote, urlsplit

SCHEMA_VERSION = 1

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


class StoreError(Exception):
    """The store cannot do what was asked; the message names the problem and the fix."""


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


class StoreDatabase:
    """One connection to a store's database, opened from its URL (the forms ``TemplateStore`` takes) and guarded
    by a lock, so that threads may share it. ``where`` names the store in messages: its file, or its URL without
    the password. ``create=False`` refuses to create a missing store."""

    def __init__(self, url: str, *, busy_timeout_s: float, create: bool) -> None:
        self.busy_timeout_s = busy_timeout_s
        self.read_only = False  # an SQLite store whose folder or file this process may not write
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | _PostgresConnection
        self._db_error: type[Exception]  # what the driver raises
        scheme, sep, _ = url.partition("://")
        if sep and scheme in ("postgresql", "postgres"):
            self._dialect = _POSTGRESQL
            self.where, self._conn = self._connect_postgresql(url, create)
        else:
            self._dialect, self._db_error = _SQLITE, sqlite3.Error
            self.where, self._conn = self._connect_sqlite(url, create)

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
        self.read_only = True
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
        path = path or self.where
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
    def transaction(self) -> Iterator[Any]:
        """One write transaction; everything inside commits together or not at all."""
        if self.read_only:
            raise StoreError(f"the store at {self.where} is read-only here (this user may not write its file or "
                             "folder): make both writable to change it; list, show, diff and route still read it")
        with self._lock:
            try:
                try:
                    for statement in self._dialect.begin_write:
                        self._conn.execute(statement)
                    yield self._conn
                    self._conn.execute("COMMIT")
                finally:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
            except self._db_error as exc:
                raise self._error(exc) from None

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, params).fetchall()
            except self._db_error as exc:
                raise self._error(exc) from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()
