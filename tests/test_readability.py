"""rewards/readability.py: the text features without a model, the calibration fixture's shape, and (e2e) the
measure with the real embedded model over the whole fixture."""

from pathlib import Path

import pytest
import yaml

from rewards import readability as R
from rewards.promptbench_metrics import roc_auc

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "readability_fixture.yaml"
TASKS = ("risk", "sentiment", "snippets", "callback")
KINDS = {"handwritten", "past_winner", "word_salad", "shuffled", "markup"}


def task_file(task: str) -> dict:
    return yaml.safe_load((REPO / "pipelines" / "tasks" / f"{task}.yaml").read_text())


def fixture_items() -> list[dict]:
    return yaml.safe_load(FIXTURE.read_text())["items"]


# --- text features, no model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("Read the SMS message below.", 1.0),
    ("Decide whether the critic's verdict is favourable (fresh).", 1.0),
    ("It\u2019s a premium-rate number.", 1.0),  # a typographic apostrophe and a hyphenated word
    ("Copy 87121 exactly.", 2 / 3),  # a number is not a word
    ("ImplementedimprofuidaHismoreese Simyonad", 0.0),
    ("", 0.0),
])
def test_dictionary_share(text, expected):
    assert R.dictionary_share(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, marks", [
    ("Read the SMS message below.", 0),
    ("Say \u201cyes\u201d \u2013 or no.", 0),  # typographic quotes and dashes are prose
    ("See https://bit.ly/x now", 1 + 1),  # the scheme, and the slash after the domain
    ("<b>Read</b>", 5),
    ("`True` or `False`", 4),
    ("Line one\nline two", 1),
    ("\u62e8\u6253 the number", 2),
])
def test_markup_per_word(text, marks):
    assert R.markup_per_word(text) == pytest.approx(marks / max(1, len(text.split())))


@pytest.mark.parametrize("text, complete", [
    ("Read the SMS message below.", 1.0), ("Is it a scam?", 1.0), ('Reply "stop."', 1.0), ("Answer (yes or no.)", 1.0),
    ("Read the SMS message below", 0.0), ("Title: Ensure Positive Movie Reviews Fri. 4 Feb", 0.0), ("", 0.0),
])
def test_ends_sentence(text, complete):
    assert R.ends_sentence(text) == complete


def test_offtask_names_count_capitals_inside_sentences_that_the_description_lacks():
    risk = task_file("risk")["description"]
    assert R.offtask_name_share("Read the SMS message below. Then decide: Scam or not?", risk) == 0.0
    # "Meri", "Benemu", "Ex", "Libris" are capitalized mid-sentence and absent from the description.
    text = "The job uses Meri and Benemu Ex Libris to check messages."
    assert R.offtask_name_share(text, risk) == pytest.approx(4 / 11)
    sentiment = task_file("sentiment")["description"]
    assert R.offtask_name_share("Read the snippet from Rotten Tomatoes.", sentiment) == 0.0
    assert R.offtask_name_share("I think it is fine.", sentiment) == 0.0


def test_combine_is_a_logistic_function_that_rises_with_readable_features():
    base = {"pmi": 1.0, "fluency": -6.0, "dictionary": 1.0, "markup": 0.0, "complete": 1.0, "names": 0.0}
    s = R.combine(base)
    assert 0.0 < s < 1.0
    assert R.combine({**base, "pmi": 2.0}) > s and R.combine({**base, "dictionary": 0.5}) < s
    assert R.combine({**base, "markup": 1.0}) < s and R.combine({**base, "names": 0.2}) < s
    assert R.combine({**base, "complete": 0.0}) < s


def test_constants_are_consistent():
    assert set(R.COEFFICIENTS) == set(R.FEATURES)
    assert 0.0 < R.READABILITY_FLOOR < 1.0
    assert "{description}" in R.CONDITIONED_PREFIX


def test_an_empty_instruction_scores_zero_without_reading_the_model():
    scorer = R.ReadabilityScorer(lm=None)  # never touched: nothing to read
    assert scorer.score(["", "   \n"], "Decide something.") == [0.0, 0.0]
    assert scorer.features([""], "Decide something.") == [None]


def test_the_fixture_has_the_calibration_set_its_docstring_promises():
    items = fixture_items()
    assert all(set(it) >= {"task", "kind", "text"} and it["task"] in TASKS and it["kind"] in KINDS for it in items)
    hand = [it for it in items if it["kind"] == "handwritten"]
    degraded = [it for it in items if it["kind"] != "handwritten"]
    assert len(hand) >= 48 and len(degraded) >= 48
    assert sum(it["kind"] == "past_winner" for it in degraded) * 2 >= len(degraded)
    for task in TASKS:
        assert sum(it["task"] == task for it in hand) >= 12
        seed = task_file(task)["template"]["seed_instruction"]
        assert any(it["task"] == task and it["text"] == seed for it in hand), task
    texts = [(it["task"], it["text"]) for it in items]
    assert len(texts) == len(set(texts))


# --- the measure with the real embedded model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_scores():
    """The embedded model, a scorer, and every fixture item's score (scored per task in chunks of 16)."""
    from pipelines.engine.models import load_causal_lm

    lm = load_causal_lm()
    scorer = R.ReadabilityScorer(lm)
    items = fixture_items()
    scores = [0.0] * len(items)
    for task in TASKS:
        idx = [i for i, it in enumerate(items) if it["task"] == task]
        for start in range(0, len(idx), 16):
            part = idx[start : start + 16]
            for i, s in zip(part, scorer.score([items[i]["text"] for i in part], task_file(task)["description"])):
                scores[i] = s
    return lm, items, scores


@pytest.mark.e2e
def test_the_measure_separates_handwritten_from_degraded_instructions(fixture_scores):
    _, items, scores = fixture_scores
    assert all(0.0 <= s <= 1.0 for s in scores)
    positive = [it["kind"] == "handwritten" for it in items]
    assert roc_auc(scores, positive) >= 0.95
    held = [i for i in range(len(items)) if i % 2 == 1]  # the half the coefficients were not fitted on
    assert roc_auc([scores[i] for i in held], [positive[i] for i in held]) >= 0.9
    # The floor keeps out nearly all past winners and every word salad, shuffle and markup item.
    hand = [s for s, p in zip(scores, positive) if p]
    assert sum(s >= R.READABILITY_FLOOR for s in hand) >= 0.85 * len(hand)
    winners = [s for s, it in zip(scores, items) if it["kind"] == "past_winner"]
    assert sum(s >= R.READABILITY_FLOOR for s in winners) <= 0.2 * len(winners)
    assert all(s < R.READABILITY_FLOOR for s, it in zip(scores, items)
               if it["kind"] in ("word_salad", "shuffled", "markup"))


@pytest.mark.e2e
def test_every_seed_instruction_passes_the_floor_alone_or_in_a_batch(fixture_scores):
    lm, items, scores = fixture_scores
    # bfloat16 moves a score with its bucket's padding (at most 0.008 over the fixture, measured); float32 does not.
    tolerance = 0.02 if "bfloat16" in str(lm.model.dtype) else 1e-4
    for task in TASKS:
        spec = task_file(task)
        seed = spec["template"]["seed_instruction"]
        (alone,) = R.ReadabilityScorer(lm).score([seed], spec["description"])
        assert alone >= R.READABILITY_FLOOR, (task, alone)
        in_batch = next(s for s, it in zip(scores, items) if it["task"] == task and it["text"] == seed)
        assert abs(alone - in_batch) <= tolerance, (task, alone, in_batch)
