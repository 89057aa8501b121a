"""Budgets and the cost estimate (pipelines/budget.py): the arithmetic, `--estimate`, and a run that stops at its
budget, still tests its best candidate, and spends what the estimate said, within 10%."""

import json
import sys
from pathlib import Path

import pytest

from pipelines.budget import Budget, BudgetError, CountingModel, Plan, check_affordable
from pipelines.cli import main
from pipelines.engine.usage import Metered, Usage, sum_usage

SMALL_TASK = str(Path(__file__).parent / "data" / "risk_small.yaml")


def plan(seed=10, step=100, select=5, test=50, steps=3) -> Plan:
    return Plan(steps=steps, phases={
        "seed": {"target": Usage(seed, 10 * seed)}, "steps": {"target": Usage(step, 10 * step), "policy": Usage(4, 40, 8)},
        "select": {"target": Usage(select, 10 * select)}, "test": {"target": Usage(test, 10 * test), "judge": Usage(2, 20)}})


def test_a_plan_adds_its_phases_and_prices_what_is_left():
    p = plan()
    assert p.total()["target"] == Usage(10 + 3 * 100 + 5 + 50, 10 * (10 + 300 + 5 + 50))
    assert p.total(steps=1)["target"].calls == 10 + 100 + 55 and p.total()["policy"] == Usage(12, 120, 24)
    assert p.ending() == {"target": Usage(55, 550), "judge": Usage(2, 20), "policy": Usage()}
    spent = {"target": Usage(110, 1100)}  # the seed and one step
    assert p.affords(Budget(max_target_calls=265), spent, 1) is None  # 110 + 100 + 55 fits exactly
    assert "266 target calls > --max-target-calls 265" in p.affords(Budget(max_target_calls=265), {"target": Usage(111)}, 1)
    assert p.affords(Budget(), spent, 5) is None  # no budget: everything fits
    # tokens count the target's and the judge's, prompt and completion, not the policy's
    assert p.affords(Budget(max_tokens=1100 + 1000 + 550 + 20), spent, 1) is None
    assert "2670 target and judge tokens > --max-tokens 2669" in p.affords(Budget(max_tokens=2669), spent, 1)


def test_a_budget_below_the_seed_and_the_test_refuses_to_start():
    check_affordable(plan(), Budget(max_target_calls=65))  # seed 10 + select 5 + test 50
    with pytest.raises(BudgetError, match="about 65 target calls"):
        check_affordable(plan(), Budget(max_target_calls=64))


def test_usage_adds_per_role_and_metered_counts_one_roles_share_of_a_shared_scorer():
    assert sum_usage({"target": Usage(1, 2, 3)}, {"target": {"calls": 1, "prompt_tokens": 1}, "judge": Usage(1)}) == {
        "target": Usage(2, 3, 3), "judge": Usage(1)}

    class Tok:
        chat_template = "<user> {content} <assistant>"

        def __call__(self, text, add_special_tokens=False):
            return type("Ids", (), {"input_ids": text.split()})()

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "<user> " + messages[0]["content"] + " <assistant>"

    from templates.template import Template

    shared = CountingModel(["yes", "no"], Tok(), chat_template=True, served=False)
    target, judge = Metered(shared), Metered(shared)
    t = Template("Is this a scam? {text}", ("text",))
    target.answer(t, ["a b", "c", "a b"], 4)  # two distinct inputs: two calls; prompts of 6 + 2 and 6 + 1 words
    target.score(t, ["a b"])  # a local answer read the labels already: free
    judge.score(Template("Grade: {text}", ("text",)), ["x"])
    assert target.usage == Usage(2, 8 + 7, 8) and judge.usage == Usage(1, 4, 0) and shared.usage == Usage(3, 19, 8)
    served = CountingModel(["yes", "no"], Tok(), chat_template=True, served=True)
    served.answer(t, ["a b"], 4)
    served.score(t, ["a b"])  # a server gives an answer or log-probs: two requests
    assert served.usage.calls == 2


def test_estimate_prints_a_table_and_runs_nothing(tmp_path, capsys, monkeypatch):
    import pipelines.budget

    timed, calibrate = [], pipelines.budget.calibrate

    def calibrate_once(*args):  # the scorer is timed for real once; the JSON and budget checks below reuse it
        if not timed:
            timed.append(calibrate(*args))
        return timed[0]

    monkeypatch.setattr(pipelines.budget, "calibrate", calibrate_once)
    run_dir = tmp_path / "run"
    code = main(["--task", SMALL_TASK, "--steps", "2", "--dev-examples", "0", "--run-dir", str(run_dir), "--estimate"])
    out = capsys.readouterr().out
    assert code == 0 and not run_dir.exists()
    assert "estimate for task risk-small: 2 steps x 4 candidates, 24 dev examples" in out
    for phase in ("seed", "2 steps", "test", "total"):
        assert phase in out
    assert "wall time on this machine, about" in out and len(timed) == 1  # a local model: its scorer timed
    assert main(["--task", SMALL_TASK, "--steps", "2", "--estimate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    one_step = data["phases"]["steps"]["target"]["calls"]
    assert data["total"]["target"]["calls"] == sum(
        p["target"]["calls"] * (2 if name == "steps" else 1) for name, p in data["phases"].items() if "target" in p)
    assert one_step > 0 and data["budget_steps"] == 2  # no budget: every step
    assert data["seconds"]["total"] > data["seconds"]["steps"] > 0
    # a budget one step short of the whole run pays for one step (how many calls depends on the machine: a local
    # bfloat16 model scores the labels in a pass of its own)
    short = data["total"]["target"]["calls"] - one_step
    assert main(["--task", SMALL_TASK, "--steps", "2", "--estimate", "--json", "--max-target-calls", str(short)]) == 0
    assert json.loads(capsys.readouterr().out)["budget_steps"] == 1


def test_a_budget_too_small_exits_2_before_writing_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--task", SMALL_TASK, "--max-target-calls", "10", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the budget cannot pay for measuring the seed and the final test") and err.count("\n") == 1
    assert not run_dir.exists()
    for bad in (["--max-target-calls", "0"], ["--max-tokens", "-5"], ["--steps", "-3"], ["--max-concurrency", "0"],
                ["--request-timeout", "nan"]):
        with pytest.raises(SystemExit) as exited:  # argparse refuses it: exit 2, one line naming the flag
            main(["--task", SMALL_TASK, *bad, "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and bad[0] in err and not run_dir.exists()


@pytest.mark.slow  # one more real tuning run
def test_a_run_stops_at_its_budget_tests_its_best_and_spends_what_was_estimated(tmp_path, capsys, ray_session):
    args = ["--task", SMALL_TASK, "--steps", "2", "--dev-examples", "12", "--wandb-mode", "disabled"]
    assert main([*args, "--estimate", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    one_step_and_the_rest = est["total"]["target"]["calls"] - est["phases"]["steps"]["target"]["calls"]
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'store.sqlite'}"
    code = main([*args, "--max-target-calls", str(one_step_and_the_rest), "--run-dir", str(run_dir), "--store", store,
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "stopping before step 2 of 2" in captured.err
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 1 and report["stopped"].startswith("budget: step 2")
    spent = report["usage"]["total"]
    assert spent["target"]["calls"] <= one_step_and_the_rest  # within the budget, the final test included
    expected = report["estimate"]["for_steps_run"]
    # the estimate of the run it made, against what it made, phase by phase. The seed, the step and the test are
    # priced as the run makes them: the target's calls within 10% (the test less the chosen candidate's part when
    # the seed was kept). The choice is priced as if each finalist were evaluated by a worker whose cache never
    # saw it, the bound the budget needs (pipelines/budget.py): the run spends at most that, and at most the whole.
    made, priced = report["usage"]["phases"], report["estimate"]["phases"]
    calls = {phase: made[phase]["target"]["calls"] for phase in ("seed", "steps", "select", "test")}
    estimated = {phase: priced[phase]["target"]["calls"] for phase in ("seed", "select")}
    estimated["steps"] = report["steps"] * priced["steps"]["target"]["calls"]
    estimated["test"] = expected["target"]["calls"] - sum(estimated.values())
    for phase in ("seed", "steps", "test"):
        assert abs(calls[phase] - estimated[phase]) <= 0.10 * estimated[phase], (phase, calls, estimated)
    assert calls["select"] <= estimated["select"] and spent["target"]["calls"] <= expected["target"]["calls"]
    # the judge's at most the estimate (two templates that answer an input alike give the judge the same pair,
    # graded once)
    assert 0 < spent["judge"]["calls"] <= expected["judge"]["calls"] and spent["policy"]["calls"] == expected["policy"]["calls"]
    for role in ("target", "policy"):  # tokens are priced at their longest
        assert spent[role]["prompt_tokens"] <= expected[role]["prompt_tokens"]
        assert spent[role]["completion_tokens"] <= expected[role]["completion_tokens"]
    # the choice on dev was tested (the seed alone when it kept the seed) and recorded; each step logged its calls
    chosen = report["choice"]["chosen"] is not None
    assert len(report["test"]) == 1 + chosen and report["promotion"]
    assert {"usage/target/calls", "usage/judge/prompt_tokens", "usage/policy/completion_tokens"} <= set(report["history"][0])
    from templates.store import TemplateStore

    with TemplateStore(store, create=False) as s:
        assert len(s.list_versions("risk-small")) == 1 + chosen


# --- the counting stand-ins price what the real scorers spend, call for call ---------------------------------
INSTRUCTIONS = ("Flag prizes, urgent payments and premium numbers as scams.", "Read it twice. Is anyone asking for money?")


def _work(scorer, task):
    """What a run asks of a scorer, in miniature: candidates on the dev sample, a shortlist on the whole dev
    split, the seed and a finalist on the test split with latency."""
    seed = task.seed_template().text
    candidates = [task.compose(text) for text in INSTRUCTIONS]
    scorer.measure([seed])
    scorer.measure(candidates + [candidates[0]])  # a repeated candidate is free
    scorer.measure(candidates, whole_dev=True)
    for text in (seed, candidates[0]):
        scorer.evaluate(text, "test", latency=True)
    return scorer.spent()


def _counted(task, splits, tokenizer, target, judge=None):
    from pipelines.budget import counting_models
    from pipelines.scoring import CandidateScorer

    return _work(CandidateScorer(task, splits, *counting_models(task, tokenizer, target, judge), tokenizer,
                                 reward_examples=12), task)


@pytest.mark.slow  # a scorer pass per phase; the served model's count is in the default tier
def test_counting_prices_the_in_process_scorer_call_for_call():
    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import EMBEDDED, load_causal_lm
    from pipelines.scoring import build_scorer

    task = load_task(SMALL_TASK)
    splits = load_splits(task)
    lm = load_causal_lm()
    real = _work(build_scorer(task, splits, lm, reward_examples=12), task)
    priced = _counted(task, splits, lm.tokenizer, EMBEDDED)
    assert real["target"].calls == priced["target"].calls > 0
    assert abs(real["target"].prompt_tokens - priced["target"].prompt_tokens) <= 0.02 * priced["target"].prompt_tokens
    assert real["target"].completion_tokens <= priced["target"].completion_tokens  # answers stop early
    assert 0 < real["judge"].calls <= priced["judge"].calls  # alike answers make alike judge items, graded once


def test_counting_prices_a_served_model_call_for_call():
    import importlib.util

    from pipelines.config import Endpoint, load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import load_tokenizer
    from pipelines.scoring import build_scorer

    spec = importlib.util.spec_from_file_location("openai_compat_server", Path(__file__).with_name("openai_compat_server.py"))
    srv = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(srv)

    def rule(prompt):  # the first word of the message decides; the judge always says yes
        return [("yes", -0.2), ("no", -1.8)] if len(prompt) % 2 else [("no", -0.2), ("yes", -1.8)]

    task = load_task(SMALL_TASK)
    splits = load_splits(task)
    with srv.OpenAICompatServer(srv.ScriptedBackend(rule), "scripted") as server:
        endpoint = Endpoint(server.base_url, "scripted")
        real = _work(build_scorer(task, splits, endpoint, reward_examples=12), task)
        requests = server.completion_requests
    priced = _counted(task, splits, load_tokenizer(), endpoint)
    assert real["target"].calls + real["judge"].calls == requests  # every request the server answered, counted once
    assert real["target"].calls == priced["target"].calls > 0  # an answer and the log-probs: two requests a pair
    assert 0 < real["judge"].calls <= priced["judge"].calls


def test_wall_time_follows_the_computed_tokens_of_each_phase():
    from pipelines.budget import REFERENCE_POLICY_S, STARTUP_S, Plan, Timing, local_seconds

    plan = Plan(steps=3, work={"seed": 1000, "steps": 10000, "select": 4000, "test": 10000})
    timing = Timing(tokens_per_s=500.0, workers=2, policy_s_per_candidate=2.0)
    got = local_seconds(plan, timing, candidates=6)
    assert got["seed"] == 1000 / 500  # the seed runs on one worker
    assert got["steps"] == 3 * (10000 / 1000 + 6 * 2.0)
    assert got["select"] == 4 and got["test"] == 10 and got["startup"] == STARTUP_S
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    # a machine half as fast scores and updates the policy at half the rate
    assert Timing.scaled(1000.0, 2).policy_s_per_candidate == 2 * Timing.scaled(2000.0, 2).policy_s_per_candidate
    assert Timing.scaled(1000.0, 2).policy_s_per_candidate > REFERENCE_POLICY_S / 10
    # with no update (best-of-N, the default) the policy only samples: half the reference's time, which updated too
    sampling, updating = (Timing.scaled(1000.0, 2, update).policy_s_per_candidate for update in ("none", "ppo"))
    assert sampling == updating / 2


def test_computed_tokens_count_a_prefix_once_per_call_and_each_pair_s_own_tokens():
    class Tok:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return type("Ids", (), {"input_ids": text.split()})()

    from templates.template import Template

    model = CountingModel(["yes", "no"], Tok(), chat_template=False, served=False)
    t = Template("one two three {text} four", ("text",))  # a prefix of 3 words, 1 after the input
    model.score(t, ["a b", "c", "a b"])
    assert model.work == 3 + (2 + 1) + (1 + 1)  # the prefix once, each new pair's input and what follows it
    model.score(t, ["a b"])
    assert model.work == 8  # cached: nothing computed
    model.answer(Template("x {text} y", ("text",)), ["d e"], 4)
    assert model.work == 8 + 1 + (2 + 1) + 4  # a new template's prefix, the pair, the answer's new tokens
