"""Promotion bookkeeping: the seed and the chosen candidate go into the store with the gate's decision.

Each version is stored with its production decision (``templates.decision.DecisionRule``, e.g. the threshold
fitted on train), so the figures it records are the ones an application reproduces through
``TemplateReader.predict``.

The gate (``templates.gate.decide``) is a pure function of ``Measurements``. A version's record in the store
holds exactly what the gate reads: ``record`` writes it from an evaluation and ``measurements`` reads it back,
and the candidate is judged from its own record too. So the incumbent's stored figures and a new candidate's
fresh ones reach the gate through the same function.
"""

from __future__ import annotations

import dataclasses
import math

from pipelines.config import TaskConfig
from pipelines.scoring import Evaluation
from templates.gate import Decision, Measurements, decide
from templates.store import TemplateStore
from templates.template import Template

SEED_REASON = "pass: seed template, registered as the first production version"


def record(ev: Evaluation) -> tuple[dict, dict]:
    """The store's ``scores`` and ``latency`` for an evaluated template (its held-out figures). A figure that was
    not measured (no latency; NaN where every probe request failed or a metric is undefined) is left out: the
    store keeps measured figures only, and the gate reads a missing one as failing its bar."""
    r = ev.as_record()
    test = {**r["metrics"], **{k: v for k, v in r["reward"]["components"].items() if v is not None},
            "total_reward": r["reward"]["total"]}
    latency = {"template_tokens": r["template_tokens"], "latency_p50_ms": r["latency_ms"].get("p50"),
               "latency_p95_ms": r["latency_ms"].get("p95"), "render_us_p99": r["render_us_p99"],
               "error_rate": r["request_error_rate"]}
    return {r["split"]: _measured(test)}, _measured(latency)


def _measured(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def shipped(task: TaskConfig, ev: Evaluation) -> Template:
    """The template an application gets: the evaluated text with the decision its figures were measured under."""
    return dataclasses.replace(task.make_template(ev.measured.template), decision=ev.decision)


def measurements(scores: dict, latency: dict, metric: str) -> Measurements:
    """What the gate reads from a record; a figure that is missing reads as NaN, which fails its bar."""
    test = scores.get("test", {})

    def figure(value) -> float:
        return math.nan if value is None else float(value)

    return Measurements(
        components={k: v for k, v in test.items() if isinstance(v, (int, float))},
        heldout_metric=figure(test.get(metric)), template_tokens=latency.get("template_tokens") or 0,
        latency_p95_ms=figure(latency.get("latency_p95_ms")), error_rate=figure(latency.get("error_rate")),
        render_us_p99=figure(latency.get("render_us_p99")))


def gate(task: TaskConfig, ev: Evaluation, incumbent: Evaluation | None) -> Decision | None:
    """The gate's decision on one evaluated template against an incumbent evaluated in the same run (None: no
    incumbent, so the thresholds, budgets and latency bars alone); None for an invalid template."""
    if not ev.measured.valid:
        return None
    config = task.promotion_config()
    return decide(measurements(*record(ev), config.metric),
                  measurements(*record(incumbent), config.metric) if incumbent is not None else None, config)


def promote(task: TaskConfig, store_url: str, evaluations: list[Evaluation], run_id: str, *, allow: bool = True,
            no_candidate: str | None = None) -> dict:
    """Record the seed (as the first production version, if the task has none) and the first valid candidate
    (``evaluations[0]`` is the seed, the rest are candidates, the one chosen on dev first), with the gate's
    decision; move production to the candidate if the gate says so and ``allow``. ``no_candidate``: why the run
    chose none (then ``evaluations`` holds the seed alone and nothing but the seed may be recorded)."""
    config = task.promotion_config()
    seed_ev, candidates = evaluations[0], evaluations[1:]
    with TemplateStore(store_url) as store:
        incumbent = store.get_label(task.name, "production")
        if incumbent is None:
            scores, latency = record(seed_ev)
            if "latency_p95_ms" not in latency:  # the target answered none of the seed's probe requests
                from pipelines.engine.endpoints import EndpointError

                raise EndpointError(f"the target answered none of the seed's {seed_ev.split} latency probes "
                                    "validly (every one failed or broke the API), so nothing was recorded")
            seed_version = store.add_version(task.name, shipped(task, seed_ev), run_id=run_id, scores=scores,
                                             latency=latency, decision=Decision(True, (SEED_REASON,)))
            incumbent = store.promote(task.name, seed_version.id, force=True)
        valid = [ev for ev in candidates if ev.measured.valid]
        if not valid:
            return {"promoted": False, "reasons": [no_candidate or "no valid candidate"], "production": incumbent.id}
        best = valid[0]  # the one chosen on dev; picking by the test metric too would bias the comparison
        # Production compared as measured in this run where it is the seed (same machine, same moment: fair
        # latency figures), else as stored.
        fresh = incumbent.template.text == seed_ev.measured.template
        incumbent_record = record(seed_ev) if fresh else (incumbent.scores or {}, incumbent.latency or {})
        scores, latency = record(best)
        decision = decide(measurements(scores, latency, config.metric),
                          measurements(*incumbent_record, config.metric), config)
        version = store.add_version(task.name, shipped(task, best), parent_id=incumbent.id,
                                    run_id=run_id, scores=scores, latency=latency, decision=decision)
        if decision.promote and allow:
            store.promote(task.name, version.id)
        production = store.get_label(task.name, "production")
        return {"version": version.id, "promoted": decision.promote and allow, "reasons": list(decision.reasons),
                "production": production.id if production else None}
