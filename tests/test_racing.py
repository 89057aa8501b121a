"""Racing (pipelines/racing.py): which candidates go on, what each is measured on, what it cost.

Pure logic with a scripted measure; the real scorer's racing is exercised by the end-to-end run in
tests/test_tuning.py and priced by tests/test_budget.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pipelines.config import load_task
from pipelines.engine.usage import Usage
from pipelines.racing import race, race_candidates


@dataclass(frozen=True)
class _M:
    valid: bool


@dataclass(frozen=True)
class _R:
    total: float


@dataclass(frozen=True)
class _Scored:
    measured: _M
    reward: _R
    examples: int | None
    usage: dict = field(default_factory=dict)
    screen: object = None


class ScriptedMeasure:
    """Rewards from a table; a text starting with "bad" is invalid. Every call is recorded; usage counts the
    examples a call measured (the whole sample is 100)."""

    def __init__(self, rewards: dict[str, float]):
        self.rewards = rewards
        self.calls: list[tuple[list[str], int | None]] = []

    def __call__(self, texts, examples):
        self.calls.append((list(texts), examples))
        n = examples or 100
        return [_Scored(_M(not t.startswith("bad")), _R(self.rewards.get(t, -1.0)), examples,
                        {"target": Usage(n, 10 * n, 0)}) for t in texts]


def test_the_best_on_the_slice_go_on_and_only_they_finish():
    measure = ScriptedMeasure({"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7, "e": 0.2})
    scored, finished = race(measure, ["a", "b", "c", "d", "e"], first_examples=25, keep=2, sample_size=100)
    assert measure.calls == [(["a", "b", "c", "d", "e"], 25), (["b", "d"], None)]
    assert finished == [False, True, False, True, False]
    assert [s.examples for s in scored] == [25, None, 25, None, 25]
    # a finisher's cost is both rungs' (the scorer's cache makes the second pay only for the new examples)
    assert scored[1].usage["target"] == Usage(25 + 100, 1250, 0)
    assert scored[0].usage["target"] == Usage(25, 250, 0)
    # every sample keeps its first rung's reward: a finisher's as ``screen``, the others' as their only one
    from pipelines.racing import first_rung_reward

    assert [first_rung_reward(s) for s in scored] == [0.1, 0.9, 0.5, 0.7, 0.2]
    assert scored[1].screen == _R(0.9) and scored[0].screen is None


def test_invalid_candidates_never_go_on_even_when_few_are_valid():
    measure = ScriptedMeasure({"a": 0.1, "bad1": 5.0, "bad2": 5.0})
    scored, finished = race(measure, ["bad1", "a", "bad2"], first_examples=25, keep=2, sample_size=100)
    assert finished == [False, True, False]
    assert measure.calls[1] == (["a"], None)
    measure = ScriptedMeasure({})
    scored, finished = race(measure, ["bad1", "bad2", "bad3"], first_examples=25, keep=2, sample_size=100)
    assert finished == [False, False, False] and len(measure.calls) == 1


@pytest.mark.parametrize("first, keep, sample", [(0, 2, 100), (100, 2, 100), (150, 2, 100), (25, 5, 100), (25, 9, 100)])
def test_no_race_when_it_would_save_nothing(first, keep, sample):
    measure = ScriptedMeasure({"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5})
    scored, finished = race(measure, list("abcde"), first, keep, sample)
    assert measure.calls == [(list("abcde"), None)] and finished == [True] * 5


def test_ties_on_the_slice_keep_the_earlier_candidate():
    measure = ScriptedMeasure({"a": 0.5, "b": 0.5, "c": 0.5})
    _, finished = race(measure, ["a", "b", "c"], first_examples=10, keep=1, sample_size=100)
    assert finished == [True, False, False]


def test_race_candidates_reads_the_task_and_the_sample_size():
    task = load_task("risk")

    class Measurer:
        sample_size = 100
        first_rung = task.scoring.racing.first_examples

        def __init__(self):
            self.script = ScriptedMeasure({f"t{i}": i / 10 for i in range(8)})

        def measure(self, texts, examples=None, screen=False):
            racing = task.scoring.racing  # the first rung screens; the second too where the task says so
            assert screen == (racing.screen and (examples is not None or racing.second == "screen"))
            return self.script(texts, examples)

    measurer = Measurer()
    _, finished = race_candidates(task, measurer, [f"t{i}" for i in range(8)])
    racing = task.scoring.racing
    assert measurer.script.calls[0][1] == racing.first_examples
    assert finished == [i >= 8 - racing.keep for i in range(8)]
    measurer = Measurer()
    measurer.first_rung = 0  # racing off
    _, finished = race_candidates(task, measurer, [f"t{i}" for i in range(8)])
    assert measurer.script.calls == [([f"t{i}" for i in range(8)], None)] and all(finished)


def test_every_prefix_of_the_stratified_order_holds_the_labels_in_their_shares():
    from pipelines.data import Example
    from pipelines.scoring import stratified_order

    examples = [Example(f"h{i}", "high") for i in range(10)] + [Example(f"l{i}", "low") for i in range(30)]
    ordered = stratified_order(examples)
    assert sorted(e.text for e in ordered) == sorted(e.text for e in examples)  # the same examples
    assert [e.text for e in ordered if e.label == "high"] == [f"h{i}" for i in range(10)]  # order kept per label
    for k in range(4, 41, 4):
        highs = sum(e.label == "high" for e in ordered[:k])
        assert abs(highs - k / 4) <= 1, (k, highs)
    assert stratified_order([]) == []


def scorer(task, splits):
    """The run's scorer over the counting stand-ins (pipelines/budget.py): what it asks, with no model."""
    from pipelines.budget import counting_models, scoring_tokenizer
    from pipelines.engine.models import EMBEDDED
    from pipelines.scoring import CandidateScorer

    tokenizer = scoring_tokenizer(EMBEDDED)
    return CandidateScorer(task, splits, *counting_models(task, tokenizer, EMBEDDED, None), tokenizer,
                           reward_examples=100)


def test_the_dev_sample_follows_tokens_long_inputs_give_fewer_examples():
    """scoring.dev_tokens: the search sample (from the train split: scoring.search_split) stops at that many input
    tokens (at least min_dev_examples), the selection sample at twice that; short inputs keep every example asked
    for."""
    from pipelines.data import Example, Splits, load_splits

    task = load_task("risk")
    splits = load_splits(task)
    short = scorer(task, splits)
    assert len(short.dev) == 100 and len(short.selection) == len(splits.train)  # SMS messages: all of them
    assert {e.text for e in short.dev} <= {e.text for e in splits.train}  # the search never reads the dev split
    words = " ".join(["account"] * 300)  # about 300 tokens an input
    long_dev = tuple(Example(f"{i} {words}", ("high_risk", "low_risk")[i % 2]) for i in range(200))
    long = scorer(task, Splits(long_dev, splits.dev, splits.test))
    cfg = task.scoring
    assert len(long.dev) == cfg.min_dev_examples  # 7,000 tokens hold fewer than 24 such inputs: the floor
    assert len(long.dev) < len(long.selection) <= 2 * cfg.dev_tokens // 300 + 1
    assert long.selection[: len(long.dev)] == long.dev  # the selection extends the sample (its cache is reused)
    assert {e.label for e in long.dev[:4]} == {"high_risk", "low_risk"}
    unlimited = scorer(task.with_overrides(**{"scoring.dev_tokens": None}), Splits(long_dev, splits.dev, splits.test))
    assert len(unlimited.dev) == 100 and len(unlimited.selection) == 200


def test_the_auxiliary_samples_follow_tokens_and_leave_short_inputs_alone():
    """The race's first rung (racing.first_tokens), the robustness sample (scoring.robustness_tokens) and the
    inputs whose entities are swapped (scoring.entity_tokens) are sized in input tokens, each with a floor; risk's
    SMS messages keep the counts the task asks for."""
    from pipelines.data import Example, Splits, load_splits
    from templates.decision import DecisionRule

    task = load_task("risk")
    cfg = task.scoring
    splits = load_splits(task)
    short = scorer(task, splits)
    assert short.first_rung == cfg.racing.first_examples and len(short.robust_sample) == cfg.robustness_examples
    words = " ".join(["account"] * 300)  # about 300 tokens an input, a phone number in each
    long_examples = tuple(Example(f"Call 0800{i:06d} {words}", ("high_risk", "low_risk")[i % 2]) for i in range(400))
    long = scorer(task, Splits(long_examples[:200], splits.dev, long_examples))  # the search sample: train
    assert long.first_rung == 12 and len(long.robust_sample) == 10  # the floors: 1,500 / 2,000 tokens hold fewer
    assert long.robust_sample == long.dev[:10]
    seed = task.seed_template()
    rule = DecisionRule("argmax", tuple(task.labels), tuple(task.verbalizers))
    decided = short.decide(rule, short.responses(seed, list(short.splits.test), answers=False))
    kept, of = short.entity_consistency(seed, list(splits.test), rule, decided)
    assert of == 219  # every risk test message with an entity is checked
    test = list(long_examples)
    decided = long.decide(rule, long.responses(seed, test, answers=False))
    calls = long.target.usage.calls
    kept, of = long.entity_consistency(seed, test, rule, decided)
    each = {long.count_tokens(e.text) for e in test}
    assert len(each) == 1 and of == cfg.entity_tokens // each.pop()  # the first that fit 16,000 tokens
    assert long.target.usage.calls - calls == of  # each of them scored again, no more
    unlimited = scorer(task.with_overrides(**{"scoring.entity_tokens": None, "scoring.robustness_tokens": None,
                                              "scoring.racing.first_tokens": None}),
                       Splits(long_examples[:200], splits.dev, long_examples))
    assert unlimited.first_rung == 20 and len(unlimited.robust_sample) == 20
    assert unlimited.entity_consistency(seed, test, rule, decided)[1] == 400
    # racing off stays off: no slice, or a slice not smaller than the sample (race() then measures everything)
    assert scorer(task.with_overrides(**{"scoring.racing.first_examples": 0}), splits).first_rung == 0
    whole = scorer(task.with_overrides(**{"scoring.racing.first_examples": 30}),
                   Splits(long_examples[:200], splits.dev, long_examples))
    assert whole.first_rung == 30 >= whole.sample_size == 24
    # robustness reads no further than the first rung, whose clean scores are cached
    mid = tuple(Example(f"Call 0800{i:06d} " + " ".join(["account"] * 110), ("high_risk", "low_risk")[i % 2])
                for i in range(200))
    capped = scorer(task, Splits(mid, splits.dev, long_examples))
    assert 10 <= len(capped.robust_sample) <= capped.first_rung < 20
