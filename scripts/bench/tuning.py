"""Benchmark: tuning methods at an equal budget of target calls, on the held-out test split, over seeds.

For each task and seed, every method gets the same budget of calls to the target model for its search and
its choice (the final test is not part of it, and is the same for all), and the template it chooses is
evaluated on the task's test split, which no method reads, under the task's production decision:
  * seed       the task's hand-written template (no calls);
  * best-of-N  rounds of `candidates_per_step` instructions from the untrained policy with the seed meta-prompt,
               as many rounds as the budget pays for;
  * OPRO       the same rounds, but each meta-prompt shows the best instructions so far with their rewards
               (`bench.opro.history_meta_prompt`), the untrained policy writing;
  * PPO        `pipelines.loop.tune` with the budget (`--max-target-calls`): as many steps as it pays for;
  * expert iteration  the same loop with `ppo.update: expert_iteration`: each step a supervised update on the
               group's best samples instead of PPO's;
  * no update  the same loop with `ppo.update: none`, what `tune-prompts` runs by default: each step's group comes
               from the untrained policy, rewriting the best instruction so far (best-of-N inside the loop);
  * DSPy COPRO, DSPy MIPROv2, DSPy GEPA: the dspy library's optimizers as shipped, instruction only and zero
               demos, through `bench.peers.dspy` (an adapter to the in-process target model, prompted and parsed
               as here; the proposer is the same untrained policy model; GEPA's reflection reads each example's
               outcome as feedback); their own choice, by their own search on train (and for MIPROv2 and GEPA
               dev) examples; on a generation task through `scripts/bench/peers/dspy_generation.py` (scored per
               example by the task's figure against the reference). Without the optional extra
               (`bash scripts/setup.sh --bench`) their rows say "not run": the table keeps its shape.
The project's methods score candidates through the same racing pool (`pipelines.racing`) and choose among them
the same way (`pipelines.choice.choose`: the gate's bars on the whole dev split, the seed in the race).
Each search gets a pool of its own, so no method reads another's cached scores.

The test split holds ``--test-examples`` (1,000) where the data allow, else the task's own size (the note says
so); it is carved out before dev and train, so every method of a task sees the same three splits.

Per cell: the seeds it ran on, the mean over them, a 95% bootstrap interval of that mean (resampling seeds;
with one seed it is the value itself), the calls each method spent (the largest over seeds) and its wall time. Next to each method's
choice: the share of its test answers that keep the output contract, and the readability of its instruction
(``rewards/readability.py``). The script exits 2 when a method spent
more than its budget, or a row is missing.

A full run takes hours on a small machine. With ``--ledger FILE`` each search and each test evaluation is
appended to FILE as it finishes, and a later run with the same settings reads them back instead of running
them again; a record counts only when its fingerprint matches (``bench.ledger``: a test record depends on the
settings and on what the scorer outputs on a probe set; a search record adds its method's own code, so a change
to PPO runs only PPO's searches again).

    .venv/bin/python -m bench.tuning [--tasks risk sentiment] [--seeds 0 1 2] [--budget CALLS]
    .venv/bin/python -m bench.tuning --quick      # CI: the small test task, one seed, a tiny budget
    .venv/bin/python -m bench.tuning --ledger scripts/bench/results/bench_tuning.jsonl   # resumable
    .venv/bin/python -m bench.tuning --methods seed PPO --set ppo.advantage_estimator=rloo   # a variant

The default budget is what the task's default run spends before its test (the seed, its steps, the selection),
as `--estimate` prices it.

The module is long because each method's search, the ledger bookkeeping around it and the table are one
experiment, read top to bottom; the fingerprint rule lives apart, in ``bench.ledger``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench import REPO
from bench.ledger import (Ledger, ScorerMismatch, check_same_scorer, method_fingerprint, probe, scorer_fingerprint,
                          settings)
from pipelines.cli import quiet_libraries
from pipelines.cli_output import table

METHODS = ("seed", "best-of-N", "OPRO", "PPO", "expert iteration", "no update", "DSPy COPRO", "DSPy MIPROv2",
           "DSPy GEPA")
DSPY_OPTIMIZERS = {"DSPy COPRO": "copro", "DSPy MIPROv2": "miprov2", "DSPy GEPA": "gepa"}
# Methods that are another method's search on a variant of the task: (that method, the task settings it changes).
VARIANTS = {"expert iteration": ("PPO", {"ppo.update": "expert_iteration"}), "no update": ("PPO", {"ppo.update": "none"})}
QUICK_TASK = str(REPO / "tests" / "data" / "risk_small.yaml")
# The loop's steps stop at the budget (PPO's runs pay for 3 to 5 steps at full price) or at this many, whichever
# comes first: a policy that draws instructions it drew before spends few calls a step, and this bounds its time.
MAX_STEPS = 12


@dataclass
class Outcome:
    template: str | None  # None: the method did not run
    calls: int  # target calls of the search and the choice
    wall_s: float
    note: str = ""


def search(task, pool, policy, prompt_for, budget: int, plan, seed: int, spent: int = 0,
           history: list | None = None) -> Outcome:
    """Rounds of candidates until the next round and the choice would overrun ``budget``; then the choice.
    ``prompt_for(history)`` is the meta-prompt of a round; history: (template, reward) of finished candidates."""
    from pipelines.generation import candidate_text
    from pipelines.choice import choose
    from pipelines.racing import race_candidates
    from pipelines.rl import ppo as rl

    started = time.perf_counter()
    gen = task.generation
    round_cost = plan.phases["steps"]["target"].calls
    choice_cost = plan.phases["select"]["target"].calls
    history = list(history or [])
    r = 0
    while spent + round_cost + choice_cost <= budget:
        batch = rl.sample(policy.model, policy.tokenizer, [prompt_for(history)] * gen.candidates_per_step,
                          task.template.max_instruction_tokens, gen.temperature, gen.top_p, seed=seed * 100_003 + r)
        scored, finished = race_candidates(task, pool, [candidate_text(task, reply) for reply in batch.texts])
        spent += sum(s.target_calls for s in scored)
        history += [(s.measured.template, s.reward.total) for s, done in zip(scored, finished) if done and s.measured.valid]
        r += 1
    best: dict[str, float] = {}
    for text, reward in history:
        best[text] = max(reward, best.get(text, reward))
    ranked = sorted(best, key=lambda text: -best[text])
    seed_text = task.seed_template().text
    shortlist = [text for text in ranked if text != seed_text][: task.selection.shortlist]
    evaluations = pool.evaluate([seed_text] + shortlist, "dev")
    choice = choose(task, evaluations[0], evaluations[1:])
    spent += sum(ev.usage["target"].calls for ev in evaluations if "target" in ev.usage)
    return Outcome(choice.chosen or seed_text, spent, time.perf_counter() - started, f"{r} rounds")


@functools.cache
def _policy(name: str):
    """The untrained policy (best-of-N, OPRO and DSPy's proposer only sample from it; PPO loads its own)."""
    from pipelines.engine.models import load_causal_lm

    return load_causal_lm(name)


def run_method(method: str, task, splits, budget: int, plan, seed: int, options) -> Outcome:
    """One method's search and choice at ``budget`` target calls; its wall time includes its own start-up."""
    from bench.opro import history_meta_prompt
    from pipelines.generation import instruction_of, meta_prompt
    from pipelines.ray_scoring import ScoringPool, init_ray

    started = time.perf_counter()
    seed_text = task.seed_template().text
    if method == "seed":
        return Outcome(seed_text, 0, 0.0)
    if method == "PPO":
        outcome = run_ppo(task, budget, plan, options)
    elif method.startswith("DSPy"):
        name = DSPY_OPTIMIZERS[method]
        outcome = run_dspy(task, splits, name, budget, seed, options.target, _policy(options.policy_model))
    else:  # best-of-N and OPRO, each with a pool of its own (no cached scores from another method)
        policy = _policy(options.policy_model)
        init_ray()
        pool = ScoringPool(task, splits, target=options.target, judge=options.judge, num_workers=options.num_scorers,
                           reward_examples=options.dev_examples)
        try:
            if method == "best-of-N":
                prompt = meta_prompt(task, task.template.seed_instruction, {})
                outcome = search(task, pool, policy, lambda history: prompt, budget, plan, seed)
            else:  # OPRO: its first score is the seed's
                (scored,) = pool.measure([seed_text])
                outcome = search(task, pool, policy,
                                 lambda h: history_meta_prompt(task, [(instruction_of(task, t), r) for t, r in h]),
                                 budget, plan, seed, spent=scored.target_calls,
                                 history=[(seed_text, scored.reward.total)])
        finally:
            pool.shutdown()
    if outcome.template is not None:
        outcome.wall_s = time.perf_counter() - started
    return outcome


def run_ppo(task, budget: int, plan, options) -> Outcome:
    from dataclasses import replace

    from pipelines.loop import tune

    # tune's budget covers its test too: add what the test is priced at (it does not run it: --stop-after choice)
    test_calls = plan.phases["test"]["target"].calls
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = tune(task, replace(options, steps=MAX_STEPS, max_target_calls=budget + test_calls, stop_after="choice",
                                    run_dir=str(Path(tmp) / "run"), store_url=None),
                      log=lambda *a: print(*a, file=sys.stderr))
    phases = report["usage"]["phases"]
    calls = sum(p.get("target", {}).get("calls", 0) for name, p in phases.items() if name != "test")
    tuned = report["finalists"][0] if report["finalists"] else task.seed_template().text
    return Outcome(tuned, calls, time.perf_counter() - started, f"{report['steps']} steps")


def run_dspy(task, splits, method: str, budget: int, seed: int, target, proposer) -> Outcome:
    """DSPy's COPRO, MIPROv2 or GEPA (``method``: one of ``bench.peers.dspy.METHODS``) at ``budget`` target calls."""
    try:
        from bench.peers.dspy import optimize
    except ImportError:
        return Outcome(None, 0, 0.0, "not run: pip install -e .[bench]")
    if method == "miprov2" and importlib.util.find_spec("optuna") is None:
        return Outcome(None, 0, 0.0, "not run: pip install -e .[bench]")
    if not isinstance(target, str):
        return Outcome(None, 0, 0.0, "not run: the DSPy adapter needs an in-process target model, not an endpoint")
    from pipelines.engine.models import load_causal_lm

    started = time.perf_counter()
    result = optimize(task, splits, load_causal_lm(target), method, budget, seed, proposer=proposer)
    return Outcome(task.compose(result["instruction"]), result["target_calls"], time.perf_counter() - started,
                   result["note"])


def test_figures(task, ev) -> dict:
    """What the table shows of one template's test evaluation."""
    from pipelines.generation import instruction_of

    m = ev.measured
    kept = m.rates.get("instruction_following") if m.valid else None
    return {task.scoring.metric: m.metrics.get(task.scoring.metric), "roc_auc": m.metrics.get("roc_auc"),
            "instruction_following": kept[0] / kept[1] if kept and kept[1] else None,
            "readability": m.readability, "instruction": instruction_of(task, m.template)}


def bootstrap(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): a 95% percentile bootstrap interval of the mean of ``values``."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, mean, mean
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return mean, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def load_bench_splits(task, test_examples: int):
    """(task, splits, note): a test split of ``test_examples``, or the largest the data allow above the task's own
    (risk: 720 balanced messages; 561 of its 4,534 distinct messages are scams, and train and dev hold 200)."""
    from pipelines.data import DataError, load_examples, split_examples

    examples = load_examples(task)
    step = max(1, len(task.labels or ()))
    for size in range(test_examples, task.split.test, -step):
        bigger = task.with_overrides(**{"split.test": size})
        try:
            splits = split_examples(bigger, examples)
        except DataError:
            continue
        return bigger, splits, "" if size >= test_examples else f"test split of {size}: what the data allow"
    splits = split_examples(task, examples)
    return task, splits, f"test split of {len(splits.test)}" if test_examples > len(splits.test) else ""


def default_budget(plan, options) -> int:
    """What the task's default run spends before its test: the seed, its steps, the selection."""
    return sum(plan.phases[p]["target"].calls * (options.steps if p == "steps" else 1)
               for p in ("seed", "steps", "select"))


def test_key(task_name: str, text: str) -> str:
    """The ledger key of one template's test evaluation (shared by every method that chose it)."""
    return f"{task_name}/test/{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def add_run_options(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """The options a ledger's fingerprint depends on, with the bench's defaults (bench.choice_rule reads the
    same ledger, so it takes the same options)."""
    parser.add_argument("--tasks", nargs="+", default=["risk", "sentiment"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=4,
                        help="steps of the default run the default budget is priced on" + help_suffix)
    parser.add_argument("--dev-examples", type=int, default=100, help="reward examples a step" + help_suffix)
    parser.add_argument("--test-examples", type=int, default=1000,
                        help="examples in the test split where the data allow (else the task's own)" + help_suffix)


def run_dspy_generation(task, splits, method: str, budget: int, seed: int, target, proposer_name: str) -> Outcome:
    """DSPy's COPRO, MIPROv2 or GEPA on a generation task (``scripts/bench/peers/dspy_generation.py``), as ``run_dspy``."""
    if importlib.util.find_spec("dspy") is None or (method == "miprov2" and importlib.util.find_spec("optuna") is None):
        return Outcome(None, 0, 0.0, "not run: bash scripts/setup.sh --bench")
    if not isinstance(target, str):
        return Outcome(None, 0, 0.0, "not run: the DSPy adapter needs an in-process target model, not an endpoint")
    from bench.peers.dspy_generation import optimize

    from pipelines.engine.models import load_causal_lm

    started = time.perf_counter()
    result = optimize(task, splits, load_causal_lm(target), method, budget, seed, proposer=_policy(proposer_name))
    return Outcome(task.compose(result["instruction"]), result["target_calls"], time.perf_counter() - started,
                   result["note"])


def open_ledgers(path: str | None, task, options, budget: int, splits, plan) -> tuple[Ledger, dict[str, Ledger]]:
    """(the scorer's ledger: tests and dev records; each method's ledger of searches), by the rule of
    ``bench.ledger``: the scorer's fingerprint is the settings (the plan's prices among them) and the probe set's
    outputs, a method's adds its own code. Runs the probe (about 20 s on 2 CPU cores)."""
    scorer = scorer_fingerprint(settings(task, options, budget, splits, plan), probe(task, splits, options.target,
                                                                              options.judge))
    return Ledger(path, scorer), {m: Ledger(path, method_fingerprint(scorer, m, task.is_generation), scorer=scorer)
                                  for m in METHODS}


def task_setup(name: str, budget: int | None, options, test_examples: int, overrides: dict | None = None):
    """(task, splits, split note, plan, budget, row label) of one bench task, as every run of it sees them."""
    from pipelines.budget import estimate, scoring_tokenizer
    from pipelines.config import load_task

    # the bench's tasks start from PPO's update, whatever the product's default (none): "PPO" runs PPO, and each
    # of VARIANTS sets its own; so the scorer's fingerprint does not move with that default (bench.ledger)
    base, splits, split_note = load_bench_splits(load_task(name).with_overrides(**{"ppo.update": "ppo"}), test_examples)
    if overrides:  # a variant of the task (e.g. ppo.advantage_estimator): a fingerprint of its own
        base = base.with_overrides(**overrides)
    label = " ".join([base.name, *(f"{k}={v}" for k, v in (overrides or {}).items())])
    plan = estimate(base, options, splits, scoring_tokenizer(options.target))
    budget = default_budget(plan, options) if budget is None else budget
    return base, splits, split_note, plan, budget, label


def fingerprint_rows(name: str, budget: int | None, options, test_examples: int,
                     overrides: dict | None = None) -> list[dict]:
    """``--fingerprints``: what this checkout's records of a task are keyed by (``bench.ledger``): the scorer's
    fingerprint (tests and dev records) and each method's (its searches). Runs the probe only."""
    base, splits, _, plan, budget, label = task_setup(name, budget, options, test_examples, overrides)
    ledger, searches = open_ledgers(None, base, options, budget, splits, plan)
    return [{"task": label, "records": "tests, dev", "fingerprint": ledger.fingerprint},
            *({"task": label, "records": f"{m} searches", "fingerprint": searches[m].fingerprint} for m in METHODS)]


def bench_task(name: str, seeds: list[int], budget: int | None, options, test_examples: int,
               ledger_path: str | None, log=print, methods: tuple[str, ...] = METHODS,
               overrides: dict | None = None, new_scorer: bool = False) -> list[dict]:
    from pipelines.ray_scoring import ScoringPool, init_ray

    base, splits, split_note, plan, budget, label = task_setup(name, budget, options, test_examples, overrides)
    ledger, searches = open_ledgers(ledger_path, base, options, budget, splits, plan)
    read_back = len(ledger.records) + sum(len(s.records) for s in searches.values())
    if read_back:
        log(f"{base.name}: {read_back} finished searches and tests read back from {ledger_path}")
    elif ledger_path and not overrides and not new_scorer:  # a variant (--set) is a new scorer by design
        from pipelines.engine.models import default_dtype

        check_same_scorer(ledger_path, base.name, ledger.fingerprint, default_dtype())
    metric = base.scoring.metric
    outcomes: dict[str, list[Outcome]] = {m: [] for m in METHODS}
    figures: dict[str, list[dict]] = {m: [] for m in METHODS}

    def test_untested(task, texts: list[str], seed: int) -> None:
        untested = [text for text in dict.fromkeys(texts) if ledger.get(test_key(base.name, text)) is None]
        if not untested:
            return
        log(f"{base.name}, seed {seed}: {len(untested)} choice(s) on the {len(splits.test)}-example test split ...")
        started = time.perf_counter()
        init_ray()
        pool = ScoringPool(task, splits, target=options.target, judge=options.judge,
                           num_workers=options.num_scorers, reward_examples=options.dev_examples)
        try:
            evaluations = pool.evaluate(untested, "test", latency=False)
        finally:
            pool.shutdown()
        wall = (time.perf_counter() - started) / len(untested)
        for text, ev in zip(untested, evaluations):
            ledger.add(test_key(base.name, text), kind="test", wall_s=wall, **test_figures(task, ev))

    for seed in seeds:
        task = base.with_overrides(**{"ppo.seed": seed})
        chosen = {}
        for i, method in enumerate(METHODS):
            key = f"{base.name}/seed {seed}/{method}"
            store = searches[method]
            record = store.get(key)
            if record is None and method not in methods and method != "seed":  # left for a later run
                outcome = Outcome(None, 0, 0.0, "not run: not in --methods")
            elif record is None:
                log(f"{base.name}, seed {seed}: {method} ...")
                if base.is_generation and method.startswith("DSPy"):
                    optimizer = DSPY_OPTIMIZERS[method]
                    outcome = run_dspy_generation(task, splits, optimizer, budget, seed, options.target,
                                                  options.policy_model)
                else:
                    runs, changes = VARIANTS.get(method, (method, {}))
                    outcome = run_method(runs, task.with_overrides(**changes) if changes else task, splits, budget,
                                         plan, seed, options)
                if outcome.template is not None:  # "not run" is not recorded: a run with the extra fills it in
                    store.add(key, kind="search", **asdict(outcome))
            else:
                outcome = Outcome(record["template"], record["calls"], record["wall_s"], record["note"])
            outcomes[method].append(outcome)
            if outcome.template is not None:
                chosen[method] = outcome.template
            # choices are tested as soon as there is one per scoring worker (a template is tested on one
            # worker), so an interrupted run keeps what it finished
            pending = [t for t in dict.fromkeys(chosen.values()) if ledger.get(test_key(base.name, t)) is None]
            if len(pending) >= options.num_scorers or i == len(METHODS) - 1:
                test_untested(task, pending, seed)
        for m, text in chosen.items():
            figures[m].append(ledger.get(test_key(base.name, text)))
    rows = []
    for m in METHODS:
        runs = outcomes[m]
        ran = [o for o in runs if o.template is not None]
        row = {"task": label, "method": m, "seeds": len(ran), "test": len(splits.test), "budget": budget,
               "calls": max(o.calls for o in runs), "within_budget": all(o.calls <= budget for o in runs),
               "wall_s": round(sum(o.wall_s for o in ran) / len(ran), 1) if ran else 0.0,
               "note": "; ".join(filter(None, [(ran or runs)[-1].note, split_note]))}
        for col in (metric, "roc_auc"):
            values = [f[col] for f in figures[m] if f[col] is not None]
            if values:
                mean, low, high = bootstrap(values)
                row[col], row[f"{col}_95"] = round(mean, 3), f"[{low:.3f}, {high:.3f}]"
            else:
                row[col], row[f"{col}_95"] = None, ""
        for col in ("instruction_following", "readability"):
            values = [f[col] for f in figures[m] if f[col] is not None]
            row[col] = round(sum(values) / len(values), 3) if values else None
        row["per_seed"] = [{"seed": s, metric: f[metric], "roc_auc": f["roc_auc"], "instruction": f["instruction"]}
                           for s, f in zip([s for s, o in zip(seeds, runs) if o.template is not None], figures[m])]
        row["instruction"] = figures[m][-1]["instruction"] if figures[m] else ""
        row["test_wall_s"] = round(sum(f["wall_s"] for f in figures[m]), 1)
        rows.append(row)
    if ledger_path:
        prints = ", ".join(f"{m} {searches[m].fingerprint[:8]}" for m in METHODS)
        log(f"{base.name}: ledger {ledger_path}; the scorer's fingerprint {ledger.fingerprint[:8]}, the searches' "
            f"{prints} (bench.ledger says what each depends on)")
    return rows


def check(rows: list[dict], tasks: list[str]) -> list[str]:
    """What is wrong with the table: a missing (task, method) row, or a method over its budget."""
    problems = []
    names = {r["task"] for r in rows}
    if len(names) != len(tasks):
        problems.append(f"{len(names)} tasks in the table, {len(tasks)} asked for")
    for task in names:
        methods = [r["method"] for r in rows if r["task"] == task]
        if tuple(methods) != METHODS:
            problems.append(f"{task}: methods {methods}, expected {list(METHODS)}")
    for r in rows:
        if not r["within_budget"]:
            problems.append(f"{r['task']} {r['method']}: {r['calls']} calls > budget {r['budget']}")
    return problems


HIDDEN = ("instruction", "note", "per_seed", "test_wall_s")


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser)
    parser.add_argument("--budget", type=int, help="target calls per method (default: the default run's search)")
    parser.add_argument("--ledger", help="append each finished search and test here, and read back those of an "
                                         "earlier run with the same settings and code (resumable)")
    parser.add_argument("--new-scorer", action="store_true",
                        help="write to --ledger even though its records of a task were all made under another "
                             "scorer (another dtype, or a changed scorer) and none under this one")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="run only these methods; the others are read back from --ledger where it has them "
                             "(to spend a short session on the cheap methods across seeds first)")
    parser.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                        help="change the tasks' settings, e.g. ppo.advantage_estimator=rloo (a variant is a "
                             "fingerprint of its own in the ledger; its rows name the change)")
    parser.add_argument("--quick", action="store_true", help="the small test task, seed 0, a budget of one step (CI)")
    parser.add_argument("--fingerprints", action="store_true",
                        help="print the fingerprints this checkout keys each task's records by, and run nothing else "
                             "(about 20 s a task: the probe); a ledger row counts where its fingerprint is listed")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()

    from pipelines.config import ConfigError, RunOptions

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --set {item!r} is not SECTION.KEY=VALUE. Fix: e.g. --set ppo.advantage_estimator=rloo",
                  file=sys.stderr)
            return 2
        try:
            overrides[key] = yaml.safe_load(value) if value else value
        except yaml.YAMLError:
            overrides[key] = value  # not a YAML scalar: the task's validation says whether a string fits

    if args.quick:
        args.tasks, args.seeds, args.steps, args.dev_examples, args.test_examples = [QUICK_TASK], [0], 1, 12, 0
    options = RunOptions(steps=args.steps, wandb_mode="disabled", progress=False, dev_examples=args.dev_examples)
    if args.fingerprints:
        try:
            prints = [row for name in args.tasks
                      for row in fingerprint_rows(name, args.budget, options, args.test_examples, overrides)]
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(table(prints))
        return 0
    started = time.perf_counter()
    rows = []
    for name in args.tasks:
        try:
            rows += bench_task(name, args.seeds, args.budget, options, args.test_examples, args.ledger,
                               log=lambda *a: print(*a, file=sys.stderr, flush=True), methods=tuple(args.methods),
                               overrides=overrides, new_scorer=args.new_scorer)
        except (ConfigError, ScorerMismatch) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(table([r for r in rows if r["task"] == rows[-1]["task"]], [k for k in rows[-1] if k not in HIDDEN]),
              flush=True)
    recorded = sum(r["wall_s"] * r["seeds"] for r in rows) + sum(r["test_wall_s"] for r in rows)
    print(f"\nheld-out test split under each task's decision; seeds {args.seeds}; mean and 95% bootstrap interval "
          f"over seeds; calls = target calls of the search and the choice (the largest over seeds); "
          f"instruction_following and readability: means over seeds; this run {time.perf_counter() - started:.0f} s, "
          f"the searches and tests in the table {recorded:.0f} s")
    print(table(rows, [k for k in rows[0] if k not in HIDDEN]))
    for r in rows:
        print(f"  {r['task']:<10} {r['method']:<13} {r['note']:<40} {r['instruction'][:90]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    problems = check(rows, args.tasks)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
