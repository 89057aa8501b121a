"""What a store row may hold: the checks on the way in and the decoding, with its damage, on the way out.

Hostile input stops at the API: ids outside 1..2**63-1 and names that are not UTF-8 text are refused
(``check_id``, ``check_name``), and so are figures that are not finite numbers (``finite_figures``). A stored
row that does not decode is a StoreError naming it (``damaged``), and every write refuses until the store is
repaired. A row that decodes but breaks its schema (a non-finite score, a time that is not ISO 8601, control
characters in a name) is read with ``Version.damage`` naming each field: ``store show`` marks it, ``predict``
refuses to serve it, ``check_rows`` (``store doctor``) lists every one. Such rows come from writes outside the
store's code or damage on disk.

Pure: no database here; ``templates/store.py`` reads the rows and hands them to these functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from templates.gate import Decision
from templates.routing import Canary
from templates.store_db import StoreError
from templates.template import Template

MAX_ID = 2**63 - 1  # ids are signed 64-bit integers in both databases
MAX_NAME_CHARS = 200
# The columns of ``versions`` (created in templates/store_db.py) in the order ``version_from_row`` unpacks them.
_COLUMNS = ("id", "task", "content_hash", "template", "parent_id", "run_id", "scores", "latency", "decision", "created_at")
VERSION_COLUMNS = ", ".join(_COLUMNS)


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
DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError)  # json's and TemplateError are ValueErrors


def damaged(what: str, where: str, exc: Exception) -> StoreError:
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


def version_from_row(row: tuple, where: str) -> Version:
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
    except DECODE_ERRORS as exc:
        raise damaged(f"version {id_}", where, exc) from None


def history_damage(row: tuple) -> list[str]:
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


def canary_from_row(task: str, row: tuple, where: str) -> Canary:
    try:
        return Canary(row[0], row[1], tuple(json.loads(row[2])))
    except DECODE_ERRORS as exc:
        raise damaged(f"the canary of {task!r}", where, exc) from None


def finite_figures(figures: Mapping[str, Any], what: str) -> dict[str, float]:
    out = {}
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise StoreError(f"{what}: {name}={value!r} is not a finite number; store only measured figures")
        out[str(name)] = value
    return out

