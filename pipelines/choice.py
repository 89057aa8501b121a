"""The choice: which candidate, if any, goes to the held-out test. The gate's own rules, read on dev, seed included.

A run ends by evaluating the seed and its shortlisted candidates on the whole dev split exactly as the test
will (``CandidateScorer.evaluate``: the production decision fitted on train, every rate, latency), then:

1. **Feasible first.** Each candidate goes through the promotion gate itself (``templates.gate.decide``) on its
   dev figures against the seed's, with bars tightened by the task's ``selection`` margins: a rate must clear
   its threshold by ``rate_margin``; latency by a confidence bound (``latency_bound``): the candidate and the
   seed answered the same dev requests interleaved, and the one-sided upper bound (at ``selection.alpha``) of
   the median of their per-request ratios must stay under the gate's own ceiling (1 +
   ``promotion.max_latency_p95_increase``). A candidate the gate would refuse on dev is not chosen, however
   high its reward.
2. **It must beat the seed.** A paired bootstrap over the dev examples (both templates answered the same
   examples) gives the gain on the gate's metric and a one-sided p-value; a candidate goes on only when
   ``p < selection.alpha`` (and its gain clears ``promotion.min_improvement``, one of the gate's bars).
3. **The best, or the shortest of those tied with it.** Among the eligible, the best by the gate's metric;
   with ``prefer_shorter``, the one with the fewest template tokens among those the same paired test cannot
   tell from the best.

When no candidate is eligible the seed stays: ``Choice.chosen`` is None and ``Choice.verdict`` says why, naming
the best candidate's missed bars. Everything here is pure: evaluations in, a choice and its report out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipelines.config import TaskConfig
from pipelines.generation import instruction_of
from pipelines.promotion import measurements, record
from rewards import promptbench_metrics as pbm
from templates.gate import Decision, PromotionConfig, decide

NO_WINNER = "no candidate beat the seed on dev; production unchanged"


@dataclass(frozen=True)
class Paired:
    """A candidate's gain over the seed on the gate's metric, on the same dev examples."""

    gain: float  # on all of them
    lower: float  # the one-sided lower confidence bound at the selection's alpha
    p_value: float  # the share of resamples where the gain is <= 0


@dataclass
class Choice:
    chosen: str | None  # the template text that goes to test; None: the seed stays
    verdict: str  # one plain line
    metric: str  # the gate's metric, the one the rows are ranked by
    rows: list[dict] = field(default_factory=list)  # the seed and every shortlisted candidate, ranked, best first

    def as_dict(self) -> dict:
        return {"chosen": self.chosen, "verdict": self.verdict, "ranking": self.rows,
                "front": pareto_front(self.rows, self.metric)}


def dev_bars(task: TaskConfig) -> PromotionConfig:
    """The gate's bars as the choice reads them on dev: each threshold raised by ``rate_margin``; the latency
    ceiling is the gate's own, read against a confidence bound (``latency_bound``)."""
    config, sel = task.promotion_config(), task.selection
    return dataclasses.replace(config, thresholds={k: v + sel.rate_margin for k, v in config.thresholds.items()})


@dataclass(frozen=True)
class LatencyBound:
    """How much slower a candidate's requests are than the seed's, from requests timed in pairs on dev."""

    ratio: float  # the median of the per-request ratios candidate / seed
    upper: float  # its one-sided upper confidence bound at the selection's alpha (bootstrap over the pairs)
    pairs: int  # requests both answered


def latency_bound(task: TaskConfig, candidate, seed) -> LatencyBound | None:
    """The candidate's latency over the seed's, request by request: both answered the same dev inputs, their
    requests interleaved (``CandidateScorer.latencies``), so the ratio of a pair cancels the input's own length
    and the machine's drift. The gate compares p95s on test, the longest inputs, where a template's extra tokens
    weigh least: the median ratio over all inputs is the larger of the two, so bounding it is the cautious side.
    None when there are no paired requests (not timed together, or every request failed)."""
    c = np.asarray(candidate.latency.samples_ms if candidate.latency else (), dtype=float)
    s = np.asarray(seed.latency.samples_ms if seed.latency else (), dtype=float)
    if len(c) == 0 or len(c) != len(s):
        return None
    ok = np.isfinite(c) & np.isfinite(s) & (s > 0)
    if not ok.any():
        return None
    ratios = c[ok] / s[ok]
    rng = np.random.default_rng(int(hashlib.sha256(f"{task.name}:{task.ppo.seed}:latency".encode()).hexdigest()[:8], 16))
    medians = np.median(ratios[rng.integers(0, len(ratios), size=(task.selection.bootstrap, len(ratios)))], axis=1)
    return LatencyBound(float(np.median(ratios)), float(np.quantile(medians, 1 - task.selection.alpha)), int(ok.sum()))


def _dev_measurements(ev, metric: str, latency_ratio: float | None = None):
    """What the gate reads, from a dev evaluation. Latency in units of the seed's: the seed reads 1 and a
    candidate its ``latency_bound`` upper bound (NaN without one, which fails the bar)."""
    scores, latency = record(ev)
    ratio = 1.0 if latency_ratio is None else latency_ratio
    return measurements({"test": scores[ev.split]}, {**latency, "latency_p95_ms": ratio}, metric)


def _on_dev(decision: Decision, task: TaskConfig, bound: LatencyBound | None = None, seed: bool = False) -> Decision:
    """The gate's reasons, with its latency line saying what the choice compared on dev."""
    ceiling = 1 + task.promotion.max_latency_p95_increase
    reasons = []
    for r in decision.reasons:
        if "latency_p95_ms" in r:
            ok = r.startswith("pass")
            if seed:
                r = "pass: latency: the seed is what candidates are timed against"
            elif bound is None:
                r = "fail: latency: not timed beside the seed on dev"
            else:
                r = (f"{'pass' if ok else 'fail'}: latency: upper {1 - task.selection.alpha:.0%} bound of the median "
                     f"per-request ratio to the seed over {bound.pairs} paired dev requests {bound.upper:.3f} "
                     f"{'<=' if ok else '>'} {ceiling:.3g} (median {bound.ratio:.3f})")
        reasons.append(r)
    return Decision(decision.promote, tuple(reasons))


def metric_on(task: TaskConfig, outcomes, rows: np.ndarray) -> np.ndarray:
    """The gate's metric of one template on each resample (``rows``: resamples x examples, indices)."""
    metric = task.scoring.metric
    if "scores" in outcomes:  # a generation task's per-answer scores: the metric is their mean
        return np.asarray(outcomes["scores"], dtype=float)[rows].mean(axis=1)
    labels = list(task.labels)
    gold = np.array([labels.index(g) for g in outcomes["gold"]])
    decided = np.array([labels.index(d) if d is not None else -1 for d in outcomes["decided"]])
    g, d = gold[rows], decided[rows]
    if metric == "balanced_accuracy":  # vectorized: the mean recall over the labels present in the resample
        recalls = []
        for c in range(len(labels)):
            support = (g == c).sum(axis=1)
            hit = ((g == c) & (d == c)).sum(axis=1)
            recalls.append(np.where(support > 0, hit / np.maximum(support, 1), np.nan))
        return np.nanmean(np.vstack(recalls), axis=0)
    if metric == "accuracy":
        return (g == d).mean(axis=1)
    out = []
    logprobs = np.asarray(outcomes.get("logprobs")) if outcomes.get("logprobs") is not None else None
    for r in rows:  # macro_f1, roc_auc: the metric's own code, one resample at a time
        preds = [labels[i] if i >= 0 else None for i in decided[r]]
        gold_r = [labels[i] for i in gold[r]]
        out.append(pbm.classification_metrics(preds, gold_r, labels, None if logprobs is None else logprobs[r])[metric])
    return np.asarray(out, dtype=float)


def paired_gain(task: TaskConfig, candidate, seed, *, rows: np.ndarray | None = None) -> Paired:
    """The paired bootstrap of ``metric(candidate) - metric(seed)`` over the examples both answered."""
    n = len(next(iter(seed.measured.outcomes.values())))
    if rows is None:
        rows = resamples(task, n)
    full = np.arange(n)[None, :]
    gain = float(metric_on(task, candidate.measured.outcomes, full)[0] - metric_on(task, seed.measured.outcomes, full)[0])
    diffs = metric_on(task, candidate.measured.outcomes, rows) - metric_on(task, seed.measured.outcomes, rows)
    return Paired(gain, float(np.quantile(diffs, task.selection.alpha)), float(np.mean(diffs <= 0)))


def resamples(task: TaskConfig, n: int) -> np.ndarray:
    """The bootstrap's resamples of ``n`` examples, seeded by the task (the same for every candidate)."""
    seed = int(hashlib.sha256(f"{task.name}:{task.ppo.seed}:{n}".encode()).hexdigest()[:8], 16)
    return np.random.default_rng(seed).integers(0, n, size=(task.selection.bootstrap, n))


def metric_interval(task: TaskConfig, outcomes, level: float = 0.95) -> list[float] | None:
    """The percentile bootstrap interval ``[low, high]`` of the gate's metric over one template's examples (its
    ``Measured.outcomes``), e.g. for the run report; None without them (an invalid template)."""
    if not outcomes:
        return None
    values = metric_on(task, outcomes, resamples(task, len(next(iter(outcomes.values())))))
    low, high = np.nanquantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(low), float(high)]


def _row(task: TaskConfig, ev, name: str, decision: Decision | None, paired: Paired | None) -> dict:
    r = ev.as_record()
    metric = task.scoring.metric
    return {"name": name, "template": r["template"], "instruction": instruction_of(task, r["template"]),
            "valid": r["valid"], "tokens": r["template_tokens"], metric: r["metrics"].get(metric),
            **{k: r["reward"]["components"].get(k) for k in task.promotion.thresholds},
            "latency_p95_ms": r["latency_ms"].get("p95"),
            "gain": paired.gain if paired else None, "gain_lower": paired.lower if paired else None,
            "p_value": paired.p_value if paired else None,
            "bars": list(decision.reasons) if decision else ["fail: invalid template"],
            "feasible": bool(decision and decision.promote), "beats_seed": False, "chosen": False}


def choose(task: TaskConfig, seed, candidates: Sequence) -> Choice:
    """The choice among ``candidates`` (dev ``Evaluation``s) against ``seed`` (the seed's, on the same split)."""
    sel, metric = task.selection, task.scoring.metric
    bars = dev_bars(task)
    seed_row = _row(task, seed, "seed", _on_dev(decide(_dev_measurements(seed, metric), None, bars), task, seed=True),
                    None)
    seed_row["feasible"] = None  # production already: it is compared with, not gated
    if not candidates:
        return Choice(None, f"{NO_WINNER} (the run has no valid candidate)", metric, [seed_row])
    rows, evs = [], {}
    n = len(next(iter(seed.measured.outcomes.values())))
    idx = resamples(task, n)
    for i, ev in enumerate(candidates, 1):
        if not ev.measured.valid:
            rows.append(_row(task, ev, f"candidate {i}", None, None))
            continue
        bound = latency_bound(task, ev, seed)
        measured = _dev_measurements(ev, metric, bound.upper if bound else float("nan"))
        decision = _on_dev(decide(measured, _dev_measurements(seed, metric), bars), task, bound)
        row = _row(task, ev, f"candidate {i}", decision, paired_gain(task, ev, seed, rows=idx))
        row["latency_ratio"], row["latency_ratio_upper"] = (bound.ratio, bound.upper) if bound else (None, None)
        row["beats_seed"] = row["p_value"] < sel.alpha
        row["bars"].append(f"{'pass' if row['beats_seed'] else 'fail'}: paired bootstrap over {n} dev examples: gain "
                           f"{row['gain']:+.4g}, p {row['p_value']:.3g} {'<' if row['beats_seed'] else '>='} "
                           f"{sel.alpha:g} (lower bound {row['gain_lower']:+.4g})")
        rows.append(row)
        evs[row["name"]] = ev
    eligible = [r for r in rows if r["feasible"] and r["beats_seed"]]
    eligible.sort(key=lambda r: -r[metric])
    if eligible:
        best = eligible[0]
        pick = best
        if sel.prefer_shorter:
            tied = [best] + [r for r in eligible[1:]
                             if paired_gain(task, evs[best["name"]], evs[r["name"]], rows=idx).p_value >= sel.alpha]
            pick = min(tied, key=lambda r: (r["tokens"], -r[metric]))
        pick["chosen"] = True
        shorter = f", the shortest of {len(tied)} tied with the best" if sel.prefer_shorter and pick is not best else ""
        verdict = (f"chose {pick['name']} on dev{shorter}: {metric} {pick[metric]:.3f} vs seed {seed_row[metric]:.3f} "
                   f"(gain {pick['gain']:+.3f}, p {pick['p_value']:.3g}), every gate bar met with the selection's margins")
    else:
        pick = None
        closest = max((r for r in rows if r["valid"]), key=lambda r: (r["feasible"], r["beats_seed"], r[metric] or 0),
                      default=None)
        if closest is None:
            verdict = f"{NO_WINNER} (no shortlisted candidate was valid)"
        else:
            missed = "; ".join(b[len("fail: "):] for b in closest["bars"] if b.startswith("fail:"))
            verdict = f"{NO_WINNER} (best candidate, {closest['name']}, missed: {missed})"
    ranked = sorted(rows, key=lambda r: (not r["chosen"], not (r["feasible"] and r["beats_seed"]), not r["feasible"],
                                         -(r[metric] if r[metric] is not None else -1)))
    return Choice(pick["template"] if pick else None, verdict, metric, ranked + [seed_row])


def pareto_front(rows: Sequence[dict], metric: str) -> list[dict]:
    """The templates no other beats on both ``metric`` and the token count (the metric against tokens)."""
    points = [r for r in rows if r.get("valid") and r.get(metric) is not None and r.get("tokens") is not None]
    front = [r for r in points if not any(o[metric] >= r[metric] and o["tokens"] <= r["tokens"] and
                                          (o[metric] > r[metric] or o["tokens"] < r["tokens"]) for o in points)]
    return [{"name": r["name"], "tokens": r["tokens"], metric: r[metric]} for r in sorted(front, key=lambda r: r["tokens"])]
