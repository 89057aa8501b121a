"""The versioned template store: append-only versions, labels that move, canary routes, a change counter.

This is the registry and the store's public entry; below it, ``templates/store_db.py`` is the database (SQLite or
PostgreSQL: connecting, the schema, the write lock, errors) and ``templates/store_rows.py`` what a row may hold
(input checks, decoding, damage). Everything callers import comes from here.

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

Every write is one transaction under the store's write lock (``StoreDatabase.transaction``), and refuses
while any row does not decode (``_refuse_if_damaged``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

from templates.gate import Decision
from templates.routing import DEFAULT_RAMP, Canary
from templates.store_db import StoreDatabase, StoreError, default_store_url
from templates.store_rows import (DECODE_ERRORS, MAX_ID, VERSION_COLUMNS, Promotion, Version, canary_from_row, check_id,
                                  check_name, damaged, finite_figures, history_damage, version_from_row)
from templates.template import Template

# What callers import from templates.store; the names defined elsewhere are re-exported for them.
__all__ = ["LABEL_NAME", "MAX_ID", "SPLITS", "Promotion", "StoreError", "TemplateStore", "Version", "check_id",
           "check_name", "default_store_url"]

LABEL_NAME = re.compile(r"[a-z][a-z0-9_-]*")
SPLITS = ("dev", "test")
# A label's state is its newest history row.
_CURRENT = "SELECT version_id, share, ramp FROM label_history WHERE task = ? AND label = ? ORDER BY seq DESC LIMIT 1"


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
        self._db = StoreDatabase(url, busy_timeout_s=busy_timeout_s, create=create)
        self._path = self._db.where  # how messages name the store
        self._intact_through = (0, 0)  # (version id, label history seq) up to which every row decodes

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        """One write transaction; everything inside commits together or not at all."""
        with self._db.transaction() as conn:
            self._refuse_if_damaged(conn)
            yield conn

    def _refuse_if_damaged(self, conn: Any) -> None:
        """No change on top of a row that does not decode (one written outside the store, or damaged on disk):
        every write refuses until the store is repaired. Rows never change, so each is decoded once per store
        object; under the write lock, so no row can appear meanwhile."""
        version_id, seq = self._intact_through
        try:
            for row in conn.execute(f"SELECT {VERSION_COLUMNS} FROM versions WHERE id > ? ORDER BY id",
                                    (version_id,)).fetchall():
                version_id = version_from_row(row, self._path).id
            for seq, task, *canary in conn.execute(
                    "SELECT seq, task, version_id, share, ramp FROM label_history WHERE seq > ? AND label = 'canary'"
                    " AND version_id IS NOT NULL ORDER BY seq", (seq,)).fetchall():
                canary_from_row(task, canary, self._path)
        except StoreError as exc:
            raise StoreError(f"cannot change the store: {exc}") from None
        self._intact_through = (version_id, seq)

    def close(self) -> None:
        self._db.close()

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
        scores = {split: finite_figures(scores.get(split, {}), f"scores[{split!r}]") for split in SPLITS}
        latency = finite_figures(latency or {}, "latency")
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
        return version_from_row((version_id, *row), self._path)

    def get_version(self, version_id: int) -> Version:
        check_id(version_id)
        rows = self._db.query(f"SELECT {VERSION_COLUMNS} FROM versions WHERE id = ?", (version_id,))
        if not rows:
            raise StoreError(f"no version {version_id} in the store at {self._path}; `tune-prompts store list` shows them")
        return version_from_row(rows[0], self._path)

    def get_template(self, version_id: int) -> Template:
        """A version's template alone: what serving needs, without decoding scores and the decision."""
        check_id(version_id)
        rows = self._db.query("SELECT template FROM versions WHERE id = ?", (version_id,))
        if not rows:
            raise StoreError(f"no version {version_id} in the store at {self._path}; `tune-prompts store list` shows them")
        return self.decode_template(version_id, rows[0][0])

    def decode_template(self, version_id: int, record: Any) -> Template:
        """Version ``version_id``'s template from its stored record; a record that does not decode is a StoreError."""
        try:
            return Template.from_dict(json.loads(record))
        except DECODE_ERRORS as exc:
            raise damaged(f"version {version_id}", self._path, exc) from None

    def list_versions(self, task: str) -> list[Version]:
        """A task's versions, oldest first; empty for an unknown task."""
        check_name(task, "task name")
        rows = self._db.query(f"SELECT {VERSION_COLUMNS} FROM versions WHERE task = ? ORDER BY id", (task,))
        return [version_from_row(row, self._path) for row in rows]

    def tasks(self) -> list[str]:
        # Sorted here: ORDER BY on text follows the database's collation, which differs between databases.
        return sorted(task for (task,) in self._db.query("SELECT DISTINCT task FROM versions"))

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
        row = conn.execute(f"SELECT {VERSION_COLUMNS} FROM versions WHERE id = ?", (version_id,)).fetchone()
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
        rows = self._db.query(_CURRENT, (task, label))
        return rows[0][0] if rows else None

    def label_state(self, task: str, label: str) -> tuple[int | None, Canary | None, int]:
        """What ``label`` points at now, with the seq of the move that put it there (0: never moved): (version id
        or None, the canary with its share and ramp for label ``canary`` or None, seq). A reader compares the seq
        with the moves it has applied, so that what it reads here and what it has cached belong to one state."""
        check_name(task, "task name")
        check_name(label, "label")
        rows = self._db.query(_CURRENT.replace("SELECT version_id, share, ramp", "SELECT version_id, share, ramp, seq"),
                              (task, label))
        if not rows:
            return None, None, 0
        row = rows[0]
        canary = canary_from_row(task, row, self._path) if label == "canary" and row[0] is not None else None
        return row[0], canary, row[3]

    def get_label(self, task: str, label: str) -> Version | None:
        version_id = self.label_target(task, label)
        return None if version_id is None else self.get_version(version_id)  # versions never change: no race

    def labels(self, task: str) -> dict[str, int]:
        """Every label of ``task`` that points at a version now: label -> version id."""
        check_name(task, "task name")
        rows = self._db.query(
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
            version = version_from_row(self._version_for_task(conn, task, version_id), self._path)
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
            return version_from_row(self._version_for_task(conn, task, stack[-2]), self._path)

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
        rows = self._db.query(_CURRENT, (task, "canary"))
        row = rows[0] if rows else None
        if row is None or row[0] is None:
            return None
        return canary_from_row(task, row, self._path)

    def advance_canary(self, task: str) -> Canary:
        """Move the canary's share to the next step of its ramp."""
        check_name(task, "task name")
        with self._transaction() as conn:
            row = conn.execute(_CURRENT, (task, "canary")).fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"task {task!r} has no canary to advance; start one with set_canary (route --canary)")
            try:
                canary = canary_from_row(task, row, self._path).advance()
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
        return self._db.query("SELECT coalesce(max(seq), 0) FROM label_history")[0][0]

    def label_moves(self, after_seq: int) -> list[tuple[int, str, str, int | None, str | None]]:
        """Every label move newer than seq ``after_seq`` (a ``generation()``), oldest first, as (seq, task, label,
        version id or None where the label was removed, that version's template record for ``decode_template``).
        One range query on the history's key, which finds no rows when nothing moved: readers poll it and update
        their caches in place, and compile a version new to them without asking again."""
        return self._db.query(
            "SELECT h.seq, h.task, h.label, h.version_id, v.template FROM label_history h"
            " LEFT JOIN versions v ON v.id = h.version_id WHERE h.seq > ? ORDER BY h.seq", (after_seq,))

    def check_rows(self) -> list[tuple[str, int, str]]:
        """Every row that breaks its own schema, as (table, version id or history seq, "field: problem"), in table
        and id order; empty for a sound store. Reads every row: for ``store doctor``, not for serving."""
        found = []
        for row in self._db.query(f"SELECT {VERSION_COLUMNS} FROM versions ORDER BY id"):
            try:
                damage = version_from_row(row, self._path).damage
            except StoreError as exc:
                damage = (str(exc).partition(" is damaged (")[2].rpartition("); the store needs repair")[0],)
            found += [("versions", row[0], problem) for problem in damage]
        for row in self._db.query("SELECT seq, task, label, version_id, share, ramp, moved_at FROM label_history ORDER BY seq"):
            found += [("label_history", row[0], problem) for problem in history_damage(row)]
        return found
