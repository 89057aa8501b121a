"""The race's screening rung (CandidateScorer.measure(screen=True)) with the real embedded model in float32: it reads
the same label log-odds as the full measurement on the same examples, and only those (no answers, rates or judge)."""

import numpy as np
import pytest

from pipelines.config import load_task
from pipelines.data import load_splits

INSTRUCTIONS = ["Read the SMS message below.",
                "Decide whether the SMS message below is a scam: prizes, urgent payments and premium numbers are."]


@pytest.fixture(scope="module")
def scorers():
    from pipelines.engine.models import load_causal_lm
    from pipelines.scoring import build_scorer

    task = load_task("risk").with_overrides(**{"scoring.racing.first_examples": 12})
    splits = load_splits(task)
    lm = load_causal_lm(dtype="float32")
    # two scorers, so that neither reads the other's cached pairs
    return task, build_scorer(task, splits, lm, reward_examples=24), build_scorer(task, splits, lm, reward_examples=24)


@pytest.mark.e2e
def test_the_screen_reads_the_full_measurements_log_odds_on_its_slice(scorers):
    task, screen, full = scorers
    texts = [task.compose(i) for i in INSTRUCTIONS]
    screened = screen.measure(texts, examples=12, screen=True)
    measured = full.measure(texts)
    for text, s, m in zip(texts, screened, measured):
        template = screen.validate(text).template
        a = screen.label_logprobs(template, screen.dev[:12])  # cached by the screen
        b = full.label_logprobs(template, full.dev[:12])  # cached by the full measurement's answer pass
        np.testing.assert_allclose(a, b, atol=1e-4)
        # what the screen measured, and what it left to the full measurement
        assert s.measured.rates == {} and s.measured.pdr == {} and s.measured.judge == {}
        assert s.reward.components["instruction_following"] is None and s.reward.components["coherence"] is None
        assert 0 <= s.measured.readability <= 1 and s.measured.readability == pytest.approx(m.measured.readability)
        assert set(m.measured.rates) == {"instruction_following", "entity_consistency"}
    assert screen.target.usage.completion_tokens == 0  # no greedy answers
    assert full.target.usage.completion_tokens > 0


@pytest.mark.e2e
def test_a_screen_of_the_whole_sample_also_reads_instruction_following_on_the_first_slice(scorers):
    """A race's second rung under racing.second: screen (and the seed's row) counts the greedy answers of the first
    slice that keep the contract, the same answers the full measurement parses there."""
    task, screen, full = scorers
    texts = [task.compose(i) for i in INSTRUCTIONS]
    whole = screen.measure(texts, screen=True)
    for text, s in zip(texts, whole):
        kept, of = s.measured.rates["instruction_following"]
        assert of == screen.first_rung == 12 and 0 <= kept <= of and "entity_consistency" not in s.measured.rates
        template = screen.validate(text).template
        parsed = full.responses(template, full.dev[:12]).kept()
        assert (kept, of) == parsed
        assert s.reward.components["instruction_following"] == kept / of
