"""Drift check: does the task's production template still clear its bars on fresh data?

``tune-prompts check`` loads the template the store labels ``production``, evaluates it with
``CandidateScorer.evaluate`` on a split that tuning never read (the test split by default: it stands for
fresh data; point the task's ``data.source`` at newly labelled data to check on that), and compares:

* each of the task's promotion thresholds (``promotion.thresholds``: reward component -> minimum), the same
  bars a candidate had to clear to become production: for risk the instruction-following and
  entity-consistency rates of the target's answers on this split (0.82 / 0.78; entity swaps on the inputs
  within ``scoring.entity_tokens``, all of them for risk), so a model or data change
  that breaks the answer format or the decision's stability shows here;
* the held-out metric (``scoring.metric``, balanced accuracy for risk) under the version's production decision,
  against a bar: ``--min-metric`` if given, else the figure the store recorded for this version on its test
  split minus ``--max-drop``; without a bar (no recorded figure and no ``--min-metric``) it is reported and not
  checked.

``compare`` is the pure part (figures and bars in, one row per bar out); ``check_production`` does the I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

from pipelines.config import FlagSettings, TaskConfig
from templates.store import StoreError, TemplateStore, Version

DEFAULT_MAX_DROP = FlagSettings.model_fields["max_drop"].default


@dataclass(frozen=True)
class Bar:
    name: str
    value: float | None  # None: not measured (e.g. the judge abstained)
    minimum: float | None  # None: no bar; reported, not checked
    passed: bool | None  # None when there is no bar


def compare(values: Mapping[str, float | None], minimums: Mapping[str, float | None]) -> list[Bar]:
    """One row per bar, in the order given. A missing or NaN figure fails its bar; a None bar is not checked."""
    rows = []
    for name, minimum in minimums.items():
        value = values.get(name)
        if value is not None and not math.isfinite(value):
            value = None
        if minimum is None:
            rows.append(Bar(name, value, None, None))
        else:
            rows.append(Bar(name, value, minimum, value is not None and value >= minimum))
    return rows


def held_out(rows: list[Bar]) -> bool:
    """Every bar that was checked holds."""
    return all(row.passed is not False for row in rows)


def production_version(store_url: str, task: str) -> Version:
    """The task's production version; a missing store or label is a StoreError that says what to do."""
    with TemplateStore(store_url, create=False) as store:
        version = store.get_label(task, "production")
    if version is None:
        raise StoreError(f"task {task!r} has no production template in the store at {store_url}: "
                         f"run `tune-prompts --task {task}` to tune and promote one, or `tune-prompts store promote`")
    return version


def metric_bar(task: TaskConfig, version: Version, min_metric: float | None, max_drop: float) -> float | None:
    if min_metric is not None:
        return min_metric
    recorded = (version.scores or {}).get("test", {}).get(task.scoring.metric)
    return None if recorded is None else recorded - max_drop


def check_production(task: TaskConfig, scorer, store_url: str, *, split: str = "test",
                     min_metric: float | None = None, max_drop: float = DEFAULT_MAX_DROP) -> dict:
    """Evaluate the production template and compare it with its bars; a JSON-ready report."""
    version = production_version(store_url, task.name)
    ev = scorer.evaluate(version.template.text, split)
    m = ev.measured
    values: dict[str, float | None] = {**m.metrics, **m.judge, **ev.reward.components}
    minimums: dict[str, float | None] = dict(task.promotion_config().thresholds)
    minimums[task.scoring.metric] = metric_bar(task, version, min_metric, max_drop)
    rows = compare(values, minimums)
    if not m.valid:  # a template that no longer validates (e.g. the task's token budget shrank) fails outright
        rows.append(Bar("valid", 0.0, 1.0, False))
    return {
        "task": task.name,
        "version": version.id,
        "store": store_url,
        "split": split,
        "examples": ev.n_examples,
        "template": m.template,
        "recorded_test": {k: v for k, v in (version.scores or {}).get("test", {}).items()},
        "bars": [asdict(row) for row in rows],
        "passed": held_out(rows),
        "invalid_reasons": list(m.reasons),
    }
