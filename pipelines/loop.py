"""The tuning loop: generate -> score -> weight -> update -> keep the best -> (at the end) select, test, gate, store.

``tune`` is one function to read top to bottom. Each step samples candidate instructions from the policy,
scores them on Ray, weighs the components into rewards, updates the policy with OpenRLHF's PPO losses,
keeps a leaderboard, logs to W&B and writes a checkpoint. After the last step the best candidates are
measured again on the whole dev split, the finalists and the seed template are evaluated on the held-out
test split (which tuning never reads), the best finalist by dev reward goes through the promotion gate, and
it is recorded in the template store.

Repeatability: sampling, PPO minibatch order and the data splits are seeded, so a run with the same seed,
settings and machine repeats. Not repeatable across machines or thread counts: CPU matrix products round
differently, which can change a sampled token and from there the whole run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pipelines.config import TaskConfig
from pipelines.data import load_splits
from pipelines.generation import candidate_text, instruction_of, meta_prompt
from rewards.components import components_for
from rewards.weighting import check_weights, weigh


@dataclass(frozen=True)
class RunOptions:
    steps: int = 4
    policy_model: str = "embedded:smollm2-135m-instruct"
    target_model: str = "embedded:smollm2-135m-instruct"
    judge_model: str | None = None  # default: the target model
    num_scorers: int = 2  # Ray scoring actors (capped at the CPUs Ray has)
    ray_address: str | None = None
    run_dir: str = "runs/latest"
    seed: int = 0
    max_new_tokens: int = 48
    finalists: int = 1  # candidates evaluated on the test split (see select_finalists)
    dev_examples: int | None = 100  # dev examples in each candidate's reward (None: the whole dev split)
    wandb_mode: str = "offline"
    wandb_project: str = "tune-prompts"
    wandb_entity: str | None = None
    store_url: str | None = None  # None: no store
    promote: bool = True
    progress: bool = True


@dataclass
class LoopState:
    """Everything a resumed run needs besides the policy weights (saved next to it)."""

    step: int = 0  # steps completed
    leaderboard: list[dict] = field(default_factory=list)  # best distinct candidates, best first
    history: list[dict] = field(default_factory=list)  # per-step scalars
    wandb_id: str | None = None
    target_calls: int = 0  # (template, example) pairs requested from the target model


def _save_checkpoint(run_dir: Path, learner, state: LoopState) -> None:
    """Write the checkpoint next to the old one, then swap: a kill at any moment leaves one whole checkpoint."""
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    learner.save_adapter(tmp / "policy")
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
    final = run_dir / "checkpoint"
    old = run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(run_dir: Path) -> tuple[LoopState, Path] | None:
    for name in ("checkpoint", "checkpoint.old"):  # .old survives a kill between the two renames
        folder = run_dir / name
        if (folder / "state.json").is_file():
            return LoopState(**json.loads((folder / "state.json").read_text())), folder / "policy"
    return None


def _update_leaderboard(board: list[dict], rows: list[dict], keep: int = 20) -> list[dict]:
    by_text = {row["template"]: row for row in board}
    for row in rows:
        if row["valid"] and (row["template"] not in by_text or row["total_reward"] > by_text[row["template"]]["total_reward"]):
            by_text[row["template"]] = row
    return sorted(by_text.values(), key=lambda r: -r["total_reward"])[:keep]


def tune(task: TaskConfig, options: RunOptions, *, resume: bool = False, log=print) -> dict[str, Any]:
    """Run the tuning job; returns the final report (also written to run_dir/report.json)."""
    from pipelines.rl import ppo as rl
    from pipelines.engine.models import load_causal_lm
    from pipelines.ray_scoring import ScoringPool, init_ray
    from pipelines.tracking import Tracker

    run_dir = Path(options.run_dir)
    components = components_for(task.judge.rubrics)
    check_weights(task.reward.weights, components)  # fail before loading anything
    splits = load_splits(task)
    n_reward = min(options.dev_examples or len(splits.dev), len(splits.dev))  # dev examples in a step reward
    state, policy_ckpt = LoopState(), None
    if resume:
        found = _load_checkpoint(run_dir)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {run_dir} to resume from; start without --resume")
        state, policy_ckpt = found
        log(f"resuming {run_dir} after step {state.step}")
    elif (run_dir / "checkpoint").exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    init_ray(options.ray_address)
    pool = ScoringPool(task, splits, target_model=options.target_model, judge_model=options.judge_model,
                       num_workers=options.num_scorers, reward_examples=n_reward)
    policy = load_causal_lm(options.policy_model)
    learner = rl.PPOLearner(policy.model, task.ppo, group_size=task.generation.candidates_per_step)
    if policy_ckpt is not None:
        learner.load_adapter(policy_ckpt)
    pool.wait_ready()
    timings["timing/startup_s"] = time.perf_counter() - t0
    tracker = Tracker(run_dir=run_dir, mode=options.wandb_mode, project=options.wandb_project,
                      entity=options.wandb_entity, name=f"{task.name}-{run_dir.name}",
                      config={"task": task.model_dump(mode="json"), "options": asdict(options)},
                      component_names=list(components), resume_id=state.wandb_id)
    state.wandb_id = tracker.run_id
    log(f"W&B run ({options.wandb_mode}): {tracker.folder}")

    seed_text = task.seed_template().text
    if not state.leaderboard:  # the seed is the first incumbent the policy improves on
        (seed_m,) = pool.measure([seed_text])
        state.target_calls += n_reward + 2 * task.scoring.robustness_examples
        seed_r = weigh(seed_m, task.reward.weights, components, task.reward.invalid_penalty)
        state.leaderboard = [_row(task, 0, seed_m, seed_r)]

    steps = tqdm(range(state.step, options.steps), initial=state.step, total=options.steps, desc=f"tuning {task.name}",
                 unit="step", disable=not options.progress)
    for step in steps:
        timing = {}
        # 1. generate: the policy rewrites the best instruction so far, told its weakest components
        t = time.perf_counter()
        best = state.leaderboard[0]
        prompt = meta_prompt(task, instruction_of(task, best["template"]), {c: best.get(c) for c in components})
        batch = rl.sample(learner.policy, policy.tokenizer, [prompt] * task.generation.candidates_per_step,
                          options.max_new_tokens, task.generation.temperature, task.generation.top_p,
                          seed=options.seed * 100_003 + step)
        texts = [candidate_text(task, reply) for reply in batch.texts]
        timing["timing/generate_s"] = time.perf_counter() - t
        # 2. score on Ray: validity, target metric, robustness, judge, length
        t = time.perf_counter()
        measured = pool.measure(texts)
        state.target_calls += sum(n_reward + 2 * task.scoring.robustness_examples for m in measured if m.valid)
        timing["timing/score_s"] = time.perf_counter() - t
        # 3. weight: components -> one reward per candidate (invalid ones get the fixed penalty)
        rewards = [weigh(m, task.reward.weights, components, task.reward.invalid_penalty) for m in measured]
        # 4. update the policy with OpenRLHF's PPO losses and advantage estimator
        t = time.perf_counter()
        train = learner.step(batch.with_rewards([r.total for r in rewards]))
        timing["timing/update_s"] = time.perf_counter() - t
        # 5. keep the best candidates seen so far
        rows = [_row(task, step + 1, m, r) for m, r in zip(measured, rewards)]
        state.leaderboard = _update_leaderboard(state.leaderboard, rows)
        state.step = step + 1
        scalars = {**_reward_means(rows, components), **{k: v for k, v in train.items() if k.startswith("train/")},
                   **timing, "train/valid_fraction": sum(r["valid"] for r in rows) / len(rows),
                   "train/best_reward": state.leaderboard[0]["total_reward"], "train/target_calls": state.target_calls}
        state.history.append(scalars)
        tracker.log_step(state.step, scalars, rows)
        _save_checkpoint(run_dir, learner, state)
        steps.set_postfix(reward=f"{scalars.get('reward/total/mean', 0):.3f}", best=f"{state.leaderboard[0]['total_reward']:.3f}")

    # 6. finalists: the best candidates re-measured on the whole dev split (tuning never reads test)
    t = time.perf_counter()
    ranked = [row["template"] for row in state.leaderboard if row["template"] != seed_text]
    finalists, shortlist = select_finalists(task, pool, ranked, options.finalists)
    first_seen = {row["template"]: row["step"] for row in state.leaderboard}
    for row in shortlist:
        row["step"] = first_seen.get(row["template"], row["step"])
    state.target_calls += len(shortlist) * len(splits.dev)
    timings["timing/select_s"] = time.perf_counter() - t
    # 7. held-out test: the seed template against the finalists
    t = time.perf_counter()
    log(f"evaluating the seed and {len(finalists)} finalist{'' if len(finalists) == 1 else 's'} "
        "(chosen on the whole dev split) on the held-out test split ...")
    evaluations = pool.evaluate([seed_text] + finalists, "test")
    timings["timing/test_eval_s"] = time.perf_counter() - t
    final_rows = [_final_row(task, "seed" if i == 0 else f"candidate {i}", ev) for i, ev in enumerate(evaluations)]
    tracker.log_leaderboard(sorted(final_rows, key=lambda r: -r[task.scoring.metric]))
    report = {"task": task.name, "run_dir": str(run_dir), "steps": state.step, "wandb_folder": tracker.folder,
              "target_calls": state.target_calls, "test": final_rows, "shortlist": shortlist, "history": state.history,
              "scorer_workers_replaced": pool.replaced, "timings": timings}
    # 8. promotion: the first finalist (best by whole-dev reward) goes through the gate into the store
    if options.store_url:
        report["promotion"] = _promote(task, options, evaluations, run_dir.name)
    (run_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    tracker.finish()
    pool.shutdown()
    return report


def select_finalists(task: TaskConfig, pool, ranked: list[str], n: int) -> tuple[list[str], list[dict]]:
    """The ``n`` candidates that go on to the test split, chosen on dev only: the best ``max(4, 2 n)`` by step
    reward (a dev sample, noisy when many candidates compete) are measured again on the whole dev split and
    ranked by that reward. Returns the finalists and the shortlist's rows (whole-dev reward), best first."""
    components = components_for(task.judge.rubrics)
    shortlist = ranked[: max(4, 2 * n)]
    if not shortlist:
        return [], []
    measured = pool.measure(shortlist, whole_dev=True)
    rows = [_row(task, 0, m, weigh(m, task.reward.weights, components, task.reward.invalid_penalty)) for m in measured]
    rows.sort(key=lambda r: -r["total_reward"])
    return [r["template"] for r in rows[:n] if r["valid"]], rows


def _row(task: TaskConfig, step: int, m, reward) -> dict:
    row = {"step": step, "template": m.template, "instruction": instruction_of(task, m.template), "valid": m.valid,
           "tokens": m.tokens, "total_reward": reward.total, "invalid_reasons": "; ".join(m.reasons),
           task.scoring.reward_metric: m.metrics.get(task.scoring.reward_metric)}
    row.update({name: value for name, value in reward.components.items()})
    return row


def _reward_means(rows: list[dict], components) -> dict[str, float]:
    out = {"reward/total/mean": sum(r["total_reward"] for r in rows) / len(rows)}
    for name in components:
        values = [r[name] for r in rows if r.get(name) is not None]
        if values:
            out[f"reward/{name}/mean"] = sum(values) / len(values)
    return out


def _final_row(task: TaskConfig, name: str, ev) -> dict:
    m = ev.measured
    row = {"template_name": name, "instruction": instruction_of(task, m.template), "valid": m.valid,
           "total_reward": ev.reward.total, **{k: m.metrics.get(k) for k in ("balanced_accuracy", "accuracy", "macro_f1", "roc_auc")},
           "tokens": m.tokens, "latency_p95_ms": ev.latency_ms.get("p95"), "render_us_p99": ev.render_us_p99,
           "template": m.template}
    row.update({f"pdr/{k}": v for k, v in m.pdr.items()})
    row.update({k: v for k, v in m.judge.items()})
    return row


def _measurements(ev, metric: str):
    from templates.gate import Measurements

    m = ev.measured
    components = {k: v for k, v in ev.reward.components.items() if v is not None}
    return Measurements(components=components, heldout_metric=m.metrics.get(metric, float("nan")),
                        template_tokens=m.tokens or 0, latency_p95_ms=ev.latency_ms.get("p95", float("nan")),
                        error_rate=0.0, render_us_p99=ev.render_us_p99 or float("nan"))


def _promote(task: TaskConfig, options: RunOptions, evaluations, run_id: str) -> dict:
    """Record the seed (as the first production version, if the store has none) and the best candidate,
    with the gate's decision; promote the candidate if the gate says so."""
    from templates.gate import Decision, decide
    from templates.store import TemplateStore

    config = task.promotion_config()
    seed_ev, candidates = evaluations[0], evaluations[1:]
    with TemplateStore(options.store_url) as store:
        incumbent = store.get_label(task.name, "production")
        if incumbent is None:
            seed_version = store.add_version(
                task.name, task.seed_template(), run_id=run_id, scores=_scores(seed_ev), latency=_latency(seed_ev),
                decision=Decision(True, ("pass: seed template, registered as the first production version",)))
            incumbent = store.promote(task.name, seed_version.id, force=True)
        incumbent_ev = seed_ev if incumbent.template.text == seed_ev.measured.template else None
        incumbent_m = _measurements(incumbent_ev, config.metric) if incumbent_ev else _stored_measurements(incumbent, config)
        valid = [ev for ev in candidates if ev.measured.valid]
        if not valid:
            return {"promoted": False, "reasons": ["no valid candidate"], "production": incumbent.id}
        best = valid[0]  # the best by whole-dev reward; picking by the test metric too would bias the gate's comparison
        decision = decide(_measurements(best, config.metric), incumbent_m, config)
        version = store.add_version(task.name, task.make_template(best.measured.template), parent_id=incumbent.id,
                                    run_id=run_id, scores=_scores(best), latency=_latency(best), decision=decision)
        if decision.promote and options.promote:
            store.promote(task.name, version.id)
        production = store.get_label(task.name, "production")
        return {"version": version.id, "promoted": decision.promote and options.promote, "reasons": list(decision.reasons),
                "production": production.id if production else None}


def _scores(ev) -> dict:
    m = ev.measured
    return {"test": {**{k: v for k, v in m.metrics.items()}, **{k: v for k, v in ev.reward.components.items() if v is not None},
                     "total_reward": ev.reward.total}}


def _latency(ev) -> dict:
    return {"template_tokens": ev.measured.tokens, "latency_p50_ms": ev.latency_ms.get("p50"),
            "latency_p95_ms": ev.latency_ms.get("p95"), "render_us_p99": ev.render_us_p99, "error_rate": 0.0}


def _stored_measurements(version, config):
    from templates.gate import Measurements

    test = (version.scores or {}).get("test", {})
    latency = version.latency or {}
    return Measurements(components={k: v for k, v in test.items() if isinstance(v, (int, float))},
                        heldout_metric=test.get(config.metric, float("nan")),
                        template_tokens=latency.get("template_tokens") or 0,
                        latency_p95_ms=latency.get("latency_p95_ms") or float("nan"),
                        error_rate=latency.get("error_rate") or 0.0, render_us_p99=latency.get("render_us_p99") or float("nan"))
