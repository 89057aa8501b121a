"""The promotion gate: every bar refuses on its own and says why."""

import math
from dataclasses import replace

import pytest

from templates.gate import Measurements, PromotionConfig, decide, percentile

CONFIG = PromotionConfig(
    thresholds={"instruction_following": 0.82, "entity_consistency": 0.78},
    metric="balanced_accuracy",
    min_improvement=0.01,
    max_template_tokens=400,
    max_latency_p95_increase=0.2,
    max_render_us=80.0,
    max_error_rate=0.02,
)
INCUMBENT = Measurements(
    components={"instruction_following": 0.85, "entity_consistency": 0.80},
    heldout_metric=0.70,
    template_tokens=300,
    latency_p95_ms=100.0,
    error_rate=0.0,
    render_us_p99=10.0,
)
GOOD = replace(INCUMBENT, heldout_metric=0.75)


def test_a_good_candidate_passes_every_check_and_says_so():
    decision = decide(GOOD, INCUMBENT, CONFIG)
    assert decision.promote
    assert len(decision.reasons) == 7
    assert all(r.startswith("pass: ") for r in decision.reasons)


@pytest.mark.parametrize(
    "change, expected_reason",
    [
        ({"components": {"instruction_following": 0.79, "entity_consistency": 0.80}},
         "fail: instruction_following 0.79 < 0.82"),
        ({"components": {"instruction_following": 0.85, "entity_consistency": 0.70}},
         "fail: entity_consistency 0.7 < 0.78"),
        ({"components": {"instruction_following": 0.85}}, "fail: entity_consistency nan < 0.78"),
        ({"components": {"instruction_following": math.nan, "entity_consistency": 0.80}},
         "fail: instruction_following nan < 0.82"),
        ({"components": {"instruction_following": None, "entity_consistency": 0.80}},
         "fail: instruction_following nan < 0.82"),
        ({"heldout_metric": 0.705}, "fail: balanced_accuracy 0.705 vs incumbent 0.7: gain +0.005 < required 0.01"),
        ({"heldout_metric": 0.60}, "fail: balanced_accuracy 0.6 vs incumbent 0.7: gain -0.1 < required 0.01"),
        ({"template_tokens": 401}, "fail: template_tokens 401 > 400"),
        ({"latency_p95_ms": 121.0}, "fail: latency_p95_ms 121 > 120 (incumbent 100 +20%)"),
        ({"latency_p95_ms": math.nan}, "fail: latency_p95_ms nan > 120 (incumbent 100 +20%)"),
        ({"render_us_p99": 81.0}, "fail: render_us_p99 81 > 80"),
        ({"error_rate": 0.03}, "fail: error_rate 0.03 > 0.02"),
    ],
)
def test_each_check_refuses_on_its_own(change, expected_reason):
    decision = decide(replace(GOOD, **change), INCUMBENT, CONFIG)
    assert not decision.promote
    failed = [r for r in decision.reasons if r.startswith("fail")]
    assert failed == [expected_reason]


def test_values_exactly_at_the_bars_pass():
    # Field for field like INCUMBENT above by design: each value sits exactly on CONFIG's bar for it.
    edge = replace(
        GOOD,
        components={"instruction_following": 0.82, "entity_consistency": 0.78},
        heldout_metric=0.71,
        template_tokens=400,
        latency_p95_ms=120.0,
        render_us_p99=80.0,
        error_rate=0.02,
    )
    decision = decide(edge, INCUMBENT, CONFIG)
    assert decision.promote, decision.reasons


def test_every_failure_is_reported_not_just_the_first():
    bad = Measurements({}, 0.1, 10_000, 999.0, 0.5, 500.0)
    decision = decide(bad, INCUMBENT, CONFIG)
    assert not decision.promote
    assert sum(r.startswith("fail") for r in decision.reasons) == 7


def test_without_an_incumbent_the_comparisons_pass_and_say_why():
    slow = replace(GOOD, heldout_metric=0.01, latency_p95_ms=10_000.0)
    decision = decide(slow, None, CONFIG)
    assert decision.promote
    assert "pass: balanced_accuracy: no incumbent, nothing to improve on" in decision.reasons
    assert "pass: latency_p95_ms 1e+04: no incumbent to compare with" in decision.reasons


def test_without_an_incumbent_the_absolute_bars_still_refuse():
    decision = decide(replace(GOOD, error_rate=0.5), None, CONFIG)
    assert not decision.promote
    assert [r for r in decision.reasons if r.startswith("fail")] == ["fail: error_rate 0.5 > 0.02"]


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 95) == 95
    assert percentile(values, 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("thresholds", {"instruction_following": "high"}, "must be a finite number"),
        ("thresholds", {"instruction_following": math.nan}, "must be a finite number"),
        ("thresholds", {"": 0.5}, "non-empty string"),
        ("metric", "", "held-out metric"),
        ("min_improvement", -0.1, "use 0 to accept any non-regression"),
        ("max_template_tokens", 0, "positive integer"),
        ("max_template_tokens", 12.5, "positive integer"),
        ("max_latency_p95_increase", -0.1, "e.g. 0.2 for \\+20%"),
        ("max_render_us", 0, "> 0 microseconds"),
        ("max_error_rate", 1.5, "between 0 and 1"),
        ("max_error_rate", math.nan, "between 0 and 1"),
    ],
)
def test_config_validation_names_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        replace(CONFIG, **{field: value})


def test_config_is_frozen_and_keeps_its_own_copy_of_thresholds():
    thresholds = {"instruction_following": 0.5}
    config = replace(CONFIG, thresholds=thresholds)
    thresholds["instruction_following"] = 0.99
    assert config.thresholds["instruction_following"] == 0.5
    with pytest.raises(TypeError):
        config.thresholds["instruction_following"] = 0.1
    with pytest.raises(AttributeError):
        config.metric = "accuracy"
