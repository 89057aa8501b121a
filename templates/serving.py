"""The reader applications use: cached templates by label, sticky canary routing, rendering, prediction.

``predict`` is what production receives: the routed version rendered for one input, the target model's label
log-probs (and, under an answer decision, its greedy answer), and the version's own decision rule applied to
them (the rule, e.g. a threshold fitted on train or the answer's output contract, ships inside the version).
The held-out figures a version records were computed the same way.

Two caches. Compiled templates are kept by version id for the reader's lifetime: versions never
change, so these never go stale, and a promotion or rollback to a version the reader has seen
costs no recompiling. Which version each label (and the canary) points at is kept per task and
label, and updated from the store's label history.

Freshness: a watcher thread (the default) or, with ``watch=False``, each access at most once every
``refresh_s`` (monotonic clock) asks for the label moves newer than the newest the reader has seen
(``TemplateStore.label_moves``: one range query on the history's key, which finds no rows when nothing
moved) and applies them in order. A cached
label takes its new version id, and a version new to the reader is compiled from the template
record that came with the move, so the first lookup after a move makes no further query; a moved
canary is read again, with its share and ramp, when next asked for; labels the reader has not
been asked for are left alone. Between checks a lookup is a clock read and two dict lookups.

With the watcher, a request never pays for a move: the query and the compiling of a new version run on the
watcher's thread, and the first lookup after a move is a cache hit like any other (``scripts/bench/store.py``
measures both ways). A reader pays one (usually empty) query per ``refresh_s`` for it, busy or idle; with the
default 0.05 s a change is served 0.05 s after its commit at the latest. The watcher is a daemon thread that
ends with ``close()`` or when the reader is garbage; a lookup that finds it more than ``refresh_s`` (at least
0.05 s) late checks by itself, so a reader whose watcher cannot run (a forked child, where threads do not
follow) still sees every change. ``watch=False`` starts no thread: lookups check on access, and a reader
nobody asks queries nothing.

Applying moves rather than dropping the cache is exact: the history is append-only, a label's
current version is its newest row, and writers commit their moves in seq order (each takes the
write lock), so every move not yet applied has a seq above the newest one applied.

A reader never sees a half-written version: every store write is one transaction, and a
reader's query sees the store either before or after it (SQLite's WAL gives each read a snapshot;
PostgreSQL shows each statement only committed rows).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from time import monotonic
from typing import Any

from templates.routing import Canary, takes_canary
from templates.store import StoreError, TemplateStore
from templates.template import Template

_NO_CANARY = Canary(0, 0.0)  # cached for a task without a canary: share 0 routes nobody


class RouteError(StoreError):
    """The task has no template under the label a call asked for (or no production template at all)."""


@dataclass(frozen=True)
class Prediction:
    """One input's result as production receives it, and what it was decided from."""

    label: str | None  # None: the answer broke the version's output contract (``reason`` says how)
    version_id: int
    logprobs: dict[str, float]  # label -> log-probability (normalised over the labels)
    answer: str | None = None  # the raw greedy answer (answer decisions)
    reason: str = ""  # why the answer broke the contract
    value: Any = None  # a generation task's parsed answer (JSON value or matched text); None when broken
    arm: str = ""  # the route that chose the version: the label read, or for a caller key canary or production


@dataclass(frozen=True)
class Call:
    """One call of ``predict_many``: the task, its input values, and a label or a caller key (or neither:
    production)."""

    task: str
    values: Mapping[str, Any]
    label: str | None = None
    key: str | None = None


class TemplateReader:
    """Read-only, cached access to a store's labelled templates; safe to share between threads.

    Create it after forking worker processes: a database connection must not cross a fork.
    """

    def __init__(self, store_url: str, refresh_s: float = 0.05, *, watch: bool = True,
                 busy_timeout_s: float = 5.0) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s={refresh_s} must be > 0 seconds, e.g. 0.05")
        self._store = TemplateStore(store_url, busy_timeout_s=busy_timeout_s, create=False)
        self._refresh_s = refresh_s
        # With a watcher, lookups check by themselves only once it is this late (a dead or starved watcher).
        self._slack_s = max(refresh_s, 0.05) if watch else 0.0
        self._next_check_s = 0.0  # monotonic time of the next check for label moves
        self._seen_seq: int | None = None  # the newest label move applied to the caches
        self._compiled: dict[int, Template] = {}  # version id -> template; never stale
        self._damage: dict[int, tuple[str, ...]] = {}  # version id -> what breaks its row's schema; never stale
        self._label_ids: dict[tuple[str, str], int] = {}  # (task, label) -> version id; updated on a move
        self._canaries: dict[str, Canary] = {}  # task -> canary or _NO_CANARY; dropped when it moves
        # Refreshes and loads take the lock so that a load begun before a move cannot put its
        # stale result into the cache after the refresh applied the move. Cached lookups do not take it.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if watch:
            self._refresh()
            self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, refresh_s),
                                             name="TemplateReader-watch", daemon=True)
            self._watcher.start()

    def get(self, task: str, label: str = "production") -> Template:
        """The template ``label`` points at for ``task``."""
        return self._template(self._label_version(task, label))

    def for_caller(self, task: str, key: str) -> Template:
        """The production or canary template for this caller, by sticky routing on ``key``."""
        return self._template(self._caller_version(task, key)[0])

    def version(self, version_id: int) -> Template:
        """The template of one version (what ``route`` named), compiled once for the reader's lifetime."""
        return self._template(version_id)

    def render(self, task: str, values: Mapping[str, Any], *, label: str | None = None, key: str | None = None) -> str:
        """Render the template for a label (default production) or, given ``key``, for that caller."""
        return self._template(self.route(task, label, key)[0]).render(values)

    def route(self, task: str, label: str | None = None, key: str | None = None) -> tuple[int, str]:
        """The version id a call reads and its arm: ``label`` (default production), or for a caller ``key`` the
        canary or production by sticky routing."""
        if label is not None and key is not None:
            raise ValueError("pass label or key, not both")
        if key is None:
            label = label or "production"
            return self._label_version(task, label), label
        version_id, canary = self._caller_version(task, key)
        return version_id, "canary" if canary else "production"

    def predict(self, task: str, values: Mapping[str, Any], target, *, label: str | None = None,
                key: str | None = None) -> Prediction:
        """Render the routed version for ``values``, ask ``target`` for the label log-probs (and the greedy answer
        under an answer decision) and apply the version's decision. ``target``: a label scorer of the model the
        version was tuned for, with ``score(template, texts)``, ``answer(...)`` and ``verbalizers`` (``pipelines.engine.endpoints.make_label_scorer`` makes
        one for a loaded model or an OpenAI-compatible endpoint)."""
        (result,) = self.predict_many([Call(task, values, label, key)], target)
        if isinstance(result, Exception):
            raise result
        return result

    def predict_many(self, calls: Sequence["Call"], target) -> list["Prediction | Exception"]:
        """``predict`` for many calls at once, each its own result or the exception it raised (a missing label, an
        input that breaks a constraint, a damaged version, the model failing). Calls routed to the same version
        go to the target together, in one ``score`` (and ``answer``) call with the prompt before the input shared:
        the gateway's dynamic batches come through here. ``target``: a scorer, as ``predict`` takes it, or a
        function ``(task, template) -> scorer`` for calls of several tasks or label words."""
        results: list[Prediction | Exception | None] = [None] * len(calls)
        groups: dict[int, list[tuple[int, str, str]]] = {}  # version id -> [(call index, arm, input text)]
        for i, call in enumerate(calls):
            try:
                version_id, arm = self.route(call.task, call.label, call.key)
                self._check_sound(version_id)
                template = self._template(version_id)
                if template.decision is None:
                    raise StoreError(f"version {version_id} of {call.task!r} carries no decision rule (it was stored "
                                     "without one): evaluate it again and store the result, e.g. with a tuning run "
                                     "into this store")
                template.render(call.values)  # refuses missing, unknown or constraint-breaking values first
                _, span = template.input_frame()  # several inputs: the model sees the frame with their span in it
                groups.setdefault(version_id, []).append((i, arm, span.render(call.values)))
            except Exception as exc:  # noqa: BLE001 - this call's own result; the others go on
                results[i] = exc
        for version_id, members in groups.items():
            template = self._template(version_id)
            try:
                scorer = target(calls[members[0][0]].task, template) if _is_target_for(target) else target
                decided: list[Prediction | Exception] = list(_decide(template, version_id, [t for _, _, t in members],
                                                                     scorer))
            except Exception as exc:  # noqa: BLE001 - the model failed: every call of the group gets the error
                decided = [exc] * len(members)
            for (i, arm, _), result in zip(members, decided):
                results[i] = result if isinstance(result, Exception) else replace(result, arm=arm)
        return [r if r is not None else RuntimeError("no result") for r in results]

    def task_state(self, task: str) -> dict:
        """The task as the store holds it now (read from the store, not the caches): its versions, where each
        label points, and the canary's version, share and ramp. What a gateway's ``GET /v1/tasks/TASK`` shows."""
        versions = self._store.list_versions(task)
        labels = self._store.labels(task)
        canary = self._store.canary(task)
        return {
            "task": task,
            "versions": [{"id": v.id, "parent": v.parent_id, "created_at": v.created_at, "run": v.run_id,
                          "promoted_by_gate": None if v.decision is None else v.decision.promote,
                          "test": v.scores.get("test", {}), "damaged": bool(v.damage)} for v in versions],
            "labels": labels,
            "canary": None if canary is None else {"version": canary.version_id, "share": canary.share,
                                                   "ramp": list(canary.ramp)},
        }

    def _check_sound(self, version_id: int) -> None:
        """Refuse to serve a version whose row breaks its schema (a NaN score, a bad time, a name with control
        characters): it was written outside the store's code or damaged, so its decision cannot be trusted either.
        One query per version the reader predicts with; versions never change, so the answer is kept."""
        damage = self._damage.get(version_id)
        if damage is None:
            damage = self._damage[version_id] = self._store.get_version(version_id).damage
        if damage:
            raise StoreError(f"version {version_id} is damaged ({'; '.join(damage)[:200]}): predict does not serve it; "
                             "`tune-prompts store doctor` lists every damaged row: restore the store from a backup "
                             "or promote a sound version")

    def _label_version(self, task: str, label: str) -> int:
        if monotonic() >= self._next_check_s:
            self._refresh()
        version_id = self._label_ids.get((task, label))
        if version_id is None:
            version_id, _ = self._read_label(task, label)
            if version_id is None:
                raise RouteError(
                    f"task {task!r} has no {label!r} template; its labels are "
                    f"{sorted(self._store.labels(task)) or 'none'}: promote a version "
                    f"(tune-prompts store promote {task} VERSION) or pick another label"
                )
        return version_id

    def _read_label(self, task: str, label: str) -> tuple[int | None, Canary | None]:
        """A label (or the canary) read from the store into the cache, as of the moves the reader has applied.

        Read alone, it could be newer than the cached labels (a promotion committed after the reader's last
        check, not yet applied to the cached production): a caller would then get the canary of one state and the
        production of another. So a read whose move the reader has not applied yet applies the moves first and
        reads again; what is cached then belongs to the state the caches show."""
        for _ in range(10):
            if self._seen_seq is None:
                self._refresh()
            with self._lock:
                version_id, canary, seq = self._store.label_state(task, label)
                if seq <= (self._seen_seq or 0):
                    if label == "canary":
                        self._canaries[task] = canary or _NO_CANARY
                    elif version_id is not None:
                        self._label_ids[(task, label)] = version_id
                    return version_id, canary
            self._refresh()  # a move newer than the caches: apply it (and any before it), then read again
        raise StoreError(f"the store's labels of {task!r} kept moving while this reader read them (10 tries): "
                         "retry, or move labels less often than refresh_s")

    def _caller_version(self, task: str, key: str) -> tuple[int, bool]:
        if monotonic() >= self._next_check_s:
            self._refresh()
        canary = self._canaries.get(task)
        if canary is None:
            canary = self._read_label(task, "canary")[1] or _NO_CANARY
        # The canary row carries its version id with its share, so the two always belong together.
        if canary.share and takes_canary(task, key, canary.share):
            return canary.version_id, True
        return self._label_version(task, "production"), False

    def _template(self, version_id: int) -> Template:
        return self._compiled.get(version_id) or self._compile(version_id)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self._store.busy_timeout_s + 1)
        self._store.close()

    def _refresh(self) -> None:
        with self._lock:
            if self._seen_seq is None:  # the first check, before anything is cached
                self._seen_seq = self._store.generation()
            else:
                for seq, task, label, version_id, record in self._store.label_moves(self._seen_seq):
                    # Only what is cached is updated; other labels are read when first asked for.
                    if (task, label) in self._label_ids:
                        if version_id is not None and version_id not in self._compiled:
                            try:
                                self._compiled[version_id] = self._store.decode_template(version_id, record)
                            except StoreError:  # a damaged record: forgotten, so that the label's next
                                version_id = None  # lookup reads it again and raises the error naming it
                        if version_id is None:
                            del self._label_ids[task, label]
                        else:
                            self._label_ids[task, label] = version_id
                    if label == "canary":
                        self._canaries.pop(task, None)
                    self._seen_seq = seq
            self._next_check_s = monotonic() + self._refresh_s + self._slack_s

    def _compile(self, version_id: int) -> Template:
        # No lock: two threads compiling the same immutable version store equal values.
        template = self._store.get_template(version_id)
        self._compiled[version_id] = template
        return template


def _watch(ref: "weakref.ref[TemplateReader]", stop: threading.Event, refresh_s: float) -> None:
    """The watcher thread: apply the store's label moves every ``refresh_s`` (at least 1 ms) until ``stop`` is
    set or the reader is garbage. It holds the reader only while it checks, so an abandoned reader is freed."""
    while not stop.wait(max(refresh_s, 0.001)):
        reader = ref()
        if reader is None:
            return
        try:
            reader._refresh()
        except Exception:  # noqa: BLE001 - a failed check leaves the reader late, so its lookups check by
            pass  # themselves and raise the error (a locked or unreachable store, a damaged row) to the caller
        del reader


def _is_target_for(target) -> bool:
    """Whether ``predict_many``'s ``target`` is a function ``(task, template) -> scorer`` rather than a scorer (which
    has ``score``, or for generation tasks only ``answer``)."""
    return callable(target) and not hasattr(target, "score") and not hasattr(target, "answer")


def _decide(template: Template, version_id: int, texts: list[str], target) -> list[Prediction | Exception]:
    """The version's decision on the input texts of one group: one call to the target for all of them."""
    rule = template.decision
    assert rule is not None  # predict_many refused versions without one
    frame, _ = template.input_frame()
    if rule.kind == "answer" and not rule.labels:  # a generation task: the parsed answer is the result
        answers = target.answer(frame, texts, rule.max_new_tokens, rule.contract.complete)
        out: list[Prediction | Exception] = []
        for answer in answers:
            parsed = rule.parse(answer.text, truncated=answer.truncated)
            out.append(Prediction(None, version_id, {}, answer.text, parsed.reason, parsed.value if parsed.ok else None))
        return out
    if list(getattr(target, "verbalizers", ())) != list(rule.verbalizers):
        raise ValueError(f"the target scorer answers {list(getattr(target, 'verbalizers', ()))}; version "
                         f"{version_id} decides on {list(rule.verbalizers)}: build the scorer with those words")
    if rule.kind == "answer":
        answers = target.answer(frame, texts, rule.max_new_tokens, rule.contract.complete)
        rows = target.score(frame, texts)  # in-process: cached by the answers' first pass
        out = []
        for answer, row in zip(answers, rows):
            parsed = rule.parse(answer.text, truncated=answer.truncated)
            out.append(Prediction(parsed.value if parsed.ok else None, version_id,
                                  dict(zip(rule.labels, map(float, row))), answer.text, parsed.reason))
        return out
    return [Prediction(rule.decide(row), version_id, dict(zip(rule.labels, map(float, row))))
            for row in target.score(frame, texts)]
