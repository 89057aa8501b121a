"""The tuning loop: generate -> score -> weight -> update -> keep the best -> (at the end) select, test, gate, store.

``tune`` reads top to bottom: set-up (or resume), one ``train_step`` per step, then the choice on the whole dev
split by the gate's own rules with the seed in the race (``pipelines/choice.py``); the chosen candidate, if any,
is tested against the seed on the held-out test split (which tuning never reads) and goes through the promotion
gate into the template store (``pipelines/promotion.py``). ``train_step``
calls one function per stage and passes values by return.

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

from pipelines.config import GENERATION_METRICS, RunOptions, TaskConfig
from pipelines.data import load_splits
from pipelines.engine.endpoints import EndpointError
from pipelines.engine.usage import ROLES, Usage, sum_usage
from pipelines.generation import candidate_text, instruction_of, meta_prompt
from pipelines.racing import first_rung_reward, race_candidates
from rewards.components import RATES


@dataclass
class LoopState:
    """Everything a resumed run needs besides the policy weights (saved next to it)."""

    step: int = 0  # steps completed
    leaderboard: list[dict] = field(default_factory=list)  # best distinct candidates, best first
    history: list[dict] = field(default_factory=list)  # per-step scalars
    sampled: list[dict] = field(default_factory=list)  # per step: each sample's reward and whether it met the bars
    wandb_id: str | None = None
    usage: dict[str, dict] = field(default_factory=dict)  # phase (seed, steps, select, test) -> role -> Usage
    stopped: str | None = None  # why the run ended before its last step (the budget), if it did
    candidates: list[dict] = field(default_factory=list)  # each step's candidates, as logged (the run report)

    @classmethod
    def from_json(cls, data: dict) -> "LoopState":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})  # a checkpoint from an older version too

    def spent(self) -> dict[str, Usage]:
        """Calls and tokens per role, over every phase so far."""
        total = sum_usage(*self.usage.values())
        return {role: total.get(role, Usage()) for role in ROLES}

    def charge(self, phase: str, usage: dict[str, Usage]) -> None:
        self.usage[phase] = {role: u.as_dict() for role, u in sum_usage(self.usage.get(phase, {}), usage).items()}


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
            return LoopState.from_json(json.loads((folder / "state.json").read_text())), folder / "policy"
    return None


def _update_leaderboard(board: list[dict], rows: list[dict], keep: int = 20) -> list[dict]:
    by_text = {row["template"]: row for row in board}
    for row in rows:
        if row["valid"] and (row["template"] not in by_text or row["total_reward"] > by_text[row["template"]]["total_reward"]):
            by_text[row["template"]] = row
    return sorted(by_text.values(), key=lambda r: -r["total_reward"])[:keep]


def tune(task: TaskConfig, options: RunOptions, *, resume: bool = False, log=print) -> dict[str, Any]:
    """Run the tuning job; returns the final report (also written to run_dir/report.json).

    A served target or judge that stops answering (after its retries) ends the run with an ``EndpointError``
    that names the server; the checkpoint of the last whole step stays, and ``resume=True`` continues from it.
    """
    from pipelines.budget import Budget, check_affordable, estimate, scoring_tokenizer
    from pipelines.engine.models import load_causal_lm
    from pipelines.ray_scoring import ScoringPool, init_ray
    from pipelines.rl import ppo as rl
    from pipelines.tracking import Tracker

    started = time.perf_counter()
    run_dir = Path(options.run_dir)
    splits = load_splits(task)
    check_sources(options, log)  # a missing model folder, or a server that is down, stops the run here, named
    budget = Budget(options.max_target_calls, options.max_tokens)
    # priced before anything is written (a few seconds): a budget too small for the seed and the test stops here
    plan = estimate(task, options, splits, scoring_tokenizer(options.target))
    check_affordable(plan, budget)
    state, policy_ckpt = _start_or_resume(run_dir, resume, log)
    t0 = time.perf_counter()
    init_ray(options.ray_address)
    pool = ScoringPool(task, splits, target=options.target, judge=options.judge, num_workers=options.num_scorers,
                       reward_examples=options.dev_examples)
    tracker = None
    try:
        policy = load_causal_lm(options.policy_model)
        learner = rl.PPOLearner(policy.model, task.ppo, group_size=task.generation.candidates_per_step)
        if policy_ckpt is not None:
            learner.load_adapter(policy_ckpt)
        pool.wait_ready()
        timings = {"timing/startup_s": time.perf_counter() - t0}
        tracker = Tracker(run_dir=run_dir, mode=options.wandb_mode, project=options.wandb_project,
                          entity=options.wandb_entity, name=f"{task.name}-{run_dir.name}",
                          config={"task": task.model_dump(mode="json"), "options": asdict(options)},
                          component_names=list(task.component_names), resume_id=state.wandb_id)
        state.wandb_id = tracker.run_id
        log(f"W&B run ({options.wandb_mode}): {tracker.folder}")
        if tracker.note:
            log(tracker.note)
        try:
            report = _run(task, options, pool, learner, policy.tokenizer, tracker, state, run_dir, plan, budget, log)
        except EndpointError as exc:
            if _load_checkpoint(run_dir) is None:  # it failed before the seed's checkpoint: nothing to resume
                raise EndpointError(f"{exc}. Once the server answers again, run the same command") from None
            raise EndpointError(
                f"{exc}. The run stopped after step {state.step} of {options.steps}; its checkpoint is in {run_dir}. "
                f"Once the server answers again, run the same command with --resume --run-dir {run_dir}"
            ) from None
        report["timings"] = {**timings, **report["timings"], "timing/total_s": time.perf_counter() - started}
        text = json.dumps(report, indent=1, default=str)
        (run_dir / "report.json").write_text(text)
        _write_page(json.loads(text), run_dir, log)
        return report
    finally:
        if tracker is not None:
            tracker.finish()
        pool.shutdown()


def _run(task, options, pool, learner, tokenizer, tracker, state: LoopState, run_dir: Path, plan, budget, log) -> dict:
    """Seed, steps, selection, test, promotion: ``tune``'s body once the models and the tracker are up."""
    from pipelines.choice import choose
    from pipelines.promotion import gate

    timings: dict[str, float] = {}
    seed_text = task.seed_template().text
    seed_dev = None  # what waits for the seed's evaluation on the whole dev split, for the choice (ScoringPool.seed)
    if not state.leaderboard:  # the seed is the first incumbent the policy improves on
        seed, seed_dev = pool.seed(seed_text, evaluate=options.stop_after != "steps")
        state.charge("seed", seed.usage)
        state.leaderboard = [_row(task, 0, seed)]
        _save_checkpoint(run_dir, learner, state)  # a server that dies in step 1 does not cost the seed again
    state.stopped = None  # a resumed run may have a larger budget than the one that stopped it
    steps = tqdm(range(state.step, options.steps), initial=state.step, total=options.steps, desc=f"tuning {task.name}",
                 unit="step", disable=not options.progress)
    for step in steps:
        if budget:
            why = plan.affords(budget, state.spent(), 1)
            if why:
                state.stopped = f"budget: step {step + 1} and the final test would exceed it ({why})"
                log(f"stopping before step {step + 1} of {options.steps}: with it and the final test, {why}; "
                    "testing the best candidate so far")
                _save_checkpoint(run_dir, learner, state)
                break
        rows, scalars = train_step(task, pool, learner, tokenizer, state, step, last=step == options.steps - 1)
        tracker.log_step(state.step, scalars, rows)
        steps.set_postfix(reward=f"{scalars['reward/total/mean']:.3f}", best=f"{state.leaderboard[0]['total_reward']:.3f}")
        if not scalars["train/new_fraction"] and step < options.steps - 1:  # nothing new to score or learn from
            state.stopped = f"collapsed: step {step + 1} drew only instructions drawn before"
            log(f"stopping after step {step + 1} of {options.steps}: the policy drew only instructions it had drawn "
                "before, so more steps would find nothing new; choosing among what it found")
        _save_checkpoint(run_dir, learner, state)
        if state.stopped:
            break
    steps.close()
    if options.stop_after == "steps":  # --stop-after steps: a study of the learning needs no more
        _save_checkpoint(run_dir, learner, state)
        return {**_early_report(task, run_dir, state, tracker, "steps"), "choice": None, "test": [],
                "learning": learning_table(state.history, state.sampled), "timings": timings}

    # 6. choose on dev: the seed and the shortlist evaluated as the test will, then the gate's own rules with
    # margins and a paired test against the seed (pipelines/choice.py); tuning never reads test
    t = time.perf_counter()
    shortlist = shortlist_of(task, state.leaderboard, seed_text, options.finalists or task.selection.shortlist)
    log(f"choosing on the whole dev split: the seed and {len(shortlist)} candidate{'' if len(shortlist) == 1 else 's'} "
        "under the gate's bars ...")
    dev_evaluations = pool.evaluate(shortlist if seed_dev else [seed_text] + shortlist, "dev", latency=False)
    if seed_dev is not None:  # a resumed run evaluates the seed again
        dev_evaluations = [seed_dev()] + dev_evaluations
    pool.time(dev_evaluations, "dev")  # the seed and the finalists timed together, their requests interleaved
    choice = choose(task, dev_evaluations[0], dev_evaluations[1:])
    select_usage = sum_usage(*(ev.usage for ev in dev_evaluations))
    timings["timing/select_s"] = time.perf_counter() - t
    log(choice.verdict)
    learning = learning_table(state.history, state.sampled)
    if options.stop_after == "choice":  # --stop-after choice: the finalists and their bars, no test, gate or store
        state.charge("select", select_usage)
        _save_checkpoint(run_dir, learner, state)
        return {**_early_report(task, run_dir, state, tracker, "choice"), "choice": choice.as_dict(), "test": [],
                "finalists": [choice.chosen] if choice.chosen else [], "learning": learning, "timings": timings}
    # 7. test: the seed template against the chosen candidate (if any) on the held-out split
    t = time.perf_counter()
    tested = [seed_text] + ([choice.chosen] if choice.chosen else [])
    log(f"evaluating the seed{' and the chosen candidate' if choice.chosen else ''} on the held-out test split ...")
    # the production decision (fitted on train) and robustness (a dev sample) are the dev evaluations' own
    on_dev = {ev.measured.template: ev for ev in dev_evaluations}
    evaluations = pool.evaluate(tested, "test", fitted=[on_dev.get(text) for text in tested])
    timings["timing/test_eval_s"] = time.perf_counter() - t
    # the ending is charged once it has run: a run resumed after a failure here pays for it again, and says so
    state.charge("select", select_usage)
    for ev in evaluations:
        state.charge("test", ev.usage)
    _save_checkpoint(run_dir, learner, state)  # a resumed run (say, with a larger budget) counts this ending too
    gates = [gate(task, ev, None if i == 0 else evaluations[0]) for i, ev in enumerate(evaluations)]
    final_rows = [_final_row(task, "seed" if i == 0 else "chosen", ev, g)
                  for i, (ev, g) in enumerate(zip(evaluations, gates))]
    tracker.log_leaderboard(sorted(final_rows, key=lambda r: -r[task.scoring.metric]))
    spent = state.spent()
    tracker.log_summary({f"usage/{role}/{k}": v for role, u in spent.items() for k, v in u.as_dict().items()})
    report = {"task": task.name, "run_dir": str(run_dir), "steps": state.step, "stopped": state.stopped,
              "wandb_folder": tracker.folder, "target_calls": spent["target"].calls,
              "usage": {"total": {role: u.as_dict() for role, u in spent.items()}, "phases": state.usage},
              "estimate": {**plan.as_dict(), "for_steps_run": {role: u.as_dict() for role, u in
                                                     plan.total(state.step, chosen=choice.chosen is not None).items()}},
              "choice": choice.as_dict(), "test": final_rows, "history": state.history, "learning": learning,
              "candidates": state.candidates,
              "scorer_workers_replaced": pool.replaced, "timings": timings}
    # 8. promote: the chosen candidate goes through the gate into the store (with none, the store only learns the
    # seed as its first production version, if it had none)
    if options.store_url:
        from pipelines.promotion import promote

        report["promotion"] = promote(task, options.store_url, evaluations, run_dir.name, allow=options.promote,
                                      no_candidate=None if choice.chosen else choice.verdict)
    return report


def _early_report(task: TaskConfig, run_dir: Path, state: LoopState, tracker, stopped_after: str) -> dict:
    """What a run that ends early (``--stop-after``) reports besides its own part: the steps, the spending."""
    spent = state.spent()
    return {"task": task.name, "run_dir": str(run_dir), "steps": state.step, "stopped": state.stopped,
            "stopped_after": stopped_after, "wandb_folder": tracker.folder, "target_calls": spent["target"].calls,
            "usage": {"total": {role: u.as_dict() for role, u in spent.items()}, "phases": state.usage},
            "history": state.history, "candidates": state.candidates}


def train_step(task: TaskConfig, pool, learner, tokenizer, state: LoopState, step: int, *, last: bool = False
               ) -> tuple[list[dict], dict]:
    """One step of the loop; updates ``state`` and returns the step's candidate rows and scalars (``last``: the run's
    last step, whose update is deferred, ``PPOLearner.defer``)."""
    from pipelines.rl import ppo as rl

    timing = {}
    # 1. generate: the policy rewrites the best instruction so far, told its weakest components
    t = time.perf_counter()
    best = state.leaderboard[0]
    prompt = meta_prompt(task, instruction_of(task, best["template"]), {c: best.get(c) for c in task.component_names})
    gen = task.generation
    batch = rl.sample(learner.policy, tokenizer, [prompt] * gen.candidates_per_step, task.template.max_instruction_tokens,
                      gen.temperature, gen.top_p, seed=task.ppo.seed * 100_003 + step)
    texts = [candidate_text(task, reply) for reply in batch.texts]
    timing["timing/generate_s"] = time.perf_counter() - t
    # 2. score and 3. weight, on Ray: validity, target metric, robustness, judge, length -> one reward each,
    # raced: all on a slice of the dev sample, the best on the rest (pipelines/racing.py)
    t = time.perf_counter()
    scored, finished = race_candidates(task, pool, texts)
    timing["timing/score_s"] = time.perf_counter() - t
    # 4. update the policy (ppo.update: none by default, best-of-N; OpenRLHF's PPO losses and advantage estimator,
    # or expert iteration's supervised step on the group's best samples, or both); the run's last step defers its
    # update (it would change only samples never drawn; the checkpoint keeps the batch for a resumed run)
    t = time.perf_counter()
    rewarded = batch.with_rewards([first_rung_reward(s) for s in scored])
    if last:
        learner.defer(rewarded)
        train = {}
    else:
        train = learner.step(rewarded)
    timing["timing/update_s"] = time.perf_counter() - t
    # 5. keep the best candidates seen so far (of those that finished the race)
    rows = [{**_row(task, step + 1, s), "finished_race": done} for s, done in zip(scored, finished)]
    drawn = {row["instruction"] for row in state.candidates}
    new = {row["instruction"] for row in rows} - drawn  # instructions no earlier step drew
    sampled = [_sampled(task, s) for s in scored]  # what the policy was rewarded with, alike for every sample
    state.leaderboard = _update_leaderboard(state.leaderboard, [row for row in rows if row["finished_race"]])
    state.candidates += [{k: v for k, v in row.items() if k not in ("template", "samples")} for row in rows]
    state.step = step + 1
    usage = sum_usage({"policy": batch.usage()}, *(s.usage for s in scored))
    state.charge("steps", usage)
    scalars = {**_reward_means(sampled, task.component_names), **{k: v for k, v in train.items() if k.startswith("train/")},
               **timing, "train/valid_fraction": sum(r["valid"] for r in rows) / len(rows),
               "train/feasible_fraction": sum(meets_bars(task, r, measured_only=True) for r in sampled) / len(rows),
               "train/new_fraction": len(new) / len(rows),
               "train/best_reward": state.leaderboard[0]["total_reward"], "train/target_calls": state.spent()["target"].calls,
               **{f"usage/{role}/{k}": v for role, u in usage.items() for k, v in u.as_dict().items()}}
    state.history.append(scalars)
    state.sampled.append({"rewards": [r["total_reward"] for r in sampled],
                          "feasible": [meets_bars(task, r, measured_only=True) for r in sampled]})
    return rows, scalars


def check_sources(options: RunOptions, log) -> None:
    """Before Ray starts: each local model names a model folder (``check_model_spec``, nothing loaded) and each
    served one answers ``GET /models`` with its model (each actor checks again, for itself). Otherwise a scoring
    actor would fail while starting, and the pool would replace it until it gave up."""
    from pipelines.config import ConfigError, Endpoint
    from pipelines.engine.models import check_model_spec
    from pipelines.scoring import check_endpoint

    check_model_spec(options.policy_model)
    for role, source in (("target", options.target), ("judge", options.judge)):
        if isinstance(source, str):
            check_model_spec(source)
        elif isinstance(source, Endpoint):
            try:
                check_endpoint(source)
            except ValueError as exc:  # a URL without http://, no model name
                raise ConfigError(f"--{role}-url: {exc}") from None
            log(f"{role}: {source.model} at {source.url}, up to {source.max_concurrency} requests in flight per actor")


def _write_page(report: dict, run_dir: Path, log) -> None:
    """run_dir/report.html, drawn from what report.json holds (written first, so a failure to draw loses nothing:
    it is one warning line, and ``tune-prompts report RUN_DIR`` draws the page again)."""
    from pipelines.run_report import write_html

    try:
        write_html(report, run_dir / "report.html")
    except Exception as exc:  # noqa: BLE001 - whatever the drawing raises, the run's result is already saved
        first = str(exc).split("\n", 1)[0][:200]
        log(f"warning: report.html not written ({type(exc).__name__}: {first}); report.json is complete, and "
            f"`tune-prompts report {run_dir}` draws the page from it")


def _start_or_resume(run_dir: Path, resume: bool, log) -> tuple[LoopState, Path | None]:
    if resume:
        found = _load_checkpoint(run_dir)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {run_dir} to resume from; start without --resume")
        log(f"resuming {run_dir} after step {found[0].step}")
        return found
    if (run_dir / "checkpoint").exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    return LoopState(), None


def shortlist_of(task: TaskConfig, leaderboard: list[dict], seed_text: str, n: int) -> list[str]:
    """The ``n`` candidates the choice evaluates on the whole dev split: the best by step reward among those whose
    step measurements met the promotion thresholds, then the best of the rest (never the seed: it is always
    evaluated beside them)."""
    rows = [row for row in leaderboard if row["template"] != seed_text and row.get("valid", True)]
    return [row["template"] for row in sorted(rows, key=lambda r: (not meets_bars(task, r, measured_only=True),
                                                                   -r["total_reward"]))[:n]]


def meets_bars(task: TaskConfig, row: dict, *, measured_only: bool = False) -> bool:
    """Whether a candidate's step measurements met every promotion threshold and its prompts' predicted latency
    the choice's ceiling (a rate it was not measured on fails; with ``measured_only``, as for a screened sample,
    it is left out)."""
    ratio = row.get("prompt_ratio")
    return bool(row["valid"]) and (ratio is None or ratio <= task.latency_ceiling()) and all(
        row[name] >= bar if row.get(name) is not None else measured_only for name, bar in task.promotion.thresholds.items())


def _sampled(task: TaskConfig, scored) -> dict:
    """One sample as the policy saw it: its first-rung reward and components (``pipelines.racing.first_rung_reward``)."""
    reward = scored.screen or scored.reward
    return {"valid": scored.measured.valid, "total_reward": reward.total, "prompt_ratio": scored.measured.prompt_ratio,
            **reward.components}


def learning_table(history: list[dict], sampled: list[dict] | None = None) -> list[dict]:
    """Per step, what the policy's samples got: the mean reward, the feasible fraction, the best so far (and, where
    kept, each sample's reward and feasibility, for intervals over samples)."""
    keys = {"mean_reward": "reward/total/mean", "feasible_fraction": "train/feasible_fraction",
            "valid_fraction": "train/valid_fraction", "best_so_far": "train/best_reward"}
    rows = [{"step": i + 1, **{name: h.get(key) for name, key in keys.items()}} for i, h in enumerate(history)]
    for row, samples in zip(rows, sampled or []):
        row["samples"] = samples
    return rows


def rate_text(m, name: str) -> str | None:
    """A rate as "kept/of", e.g. "83/100"; None when it was not measured."""
    kept, total = m.rates.get(name, (0, 0))
    return f"{kept}/{total}" if total else None


def _row(task: TaskConfig, step: int, scored) -> dict:
    m, reward = scored.measured, scored.reward
    row = {"step": step, "template": m.template, "instruction": instruction_of(task, m.template), "valid": m.valid,
           "tokens": m.tokens, "prompt_ratio": m.prompt_ratio, "total_reward": reward.total,
           "invalid_reasons": "; ".join(m.reasons),
           task.scoring.reward_metric: m.metrics.get(task.scoring.reward_metric), "target_calls": scored.target_calls,
           "judge_calls": scored.usage["judge"].calls if "judge" in scored.usage else 0}
    row.update(reward.components)
    row.update({f"{name}_n": rate_text(m, name) for name in RATES})
    row["samples"] = [dict(sample) for sample in m.samples]
    return row


def _reward_means(rows: list[dict], components) -> dict[str, float]:
    out = {"reward/total/mean": sum(r["total_reward"] for r in rows) / len(rows)}
    for name in components:
        values = [r[name] for r in rows if r.get(name) is not None]
        if values:
            out[f"reward/{name}/mean"] = sum(values) / len(values)
    return out


def _metric_names(task: TaskConfig) -> tuple[str, ...]:
    if task.is_generation:
        return GENERATION_METRICS
    return "balanced_accuracy", "accuracy", "macro_f1", "roc_auc"


def _final_row(task: TaskConfig, name: str, ev, gate) -> dict:
    """One evaluated template's held-out row: the production figures under its decision, the rates with their
    counts, and the gate's decision with every reason (the seed against no incumbent, candidates against it)."""
    from pipelines.choice import metric_interval

    m, r = ev.measured, ev.as_record()
    row = {"template_name": name, "instruction": instruction_of(task, r["template"]), "valid": r["valid"],
           "decision": r["decision"]["kind"] if r["decision"] else None,
           "total_reward": r["reward"]["total"], **{k: r["metrics"].get(k) for k in _metric_names(task)},
           **{name: r["reward"]["components"].get(name) for name in (*RATES, "readability")},
           **{f"{name}_n": rate_text(m, name) for name in RATES},
           "tokens": r["template_tokens"], "latency_p95_ms": r["latency_ms"].get("p95"),
           "render_us_p99": r["render_us_p99"], "template": r["template"],
           "gate_passed": gate.promote if gate else False,
           "gate_reasons": list(gate.reasons) if gate else ["fail: invalid template"]}
    row[f"{task.scoring.metric}_ci95"] = metric_interval(task, m.outcomes)  # over the test examples, for the report
    row.update({f"pdr/{k}": v for k, v in r["pdr"].items()})
    row.update(r["judge"])
    row["samples"] = r["samples"]
    return row
