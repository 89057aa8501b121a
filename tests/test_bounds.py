"""Every number a user gives has a range someone could mean (issue #41): each numeric setting of the task schema
is refused at load outside its Field's bounds, each numeric flag is refused by argparse with the same bounds (its
type reads the Field), and the estimate of a large but allowed run is arithmetic, not a loop over its steps.

Fast: no model is loaded (the estimate test loads the embedded tokenizer only).
"""

import math
import typing

import annotated_types
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import pipelines.cli as cli
from pipelines.budget import Budget, Plan, estimate, scoring_tokenizer
from pipelines.config import (MAX_CANDIDATES, MAX_STEPS, ConfigError, FlagSettings, RunOptions, TaskConfig,
                              load_task)
from pipelines.data import load_examples, split_examples
from pipelines.engine.usage import Usage

FEW = settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def bounds(metadata: list) -> tuple[float, float, bool, bool]:
    """(low, high, low is excluded, high is excluded) from a Field's metadata."""
    low, high, low_open, high_open = -math.inf, math.inf, False, False
    for bound in metadata:
        if isinstance(bound, (annotated_types.Ge, annotated_types.Gt)):
            low, low_open = getattr(bound, "ge", getattr(bound, "gt", None)), isinstance(bound, annotated_types.Gt)
        elif isinstance(bound, (annotated_types.Le, annotated_types.Lt)):
            high, high_open = getattr(bound, "le", getattr(bound, "lt", None)), isinstance(bound, annotated_types.Lt)
    return low, high, low_open, high_open


def numeric_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type, list]]:
    """(dotted path, int or float, the metadata holding its bounds) of every number in the schema; a mapping of
    numbers (reward weights, thresholds) and a pair of numbers (reward_clip_range) by their element type."""
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, type(int | None)) else (annotation,)
        for option in options:
            if isinstance(option, type) and issubclass(option, BaseModel):
                out += numeric_fields(option, f"{prefix}{name}.")
            elif option in (int, float) and option is not bool:
                out.append((f"{prefix}{name}", option, field.metadata))
            elif typing.get_origin(option) in (dict, tuple):
                element = typing.get_args(option)[-1 if typing.get_origin(option) is dict else 0]
                if typing.get_origin(element) is typing.Annotated:
                    kind, *infos = typing.get_args(element)
                    out.append((f"{prefix}{name}", kind, [bound for info in infos for bound in info.metadata]))
    return out


FIELDS = numeric_fields(TaskConfig)


def test_every_numeric_field_has_both_bounds():
    assert len(FIELDS) > 50
    for path, _, metadata in FIELDS:
        low, high, _, _ = bounds(metadata)
        assert math.isfinite(low) and math.isfinite(high), f"{path} has no range a user could mean"
        assert path.split(".")[-1] not in ("weights", "thresholds") or high <= 100


def outside(kind: type, metadata: list) -> st.SearchStrategy:
    """Values outside the field's bounds: below, above, huge, and NaN/inf."""
    low, high, low_open, high_open = bounds(metadata)
    if kind is int:
        below = st.integers(max_value=low if low_open else low - 1)
        above = st.integers(min_value=high if high_open else high + 1)
        return st.one_of(below, above, st.sampled_from([10**30, -10**30, 1e30, 1e308, math.nan, math.inf]))
    below = st.floats(max_value=low, exclude_max=not low_open, allow_nan=False)
    above = st.floats(min_value=high, exclude_min=not high_open, allow_nan=False)
    return st.one_of(below, above, st.sampled_from([1e30, -1e30, 1e308, math.nan, math.inf, -math.inf]))


@pytest.fixture(scope="module")
def tasks() -> dict[str, TaskConfig]:
    return {"labels": load_task("risk"), "output": load_task("tests/data/transactions_json.yaml")}


@pytest.mark.parametrize("path, kind, metadata", FIELDS, ids=[path for path, _, _ in FIELDS])
@FEW
@given(data=st.data())
def test_a_number_outside_its_bounds_is_refused_at_load_naming_the_field(tasks, path, kind, metadata, data):
    value = data.draw(outside(kind, metadata))
    task = tasks["output" if path.startswith("output.") else "labels"]
    if path.endswith(("weights", "thresholds")):  # a mapping of numbers: one of its entries
        entry = next(iter(getattr(getattr(task, path.split(".")[0]), path.split(".")[1])))
        change, named = {f"{path}.{entry}": value}, f"{path}.{entry}"
    elif path.endswith("reward_clip_range"):
        change, named = {path: (value, 10.0)}, path
    else:
        change, named = {path: value}, path
    with pytest.raises(ConfigError) as refused:
        task.with_overrides(**change)
    message = str(refused.value)
    assert named in message and "\n" not in message and len(message) < 600


def test_built_in_tasks_lie_inside_the_bounds():
    for name in ("risk", "sentiment", "snippets", "callback"):
        load_task(name)
    for path in ("cases_4label", "products_multi", "risk_served", "risk_small", "transactions_json"):
        load_task(f"tests/data/{path}.yaml")


# --- flags ------------------------------------------------------------------------------------------------------

def numeric_flags() -> list[tuple[list[str], str, object]]:
    """(the command's words, the flag, its argparse type) of every flag whose type is a bounded number."""
    out = []

    def walk(parser, words):
        for action in parser._actions:
            if getattr(action.type, "bounds", None) is not None:
                out.append((words, action.option_strings[-1], action.type))
            for name, sub in (getattr(action, "choices", None) or {}).items() if action.nargs == "A..." else ():
                walk(sub, words + [name])
    walk(cli.build_parser(), [])
    return out


FLAGS = numeric_flags()


def test_every_numeric_flag_reads_bounds():
    flags = {flag for _, flag, _ in FLAGS}
    assert {"--steps", "--candidates", "--num-scorers", "--finalists", "--dev-examples", "--max-retries",
            "--request-timeout", "--max-concurrency", "--top-logprobs", "--seed", "--max-target-calls",
            "--max-tokens", "--min-metric", "--max-drop", "--every-s", "--max-ticks", "--poll-s", "-n"} <= flags
    untyped = []

    def walk(parser, words):
        for action in parser._actions:
            if action.type in (int, float):
                untyped.append(" ".join(words + action.option_strings))
            for name, sub in (getattr(action, "choices", None) or {}).items() if action.nargs == "A..." else ():
                walk(sub, words + [name])
    walk(cli.build_parser(), [])
    assert untyped == [], untyped


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused_in_one_line(argv, capsys) -> str:
    code, out, err = run(argv, capsys)
    assert code == 2, (argv, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and len(err) < 400, err
    return err


@pytest.mark.parametrize("words, flag, kind", FLAGS, ids=[" ".join(w + [f]) for w, f, _ in FLAGS])
def test_a_flag_outside_its_bounds_is_exit_2_in_one_line(capsys, words, flag, kind):
    low, high, whole, above = kind.bounds
    values = [str(low - 1) if whole else str(low - 0.5), str(high + 1), "1e30", "-1e30", "nan", "inf",
              "1" + "0" * 5000]
    if above:
        values.append(str(low))
    for value in values:
        err = refused_in_one_line(words + [f"{flag}={value}"], capsys)
        assert flag in err and ("out of range" in err or "not a whole number" in err), err


@pytest.mark.parametrize("argv", [
    ["--candidates", "0"], ["--candidates", "1000000000"], ["--num-scorers", "0"], ["--num-scorers", "-1"],
    ["--finalists", "0"], ["--finalists", "-1"], ["--finalists", "1000000000"], ["--dev-examples", "-1"],
    ["--max-retries", "1000000"], ["--steps", "1000000"], ["--request-timeout", "nan"], ["--seed", "-1"],
])
def test_the_estimate_refuses_settings_no_one_means(capsys, argv):
    err = refused_in_one_line(["--task", "risk", "--estimate", *argv], capsys)
    assert argv[0] in err


@pytest.mark.parametrize("args", [["--share", "nan"], ["--share", "1.5"], ["--ramp", "0.05,inf"], ["--ramp", "0.1,x"]])
def test_a_canary_share_or_ramp_step_outside_0_to_1_is_refused_by_the_flag(capsys, args):
    err = refused_in_one_line(["store", "route", "risk", "--canary", "2", *args], capsys)
    assert f"argument {args[0]}" in err and ("from 0 to 1" in err or "is not a number" in err)


def test_a_ramp_of_100000_steps_is_refused_in_a_short_line(capsys):
    ramp = ",".join(f"{(i + 1) / 100_000:.6f}" for i in range(100_000))
    err = refused_in_one_line(["store", "route", "risk", "--canary", "2", "--ramp", ramp], capsys)
    assert "more than 20 steps" in err


def test_flag_defaults_lie_inside_their_bounds():
    FlagSettings()  # validates its own defaults
    options = RunOptions()
    assert (options.num_scorers, options.dev_examples) == (FlagSettings().num_scorers, FlagSettings().dev_examples)


# --- the estimate of a large run -------------------------------------------------------------------------------

def test_the_budget_steps_are_found_without_a_loop_over_the_steps():
    plan = Plan(steps=MAX_STEPS, phases={"seed": {"target": Usage(10, 100, 0)}, "steps": {"target": Usage(7, 70, 0)},
                                         "select": {"target": Usage(20, 200, 0)}, "test": {"target": Usage(30, 300, 0)}})
    ending = 10 + 20 + 30
    assert plan.affordable_steps(Budget()) == MAX_STEPS
    assert plan.affordable_steps(Budget(max_target_calls=ending + 7 * 1234 + 6)) == 1234
    assert plan.affordable_steps(Budget(max_target_calls=ending - 1)) is None
    assert plan.affordable_steps(Budget(max_target_calls=10**12)) == MAX_STEPS
    assert plan.total()["target"].calls == ending + 7 * MAX_STEPS


def test_an_estimate_at_the_largest_steps_and_candidates_is_arithmetic():
    task = load_task("tests/data/risk_small.yaml").with_overrides(**{"generation.candidates_per_step": MAX_CANDIDATES})
    options = RunOptions(steps=MAX_STEPS)
    splits = split_examples(task, load_examples(task))
    plan = estimate(task, options, splits, scoring_tokenizer(options.target))
    step = plan.phases["steps"]
    assert step["policy"].calls == MAX_CANDIDATES
    assert plan.total()["policy"].calls == MAX_STEPS * MAX_CANDIDATES
    assert plan.affordable_steps(Budget(max_target_calls=10**12)) == MAX_STEPS
    rows = plan.rows()
    assert rows[-1]["phase"] == "total" and rows[0]["phase"] == "seed"
