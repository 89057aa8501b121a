"""Fixtures shared by several test files. Each section belongs to the code it serves; add new
fixtures in a section of their own."""

import os
import sqlite3
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

# ======================================================================================
# Store backends: templates/store.py, templates/serving.py and `tune-prompts store` on
# SQLite and on PostgreSQL.
#
# `backend` runs a test once per database. The PostgreSQL run needs a server's URL in
# TUNE_PROMPTS_TEST_PG_URL (`eval "$(bash scripts/start_postgres.sh)"` starts a throwaway one)
# and is skipped without it. Each test gets fresh, empty store locations: a file in tmp_path,
# or a new schema in that database (the URL's search_path points at it), dropped afterwards.
# `postgres` is the PostgreSQL backend alone, for tests of what only PostgreSQL has.
# ======================================================================================

PG_URL = os.environ.get("TUNE_PROMPTS_TEST_PG_URL")
NO_PG = ("TUNE_PROMPTS_TEST_PG_URL is not set: start a throwaway server with "
         'eval "$(bash scripts/start_postgres.sh)" to run the PostgreSQL tests')


class SQLiteBackend:
    name = "sqlite"
    integrity_error = sqlite3.IntegrityError
    # What another process can hold: the store's own write lock, and the strongest SQLite has.
    locks = {"write": ("BEGIN IMMEDIATE",), "exclusive": ("BEGIN EXCLUSIVE",)}

    def __init__(self, tmp_path: Path) -> None:
        self._dir = tmp_path
        self.url = self.new_url("store")
        self.location = str(tmp_path / "store.sqlite")  # how the store names itself in messages

    def new_url(self, name: str = "other") -> str:
        return f"sqlite:///{self._dir / name}.sqlite"

    def connect(self) -> sqlite3.Connection:
        """A raw connection to the store, outside the store's code; autocommit."""
        return sqlite3.connect(self.location, isolation_level=None)

    def snapshot(self) -> dict:
        """Everything on disk where the store lives, byte for byte."""
        return {p.name: p.read_bytes() for p in sorted(self._dir.iterdir())}


class PostgresBackend:
    name = "postgresql"
    locks = {
        "write": ("BEGIN", "LOCK TABLE versions, label_history IN SHARE ROW EXCLUSIVE MODE"),
        # PostgreSQL's EXCLUSIVE mode still lets plain SELECTs read, like SQLite's EXCLUSIVE in WAL mode.
        "exclusive": ("BEGIN", "LOCK TABLE versions, label_history IN EXCLUSIVE MODE"),
    }

    def __init__(self, admin) -> None:
        import psycopg

        self._psycopg = psycopg
        self.integrity_error = psycopg.IntegrityError
        self.admin_url = PG_URL
        self._admin = admin
        self._schemas: list[str] = []
        self.url = self.location = self.new_url()

    def new_url(self, name: str = "") -> str:
        schema = f"test_{uuid.uuid4().hex[:16]}"
        self._admin.execute(f"CREATE SCHEMA {schema}")
        self._schemas.append(schema)
        return f"{PG_URL}{'&' if '?' in PG_URL else '?'}options={quote(f'-csearch_path={schema}')}"

    def connect(self):
        """A raw connection to the store's schema, outside the store's code; autocommit."""
        return self._psycopg.connect(self.url, autocommit=True)

    def snapshot(self) -> dict:
        """Every table (with its rows), sequence, function and other object in this test's schemas."""
        objects = self._admin.execute(
            "SELECT n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = ANY(%s)"
            " UNION ALL SELECT n.nspname, p.proname, 'function' FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = ANY(%s)",
            (self._schemas, self._schemas),
        ).fetchall()
        out = {}
        for schema, name, kind in sorted(objects):
            rows = self._admin.execute(f'SELECT * FROM {schema}."{name}"').fetchall() if kind == "r" else None
            out[f"{schema}.{name}"] = (kind, sorted(rows) if rows is not None else None)
        return out

    def close(self) -> None:
        for schema in self._schemas:
            self._admin.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(scope="session")
def pg_admin():
    """One connection to TUNE_PROMPTS_TEST_PG_URL that makes and drops the tests' schemas."""
    import psycopg

    conn = psycopg.connect(PG_URL, autocommit=True)
    conn.execute("SET lock_timeout = '10s'")  # a test that leaks a lock fails the teardown rather than hanging it
    yield conn
    conn.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(not PG_URL, reason=NO_PG))])
def backend(request, tmp_path):
    if request.param == "sqlite":
        yield SQLiteBackend(tmp_path)
        return
    b = PostgresBackend(request.getfixturevalue("pg_admin"))
    yield b
    b.close()


@pytest.fixture
def postgres(request):
    if not PG_URL:
        pytest.skip(NO_PG)
    b = PostgresBackend(request.getfixturevalue("pg_admin"))
    yield b
    b.close()

# ============================== end of store backends ==============================


@pytest.fixture
def write_small_risk_task(tmp_path):
    """Writes the built-in risk task with small splits (so a run takes seconds) and returns its path."""
    import yaml

    from pipelines.config import BUILTIN_TASKS_DIR

    def write(*, test: int, robustness_examples: int, decision: str = "calibrated") -> str:
        data = yaml.safe_load((BUILTIN_TASKS_DIR / "risk.yaml").read_text())
        data["split"] = {"seed": 13, "balanced": True, "train": 20, "dev": 20, "test": test}
        data["scoring"] = {**data.get("scoring", {}), "calibration_examples": 20,
                           "robustness_examples": robustness_examples, "decision": decision, "judge_examples": 2}
        path = tmp_path / "risk-small.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return write


# ======================================================================================
# Ray: tests that start a local Ray (tuning runs, scoring pools) in this process shut it down
# at the end of their module, so the next module starts from a clean state.
# ======================================================================================
@pytest.fixture(scope="module")
def ray_session():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


# ======================================================================================
# Timing: a test that guards speed (a regex that must not backtrack, an input rejected before
# it is parsed) compares two timings taken in the same run, never a wall-clock bound: the
# machines are shared and noisy. `best_of` gives the fastest of a few runs of a call.
# ======================================================================================


@pytest.fixture
def best_of():
    import time

    def best_of(call, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return min(times)

    return best_of
