"""The reader applications use: cached templates by label, sticky canary routing, rendering.

Freshness: on access, at most once every ``refresh_s`` (monotonic clock), the reader asks the
store for its change counter (one indexed ``max(seq)`` query, a few microseconds) and drops its
cache when the counter moved. Between checks a lookup is a clock read and a dict lookup. This
was chosen over a background thread because it needs no thread lifecycle or shutdown, costs
nothing for an idle reader, and a reader that is not being asked has nobody to serve stale
templates to; with the default 0.2 s a change is visible within 0.2 s plus one query.

A reader never sees a half-written version: every store write is one transaction, and a
reader's query sees the store either before or after it (WAL gives readers a snapshot).
"""

from __future__ import annotations

import threading
from time import monotonic
from typing import Any, Mapping

from templates.routing import takes_canary
from templates.store import StoreError, TemplateStore
from templates.template import Template

class TemplateReader:
    """Read-only, cached access to a store's labelled templates; safe to share between threads."""

    def __init__(self, store_url: str, refresh_s: float = 0.2, *, busy_timeout_s: float = 5.0) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s={refresh_s} must be > 0 seconds, e.g. 0.2")
        self._store = TemplateStore(store_url, busy_timeout_s=busy_timeout_s, create=False)
        self._refresh_s = refresh_s
        self._next_check_s = 0.0  # monotonic time of the next change-counter check
        self._generation: int | None = None
        self._templates: dict[tuple[str, str], Template] = {}  # (task, label) -> compiled template
        self._canaries: dict[str, tuple[float, Template | None]] = {}  # task -> (canary share, canary template)
        # Refreshes and loads take the lock so that a load begun before a change cannot put its
        # stale result into the cache after the refresh emptied it. Cached lookups do not take it.
        self._lock = threading.Lock()

    def get(self, task: str, label: str = "production") -> Template:
        """The template ``label`` points at for ``task``."""
        if monotonic() >= self._next_check_s:
            self._refresh()
        template = self._templates.get((task, label))
        if template is None:
            template = self._load(task, label)
        return template

    def for_caller(self, task: str, key: str) -> Template:
        """The production or canary template for this caller, by sticky routing on ``key``."""
        if monotonic() >= self._next_check_s:
            self._refresh()
        canary = self._canaries.get(task)
        if canary is None:
            with self._lock:
                state = self._store.canary(task)
                # By version id, not by label: versions never change, so the share and the template
                # cached here always belong together even if the canary moves meanwhile.
                canary = (state.share, self._store.get_version(state.version_id).template) if state else (0.0, None)
                self._canaries[task] = canary
        share, template = canary
        if template is not None and takes_canary(task, key, share):
            return template
        return self.get(task)

    def render(self, task: str, values: Mapping[str, Any], *, label: str | None = None, key: str | None = None) -> str:
        """Render the template for a label (default production) or, given ``key``, for that caller."""
        if label is not None and key is not None:
            raise ValueError("render: pass label or key, not both")
        template = self.for_caller(task, key) if key is not None else self.get(task, label or "production")
        return template.render(values)

    def close(self) -> None:
        self._store.close()

    def _refresh(self) -> None:
        with self._lock:
            generation = self._store.generation()
            if generation != self._generation:
                # New dicts rather than clear(): a lookup running now keeps a consistent old one.
                self._templates, self._canaries = {}, {}
                self._generation = generation
            self._next_check_s = monotonic() + self._refresh_s

    def _load(self, task: str, label: str) -> Template:
        with self._lock:
            version = self._store.get_label(task, label)
            if version is None:
                known = self._store.labels(task)
                raise StoreError(
                    f"task {task!r} has no {label!r} template; its labels are {sorted(known) or 'none'}: "
                    f"promote a version (tune-prompts store promote {task} VERSION) or pick another label"
                )
            self._templates[(task, label)] = version.template
            return version.template
