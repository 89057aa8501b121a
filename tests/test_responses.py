"""Candidates are measured on the target's responses: greedy answers under the output contract, the decision
under entity swaps, the judge on (input, answer) pairs. Scripted targets test the logic around the model
(bad output of every kind is data, never a crash); the real embedded model checks the answers themselves and
that a template which breaks the answer format loses and is refused, whatever its log-odds do."""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import pytest

from pipelines.config import load_task
from pipelines.data import Example, Splits
from pipelines.engine.answers import Answer
from rewards.judge import response_item

# ---- a scripted target: answers and log-probs chosen per input ---------------------------------------------
NESTED = '{"a": ' * 5000 + "1" + "}" * 5000
BAD_ANSWERS = {  # input text -> (answer text, cut off at the token limit)
    "nested json": (NESTED, False),
    "huge answer": ("yes " * 50_000, False),
    "invalid utf-8": ("\udcff\udcfe", False),  # what a server's lone surrogate escapes decode to
    "cut off": ("Ye", True),
    "empty": ("", False),
    "control characters": ("\x00\x1b[31m", False),
}


class ScriptedTarget:
    """Label scorer stand-in: ``score`` gives high log-odds to inputs that mention a prize; ``answer`` says yes
    or no the same way, except for the inputs in BAD_ANSWERS."""

    verbalizers = ["yes", "no"]

    def __init__(self):
        self.stats = SimpleNamespace(pairs_scored=0)
        self.answered: list[str] = []

    def score(self, template, texts):
        self.stats.pairs_scored += len(texts)
        p = np.array([0.9 if "prize" in t else 0.2 for t in texts])
        return np.log(np.stack([p, 1 - p], axis=1))

    def answer(self, template, texts, max_new_tokens, complete=None):
        self.answered += list(texts)
        out = []
        for t in texts:
            text, cut = BAD_ANSWERS.get(t, ("Yes, a scam." if "prize" in t else "No.", False))
            out.append(Answer(text, cut, 3))
        return out


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=text.split())


def scripted_scorer(task, examples):
    from pipelines.scoring import CandidateScorer

    splits = Splits(tuple(examples), tuple(examples), tuple(examples))
    target = ScriptedTarget()
    return CandidateScorer(task, splits, target, target, Tokenizer()), target


def risk_task(decision: str):
    return load_task("risk").with_overrides(**{"scoring.decision": decision, "scoring.reward_metric": None,
                                               "scoring.judge_examples": 3,
                                               "scoring.calibration_examples": 8, "scoring.robustness_examples": 4})


EXAMPLES = [Example("You won a prize, call 09061701461 now", "high_risk"),
            Example("Claim your prize of £1000 at www.getzed.co.uk", "high_risk"),
            Example("See you at 7 for dinner", "low_risk"),
            Example("ok thanks", "low_risk")] + [Example(text, "low_risk") for text in BAD_ANSWERS]


@pytest.mark.parametrize("decision", ["calibrated", "answer"])
def test_bad_model_output_is_a_contract_failure_and_nothing_raises(decision):
    task = risk_task(decision)
    scorer, target = scripted_scorer(task, EXAMPLES)
    (scored,) = scorer.measure([task.seed_template().text])
    m = scored.measured
    assert m.valid and m.rates["instruction_following"] == (4, 10)  # the six bad answers break the contract
    ev = scorer.evaluate(task.seed_template().text, "test", latency=False)
    assert ev.measured.rates["instruction_following"] == (4, 10)
    broken = {row["input"]: row for row in scorer.samples(EXAMPLES, scorer.responses(scorer.task.seed_template(), EXAMPLES),
                                                               [None] * len(EXAMPLES), n=len(EXAMPLES))}
    assert broken["cut off"]["parsed"] == "cut off at the token limit" and not broken["cut off"]["contract_kept"]
    assert broken["empty"]["parsed"] == "empty answer"
    assert broken["invalid utf-8"]["parsed"] == "invalid UTF-8"
    assert all(not broken[t]["contract_kept"] for t in BAD_ANSWERS)
    if decision == "answer":  # a broken answer is what the application gets: no label, counted wrong
        assert ev.decision.kind == "answer"
        assert ev.measured.metrics["accuracy"] == pytest.approx(4 / 10)
        assert m.metrics["balanced_accuracy"] == pytest.approx(0.5 * (2 / 2 + 2 / 8))
    else:  # the calibrated decision reads the log-probs: every input gets a label
        assert ev.measured.metrics["accuracy"] == pytest.approx(1.0)


def test_entity_consistency_counts_inputs_with_entities_and_a_broken_answer_keeps_nothing():
    task = risk_task("answer")
    scorer, target = scripted_scorer(task, EXAMPLES)
    rule = scorer.fit_decision(task.seed_template())
    out = scorer.responses(task.seed_template(), EXAMPLES)
    decided = scorer.decide(rule, out)
    kept, with_entities = scorer.entity_consistency(task.seed_template(), EXAMPLES, rule, decided)
    # phone, amount + URL, the number 7 and the 8 of "utf-8": four inputs with entities, the swapped ones answered
    # too; "invalid utf-8" broke the contract, so its decision is not kept even though its variant's parses
    assert with_entities == 4 and kept == 3
    assert any("09061701461" not in t and "prize, call 0" in t for t in target.answered)
    broken = [None] * len(decided)
    assert scorer.entity_consistency(task.seed_template(), EXAMPLES, rule, broken) == (0, 4)


def test_the_judge_grades_input_answer_pairs_not_the_template():
    task = risk_task("calibrated")
    scorer, _ = scripted_scorer(task, EXAMPLES)
    asked = []
    scorer.judge.ask = lambda frame, items: (asked.extend(items), np.log(np.tile([0.7, 0.3], (len(items), 1))))[1]
    out = scorer.responses(task.seed_template(), EXAMPLES)
    assert scorer.judge_responses(EXAMPLES, out) == {"coherence": pytest.approx(0.7)}
    assert asked == [response_item(task.description, e.text, a.text) for e, a in zip(EXAMPLES[:3], out.answers[:3])]
    assert "Input:\n<<<\nYou won a prize" in asked[0] and "Answer:\n<<<\nYes, a scam.\n>>>" in asked[0]


def test_a_template_that_breaks_the_format_loses_on_reward_and_is_refused_by_the_gate():
    """Scripted: the second template raises the log-odds ROC-AUC but its answers break the contract."""
    from pipelines.promotion import gate

    task = risk_task("calibrated")
    scorer, target = scripted_scorer(task, EXAMPLES[:4])
    seed, broken = task.seed_template().text, task.compose("Explain your reasoning first.")
    plain_answer = target.answer

    def answer(template, texts, max_new_tokens, complete=None):
        if "reasoning" in template.text:
            return [Answer("The message looks like", True, 4) for _ in texts]
        return plain_answer(template, texts, max_new_tokens, complete)

    target.answer = answer
    a, b = scorer.measure([seed, broken])
    assert b.measured.rate("instruction_following") == 0 and a.measured.rate("instruction_following") == 1
    assert b.reward.total < a.reward.total and b.reward.components["threshold_shortfall"] == pytest.approx(-0.82)
    decision = gate(task, scorer.evaluate(broken, "test", latency=False), None)
    assert not decision.promote and "fail: instruction_following 0 < 0.82" in decision.reasons


# ---- the real embedded model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    """float32 on every machine. The claims below are exact (the cached, batched decoding is model.generate's,
    token for token) or were measured in float32. In bfloat16 (the default on CPUs with AVX-512 BF16) padding and
    batch shapes change the rounding, so a greedy answer can take another token where two are nearly tied (on
    such a machine 'a scam' against 'a classic'), and the seed kept the yes/no contract on 26 of these 32 test
    messages, not 27."""
    from pipelines.engine.models import load_causal_lm

    return load_causal_lm(dtype="float32")


@pytest.mark.e2e
def test_greedy_answers_equal_model_generate_and_fill_the_label_cache(lm):
    import torch

    from pipelines.data import load_splits
    from pipelines.engine.target import LabelScorer, prompt_frame
    from pipelines.scoring import task_contract

    task = load_task("risk")
    texts = [e.text for e in load_splits(task).dev[:8]]
    template = task.seed_template()
    scorer = LabelScorer(lm, task.verbalizers, batch_size=4)
    answers = scorer.answer(template, texts, 5)
    before, after = prompt_frame(lm.tokenizer, template, True)
    for text, answer in zip(texts, answers):
        ids = lm.tokenizer(before + text + after, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = lm.model.generate(ids, max_new_tokens=5, do_sample=False)
        assert answer.text == lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert answer.truncated == (out.shape[1] - ids.shape[1] == 5 and out[0, -1] != lm.tokenizer.eos_token_id)
    scored = scorer.stats.pairs_scored
    fresh = LabelScorer(lm, task.verbalizers, batch_size=4).score(template, texts)
    assert np.array_equal(scorer.score(template, texts), fresh)  # the answers' pass is score's, batch for batch
    # models the packed pass does not cover decode with transformers' cache (LabelScorer._greedy): the same answers
    assert LabelScorer(lm, task.verbalizers, batch_size=4, packed_llama=False).answer(template, texts, 5) == answers
    assert scorer.stats.pairs_scored == scored  # ... and score() took them from the cache
    # Early stop: once the first word is complete the parse cannot change.
    contract = task_contract(task)
    short = LabelScorer(lm, task.verbalizers).answer(template, texts, 5, contract.complete)
    for full, cut in zip(answers, short):
        assert full.text.startswith(cut.text) and cut.tokens <= full.tokens
        assert contract.parse(cut.text, truncated=cut.truncated) == contract.parse(full.text, truncated=full.truncated)


@pytest.mark.e2e
def test_long_answers_decoded_with_a_cache_equal_model_generate_and_stop_when_the_json_closes(lm):
    """A generation task's answers run for tens of tokens: after the packed pass's first token the rest are
    decoded one pass per token over the pass's kept keys and values (``PackedLlama.greedy``); the text must be
    model.generate's, token for token."""
    import torch

    from pipelines.data import load_splits
    from pipelines.engine.target import LabelScorer, prompt_frame
    from pipelines.scoring import output_contract, scorer_words

    task = load_task(str(Path(__file__).parent / "data" / "transactions_json.yaml"))
    texts = [e.text for e in load_splits(task).dev[:5]]  # two batches: 4 and 1
    template = task.seed_template()
    scorer = LabelScorer(lm, scorer_words(task), batch_size=4)
    answers = scorer.answer(template, texts, 40)
    before, after = prompt_frame(lm.tokenizer, template, True)
    for text, answer in zip(texts, answers):
        ids = lm.tokenizer(before + text + after, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = lm.model.generate(ids, max_new_tokens=40, do_sample=False)
        assert answer.text == lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert answer.tokens == min(40, out.shape[1] - ids.shape[1]) or answer.tokens == out.shape[1] - ids.shape[1] - 1
    contract = output_contract(task)
    short = LabelScorer(lm, scorer_words(task), batch_size=4).answer(template, texts, 40, contract.complete)
    for full, cut in zip(answers, short):
        assert full.text.startswith(cut.text) and cut.tokens <= full.tokens
        if contract.parse(full.text, truncated=full.truncated).ok:  # the first JSON value closed: stop there
            assert contract.parse(cut.text, truncated=cut.truncated) == contract.parse(full.text, truncated=full.truncated)


@pytest.mark.slow  # long generated answers; the default tier checks answers = model.generate on risk and JSON
def test_the_callback_seed_gets_some_numbers_right_and_its_batched_answers_are_model_generate(lm):
    """The built-in generation task leaves room both ways: the seed reads some numbers right and misses others.
    34 answers run as a batch of 32 (finished answers leave it) and one of 2, after the prefix's single pass."""
    import torch

    from pipelines.data import load_splits
    from pipelines.engine.target import LabelScorer, prompt_frame
    from pipelines.scoring import output_contract, scorer_words

    task = load_task("callback")
    examples = load_splits(task).dev[:34]
    template, limit = task.seed_template(), task.output.max_new_tokens
    answers = LabelScorer(lm, scorer_words(task)).answer(template, [e.text for e in examples], limit)
    before, after = prompt_frame(lm.tokenizer, template, True)
    for example, answer in zip(examples, answers):
        ids = lm.tokenizer(before + example.text + after, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = lm.model.generate(ids, max_new_tokens=limit, do_sample=False)
        assert answer.text == lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    contract = output_contract(task)
    right = sum(contract.parse(a.text, truncated=a.truncated).value == e.reference for a, e in zip(answers, examples))
    assert 10 <= right <= 32, right


TUNED = ("The above task can be clarified further by providing more context. For example, it only challenges "
         "`True` statements and returns `False` otherwise.")


@pytest.mark.slow  # two whole-split evaluations per decision
@pytest.mark.parametrize("decision", ["answer", "calibrated"])
def test_the_quoted_tuned_instruction_loses_and_is_refused(lm, decision):
    """The instruction an earlier run tuned for log-odds ROC-AUC: the embedded model stops answering yes/no."""
    from pipelines.data import load_splits
    from pipelines.promotion import gate
    from pipelines.scoring import build_scorer

    task = load_task("risk").with_overrides(**{
        "scoring.decision": decision, "scoring.reward_metric": None, "scoring.calibration_examples": 24, "scoring.robustness_examples": 8,
        "scoring.judge_examples": 2})
    full = load_splits(task)
    splits = Splits(full.train[:24], full.dev[:24], full.test[:32])
    scorer = build_scorer(task, splits, lm)
    seed, tuned = scorer.measure([task.seed_template().text, task.compose(TUNED)])
    assert tuned.reward.total < seed.reward.total  # the comparison the tuner makes
    evaluations = [scorer.evaluate(t, "test", latency=False) for t in (task.seed_template().text, task.compose(TUNED))]
    seed_rate = evaluations[0].measured.rate("instruction_following")
    tuned_rate = evaluations[1].measured.rate("instruction_following")
    assert seed_rate >= 0.82 > 0.5 > tuned_rate
    decision_ = gate(task, evaluations[1], evaluations[0])
    assert not decision_.promote
    assert any(r.startswith("fail: instruction_following") for r in decision_.reasons)
    if decision == "answer":  # the production figure itself: broken answers are wrong answers
        assert evaluations[1].measured.metrics["balanced_accuracy"] < evaluations[0].measured.metrics["balanced_accuracy"]
        assert any(r.startswith("fail: balanced_accuracy") for r in decision_.reasons)
    assert not math.isnan(evaluations[1].measured.metrics["roc_auc"])


def test_a_test_evaluation_takes_the_decision_and_robustness_of_the_dev_one_and_measures_the_rest():
    """The loop tests a template with its dev evaluation at hand: the production decision is fitted on train and
    robustness is read on a fixed dev sample, so both are the same on every split and are not paid for again;
    the answers, rates and metrics are the test split's own."""
    task = risk_task("calibrated")
    scorer, target = scripted_scorer(task, EXAMPLES)
    seed = task.seed_template().text
    on_dev = scorer.evaluate(seed, "dev", latency=False)
    fresh, fresh_target = scripted_scorer(task, EXAMPLES)  # no cache: what the test would cost without it
    alone = fresh.evaluate(seed, "test", latency=False)
    again, again_target = scripted_scorer(task, EXAMPLES)
    reused = again.evaluate(seed, "test", latency=False, fitted=on_dev)
    assert reused.decision == on_dev.decision == alone.decision
    assert reused.measured.pdr == on_dev.measured.pdr == alone.measured.pdr
    assert reused.measured.metrics == alone.measured.metrics and reused.measured.rates == alone.measured.rates
    assert again_target.stats.pairs_scored < fresh_target.stats.pairs_scored
    with pytest.raises(ValueError, match="another template"):
        again.evaluate(task.compose("Another instruction."), "test", latency=False, fitted=on_dev)


def test_figures_never_measured_are_left_out_of_the_record_and_a_seed_without_latency_is_not_registered(tmp_path):
    """A target that answered none of the probe requests validly (a server that lies: NaN log-probs) leaves the
    latency NaN. The store keeps measured figures only, so the record leaves it out (the gate reads it as failing
    its bar); and the seed is not registered as production with its figures unknown: the run stops, named."""
    import dataclasses

    from pipelines.engine.endpoints import EndpointError
    from pipelines.promotion import promote, record
    from pipelines.scoring import Latency
    from templates.store import TemplateStore

    task = risk_task("calibrated")
    scorer, _ = scripted_scorer(task, EXAMPLES)
    ev = scorer.evaluate(task.seed_template().text, "test", latency=False)
    ev.latency = Latency(float("nan"), float("nan"), 1.0, 2.0)
    ev = dataclasses.replace(ev, measured=dataclasses.replace(ev.measured, metrics={**ev.measured.metrics,
                                                                                     "roc_auc": float("nan")}))
    scores, latency = record(ev)
    assert "latency_p95_ms" not in latency and latency["error_rate"] == 1.0 and "roc_auc" not in scores["test"]
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with pytest.raises(EndpointError, match="answered none of the seed's test latency probes"):
        promote(task, url, [ev], "run")
    with TemplateStore(url) as store:
        assert store.list_versions(task.name) == []
