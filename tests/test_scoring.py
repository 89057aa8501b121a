"""Scoring: the fast scorer equals the naive one, the cache, PDR, weighting, the judge's error budget.

The module is long because its real-model tests share one embedded model and one risk split (module fixtures,
loaded once), and the scorer's equivalences are easiest to check side by side with the pure tests they rest on."""

import copy

import numpy as np
import pytest

from pipelines.config import ConfigError, load_task
from pipelines.data import load_splits
from rewards import promptbench_metrics as pbm
from rewards.components import Measured, components_for, robustness, task_metric
from rewards.judge import Judge, JudgeError
from rewards.weighting import check_weights, weigh
from templates.template import Template

# ---- pure parts -------------------------------------------------------------------------------


def test_pdr_matches_its_definition_on_a_hand_checked_case():
    # clean balanced accuracy 0.80, perturbed 0.60: PromptBench's PDR = 1 - 0.60/0.80 = 0.25
    assert pbm.performance_drop_rate(0.80, 0.60) == pytest.approx(0.25)
    assert pbm.performance_drop_rate(0.50, 0.55) == pytest.approx(-0.10)  # a perturbation can help
    m = Measured(template="t {text}", valid=True, pdr={"checklist": 0.25, "stresstest": 0.05})
    assert robustness(m) == pytest.approx(0.85)


def test_promptbench_perturbations_are_promptbenchs_own():
    text = "Read the SMS message below.\nMessage: {text}\nIs this message a scam? Answer yes or no."
    checklist = pbm.perturb(text, "checklist")
    stress = pbm.perturb(text, "stresstest")
    assert len(checklist) == 50 and len(stress) == 3  # PromptBench's fixed lists
    # PromptBench inserts after the last word: before the final full stop
    assert checklist[0] == text[:-1] + " d6ZQ3u0GBQ."
    assert stress[1] == text[:-1] + "  and false is not true ."


def test_metrics_on_a_hand_checked_case():
    gold = ["pos", "pos", "neg", "neg", "neg", "neg"]
    preds = ["pos", "neg", "neg", "neg", "neg", "pos"]
    assert pbm.accuracy(preds, gold) == pytest.approx(4 / 6)  # promptbench's Eval
    assert pbm.balanced_accuracy(preds, gold, ["pos", "neg"]) == pytest.approx((0.5 + 0.75) / 2)
    # positives 0.9 and 0.1 against negatives 0.2, 0.3, 0.4, 0.8: 0.9 wins 4 of 4 pairs, 0.1 none
    assert pbm.roc_auc([0.9, 0.1, 0.2, 0.3, 0.4, 0.8], [g == "pos" for g in gold]) == pytest.approx(4 / 8)
    assert pbm.roc_auc([0.9, 0.5, 0.2, 0.3, 0.4, 0.8], [g == "pos" for g in gold]) == pytest.approx(7 / 8)  # 4 + 3
    assert pbm.roc_auc([1, 1], [True, False]) == 0.5
    assert pbm.fit_threshold([-2, -1, 1, 2], [False, False, True, True]) == pytest.approx(0.0)


def test_task_metric_is_rescaled_from_chance():
    assert task_metric(Measured(template="", valid=True, metrics={"roc_auc": 0.75})) == pytest.approx(0.5)
    assert task_metric(Measured(template="", valid=True, metrics={"roc_auc": 0.25})) == pytest.approx(-0.5)
    assert task_metric(Measured(template="", valid=True, metrics={"roc_auc": float("nan")})) is None


def test_weighting_rejects_a_mismatch_at_start_up():
    components = components_for({"coherence": "q?"})
    with pytest.raises(ValueError, match="rate over the target's answers"):  # an old task file's rubric
        components_for({"instruction_following": "q?"})
    with pytest.raises(ValueError, match="unknown component"):
        check_weights({"task_metric": 1.0, "instruction_folowing": 0.45}, components)
    with pytest.raises(ValueError, match="finite number"):
        check_weights({"task_metric": float("nan")}, components)
    with pytest.raises(TypeError, match="one Measured argument"):
        check_weights({"task_metric": 1.0}, {**components, "bad": lambda a, b: 0.0})
    task = load_task("risk")
    with pytest.raises(ConfigError, match="unknown component"):  # when the task is loaded, before any model
        task.with_overrides(**{"reward.weights": {"task_metric": 1.0, "typo": 1.0}})


@pytest.mark.parametrize(
    "rates, judge, expected_total",
    [
        ({"instruction_following": (90, 100), "entity_consistency": (40, 50)}, {"coherence": 0.5},
         1.0 * 0.5 + 0.45 * 0.9 + 0.35 * 0.8 + 0.1 * 0.5),
        ({"instruction_following": (0, 0), "entity_consistency": (40, 50)}, {"coherence": None},
         1.0 * 0.5 + 0.35 * 0.8 - 2.0 * 0.82),  # nothing to count: abstains, and falls short of its bar in full
        ({"instruction_following": (41, 100), "entity_consistency": (35, 50)}, {},
         1.0 * 0.5 + 0.45 * 0.41 + 0.35 * 0.7 - 2.0 * ((0.82 - 0.41) + (0.78 - 0.7))),  # both under their bars
    ],
)
def test_weighted_total(rates, judge, expected_total):
    components = components_for({"coherence": "q"}, {"instruction_following": 0.82, "entity_consistency": 0.78})
    weights = {"task_metric": 1.0, "instruction_following": 0.45, "entity_consistency": 0.35, "coherence": 0.1,
               "threshold_shortfall": 2.0}
    m = Measured(template="x {text}", valid=True, metrics={"roc_auc": 0.75}, judge=judge, rates=rates)
    reward = weigh(m, weights, components, invalid_penalty=-1.0)
    assert reward.valid and reward.total == pytest.approx(expected_total)
    invalid = weigh(Measured(template="x", valid=False), weights, components, invalid_penalty=-1.0)
    assert invalid.total == -1.0 and not invalid.valid


def test_failing_judge_is_counted_and_bounded():
    calls = {"n": 0}

    def flaky(frame, candidates):
        calls["n"] += 1
        if calls["n"] % 2:
            raise ConnectionError("judge endpoint reset")
        return np.log(np.tile([0.8, 0.2], (len(candidates), 1)))

    judge = Judge({"a": "Is it clear?", "b": "Is it short?"}, flaky, max_errors=2)
    first = judge(["t1 {text}", "t2 {text}"])
    assert [row["a"] for row in first] == [None, None]  # failed: abstains, not zero
    assert [row["b"] for row in first] == pytest.approx([0.8, 0.8])
    assert judge.errors == 1
    judge(["t3 {text}"])
    assert judge.errors == 2
    with pytest.raises(JudgeError, match="failed 3 times"):
        judge(["t4 {text}"])


def test_a_fatal_failure_is_not_the_judges_to_absorb():
    """A judge server that stopped answering (EndpointError, after its retries) ends the run, resumably, instead of
    scoring its rubrics as missing."""
    from pipelines.engine.endpoints import EndpointError

    def dead(frame, candidates):
        raise EndpointError("POST http://judge:8000/v1/chat/completions failed 4 times")

    judge = Judge({"a": "Is it clear?"}, dead, max_errors=5, fatal=(EndpointError,))
    with pytest.raises(EndpointError, match="failed 4 times"):
        judge(["t1 {text}"])
    assert judge.errors == 0


def test_judge_rejects_rubrics_with_braces():
    with pytest.raises(ValueError, match="rubric 'x'"):
        Judge({"x": "Does it use {text.__class__}?"}, lambda f, c: None)


def test_packing_layout_round_trips_every_token():
    import torch

    from pipelines.engine.packing import Packing

    seqs = [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11], [12] * 9]  # sorted; a length over 1.25x a bucket's first opens one
    packing = Packing.build(seqs, n_prefix=5)
    assert packing.ids.tolist() == [[t for s in seqs for t in s]]
    assert packing.positions.tolist() == [[5, 6, 5, 6, 7, 8, 5, 6, 7, 8, 9] + list(range(5, 14))]
    assert packing.last.tolist() == [1, 5, 10, 19]
    # Tokens regrouped per sequence and scattered back land where they were; padding points at the zero row.
    row = packing.ids[0]
    padded = torch.cat([row, torch.tensor([0])])
    regrouped = torch.cat([padded[gather].reshape(-1) for gather, _ in packing.buckets])
    assert torch.equal(regrouped[packing.scatter], row)
    assert [tuple(g.shape) for g, _ in packing.buckets] == [(1, 2), (2, 5), (1, 9)]
    mask = packing.buckets[1][1]
    assert mask.shape == (5, 5 + 5) and mask[:, :5].all() and torch.equal(mask[:, 5:], torch.ones(5, 5).tril().bool())

    # With a head (the rest of the prefix, run in this pass): it leads the row as a bucket of its own, and
    # every sequence sees it as prefix.
    headed = Packing.build(seqs, n_prefix=3, head=[90, 91])
    assert headed.ids.tolist() == [[90, 91] + [t for s in seqs for t in s]]
    assert headed.positions[0].tolist() == [3, 4] + packing.positions[0].tolist()
    assert headed.last.tolist() == [i + 2 for i in packing.last.tolist()]
    gather, head_mask = headed.buckets[0]
    assert gather.tolist() == [[0, 1]] and head_mask.tolist() == [[True] * 4 + [False], [True] * 5]
    assert [m.shape[1] - g.shape[1] for g, m in headed.buckets[1:]] == [5, 5, 5]
    padded = torch.cat([headed.ids[0], torch.tensor([0])])
    regrouped = torch.cat([padded[gather].reshape(-1) for gather, _ in headed.buckets])
    assert torch.equal(regrouped[headed.scatter], headed.ids[0])


def test_by_rows_runs_a_product_in_fixed_parts_and_keys_are_aligned():
    import torch

    from pipelines.engine.packed_llama import aligned_width, by_rows

    seen = []

    def product(x):
        seen.append(len(x))
        return x * 2 + 1

    x = torch.arange(21.0).reshape(7, 3)
    assert torch.equal(by_rows(product, x, 4), x * 2 + 1) and seen == [4, 4]  # the last part filled out to 4
    out = torch.zeros(9, 3)
    by_rows(product, x, 8, out=out[1:8])
    assert torch.equal(out[1:8], x * 2 + 1) and not out[0].any() and not out[8].any() and seen[-1] == 8
    assert by_rows(product, x[:0], 4).shape == (0, 3)
    assert [aligned_width(n) for n in (1, 32, 33, 300)] == [32, 32, 64, 320]


def _tiny_llama(**overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    return LlamaForCausalLM(config).eval()


def test_packed_llama_matches_transformers_on_a_tiny_random_llama():
    """Another head layout than SmolLM2's (6 query heads over 2 key/value heads of 8 dims), float32: the
    written-out forward pass equals transformers' own forward pass on the full sequences, in each way the
    scorer runs a prefix: all of it at the head of the examples' own pass, the first tokens known from an
    earlier pass and the rest at the head, and all of it known. The prefix's buffer rows equal the keys and
    values in transformers' cache."""
    import torch

    from pipelines.engine.packed_llama import PackedLlama
    from pipelines.engine.packing import Packing

    model = _tiny_llama()
    packed = PackedLlama(model)
    prefix = [5, 9, 2, 7, 11]
    suffixes = [[3, 4], [8, 1, 6], [12, 13, 14, 15, 16, 17, 18]]  # sorted; the long one opens a bucket
    P, KV, D = len(prefix), model.config.num_key_value_heads, packed.head_dim
    with torch.inference_mode():
        cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        expected_rows = [torch.cat([layer.keys[0].transpose(0, 1).reshape(P, KV * D),
                                    layer.values[0].transpose(0, 1).reshape(P, KV * D)], 1) for layer in cache.layers]
        # The whole prefix at the head of the examples' pass.
        whole_head, rows = packed.forward(Packing.build(suffixes, 0, head=prefix), None)
        assert torch.allclose(torch.stack(rows), torch.stack(expected_rows), atol=1e-5)
        # The first 3 tokens from a pass of their own (the rows another template left), the rest at the head.
        nothing, first = packed.forward(Packing.build([], 0, head=prefix[:3]), None)
        assert nothing is None
        extended, rest = packed.forward(Packing.build(suffixes, 3, head=prefix[3:]), first)
        assert torch.allclose(torch.stack([torch.cat(pair) for pair in zip(first, rest)]), torch.stack(expected_rows),
                              atol=1e-5)
        # All of the prefix known (the scorer's later batches).
        known, no_rows = packed.forward(Packing.build(suffixes, P), rows)
        assert no_rows == []
        for i, suffix in enumerate(suffixes):
            expected = model.model(input_ids=torch.tensor([prefix + suffix])).last_hidden_state[0, -1]
            for got in (whole_head[i], extended[i], known[i]):
                assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_packed_llama_declines_what_it_does_not_cover():
    import torch

    from pipelines.engine.packed_llama import unsupported_reason

    assert unsupported_reason(_tiny_llama()) is None
    assert "bias" in unsupported_reason(_tiny_llama(mlp_bias=True))
    adapted = _tiny_llama()
    adapted.model.layers[1].mlp.up_proj = torch.nn.Sequential(adapted.model.layers[1].mlp.up_proj)  # like an adapter
    assert "plain torch.nn.Linear" in unsupported_reason(adapted)


def test_the_budget_can_tell_from_a_config_whether_an_answer_scores_its_labels():
    """The rule the budget's stand-ins price by (``answers_give_label_rows``), read from a configuration alone:
    the packed Llama pass gives the label log-probs with the answer in every dtype; transformers' path only in
    float32; a model the packed pass does not cover, in float32 only."""
    from transformers import GPT2Config, LlamaConfig

    from pipelines.engine.target import answers_give_label_rows

    llama = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=6, num_key_value_heads=2)
    assert answers_give_label_rows(llama, "bfloat16") and answers_give_label_rows(llama, "float32")
    assert not answers_give_label_rows(llama, "bfloat16", packed_llama=False)
    assert answers_give_label_rows(llama, "float32", packed_llama=False)
    for other in (LlamaConfig(mlp_bias=True), GPT2Config()):
        assert not answers_give_label_rows(other, "bfloat16") and answers_give_label_rows(other, "float32")


# ---- with the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def risk():
    task = load_task("risk")
    return task, load_splits(task)


@pytest.fixture(scope="module")
def lm():
    """The embedded model in this machine's default dtype: bfloat16 where the CPU computes it natively (the
    tolerances below are bfloat16's), float32 elsewhere (tighter; see pipelines.engine.models.default_dtype)."""
    from pipelines.engine.models import load_causal_lm

    return load_causal_lm()


@pytest.fixture(scope="module")
def lm_fp32(lm):
    fp32 = copy.copy(lm)
    fp32.model = copy.deepcopy(lm.model).float()
    return fp32


@pytest.mark.e2e
@pytest.mark.parametrize("packed_llama", [True, False], ids=["packed-llama", "transformers-forward"])
def test_fast_scorer_equals_naive_in_float32(risk, lm_fp32, packed_llama):
    from pipelines.engine.target import LabelScorer, score_naive

    task, splits = risk
    texts = [e.text for e in splits.dev[:10]]
    templates = [task.seed_template(), Template("Message:{text}\nScam? Answer yes or no.", ("text",))]  # no space before input
    scorer = LabelScorer(lm_fp32, ["yes", "no"], batch_size=4, packed_llama=packed_llama)
    assert (scorer._packed is not None) == packed_llama  # SmolLM2 is a Llama: both paths are exercised
    for template in templates:
        naive = score_naive(lm_fp32, template, texts, ["yes", "no"])
        fast = scorer.score(template, texts)
        # Tolerance in float32: 2e-3 in label log-probs (measured: about 3e-5).
        assert np.abs(fast - naive).max() < 2e-3
        assert scorer.stats.prefix_fallbacks == 0
    # The second template's prefix starts from the first one's rows (the chat header) on the packed path.
    assert (scorer.stats.prefix_tokens_reused > 0) == packed_llama


@pytest.mark.e2e
def test_packed_llama_forward_equals_transformers_forward(risk, lm, lm_fp32):
    """The written-out Llama forward pass and transformers' own (packed, and plain over each whole sequence) on
    the same batch, in this machine's dtype: the hidden state at every sequence's last token is as close to the
    float32 pass as transformers' own are. In bfloat16 each pass rounds by its shapes (on an Intel AMX machine
    transformers' packed and plain passes differ by up to 0.75 on one sequence), so the measure is the distance
    from float32, not bit equality: per sequence no more than twice the worst of transformers' passes over the
    batch, and on average no more than 1.25 times theirs (measured on AMX: 1.5% against 1.4%, each sequence
    within 2.4%). A packing fault (a token attending across sequences, a wrong position) is off by tens of
    percent. float32 exactness is tested on a tiny random Llama above."""
    import torch

    from pipelines.engine.packing import Packing
    from pipelines.engine.target import LabelScorer, prompt_frame

    task, splits = risk
    tok = lm.tokenizer
    before, after = prompt_frame(tok, task.seed_template(), True)
    prefix = tok(before, add_special_tokens=False).input_ids[:-1]
    suffixes = sorted((tok(before + e.text + after, add_special_tokens=False).input_ids[len(prefix):]
                       for e in splits.dev[:12]), key=len)
    scorer = LabelScorer(lm, ["yes", "no"])
    hf_prefix = scorer._body(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    hf_prefix = [(layer.keys, layer.values) for layer in hf_prefix.layers]
    with torch.inference_mode():
        packing = Packing.build(suffixes, len(prefix))
        reference = scorer._hf_last_hidden(packing, hf_prefix).float()
        _, prefix_rows = scorer._packed.forward(Packing.build([], 0, head=prefix), None)  # the prefix alone
        packed = scorer._packed.forward(packing, prefix_rows)[0].float()
        plain = torch.stack([scorer._body(input_ids=torch.tensor([prefix + s])).last_hidden_state[0, -1]
                             for s in suffixes]).float()
        truth = torch.stack([lm_fp32.model.model(input_ids=torch.tensor([prefix + s])).last_hidden_state[0, -1]
                             for s in suffixes]).float()
    assert packed.shape == reference.shape == plain.shape == truth.shape == (12, lm.model.config.hidden_size)

    def off(hidden):  # per sequence: the distance from the float32 pass, relative to its size
        return (hidden - truth).norm(dim=1) / truth.norm(dim=1)

    theirs = torch.maximum(off(reference), off(plain))
    assert bool((off(packed) <= 2 * theirs.max().clamp_min(1e-4)).all()), (off(packed), theirs)
    assert off(packed).mean() <= 1.25 * theirs.mean().clamp_min(1e-4), (off(packed), theirs)
    # ... and the bound is tight enough to matter: hidden states 10% off are outside it.
    assert not bool((off(packed * 1.10) <= 2 * theirs.max().clamp_min(1e-4)).all())


@pytest.mark.e2e
def test_a_texts_scores_and_answer_do_not_depend_on_its_batch_threads_or_prefix(risk, lm):
    """What the store's held-out figure counts is what an application scoring one text at a time gets: a text's
    label log-probs and greedy answer are the same alone or among 32, on one thread or dealt to two, with the
    prefix run from scratch or started from another template's rows. Bitwise in bfloat16 (fixed-size matrix
    products and key widths aligned to 32: ``pipelines.engine.packed_llama.by_rows``); in float32 torch's
    attention still rounds the last bit by key count, which moves a log-prob by about 1e-5."""
    import torch

    from pipelines.engine.target import LabelScorer

    task, splits = risk
    texts = [e.text for e in splits.dev[:32]]
    other = task.make_template(task.compose("Decide whether this SMS is a scam."))
    seed = task.seed_template()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = LabelScorer(lm, ["yes", "no"]).score(seed, texts)
        torch.set_num_threads(2)
        scorer = LabelScorer(lm, ["yes", "no"])
        assert scorer._shard_count(len(texts)) == 2
        scorer.score(other, texts)
        shared = scorer.score(seed, texts)
        one_by_one = np.concatenate([LabelScorer(lm, ["yes", "no"]).score(seed, [t]) for t in texts[:6]])
        answers = LabelScorer(lm, ["yes", "no"]).answer(seed, texts[:12], 6)
        alone = [LabelScorer(lm, ["yes", "no"]).answer(seed, [t], 6)[0] for t in texts[:3]]
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads  # restored after the scoring threads
    assert scorer.stats.prefix_tokens_reused > 0
    tolerance = 0.0 if lm.model.dtype == torch.bfloat16 else 1e-4
    assert np.abs(shared - together).max() <= tolerance
    assert np.abs(one_by_one - together[:6]).max() <= tolerance
    assert [a.text for a in alone] == [a.text for a in answers[:3]]


@pytest.mark.e2e
def test_fast_scorer_matches_naive_in_the_default_dtype_and_cache_is_identical(risk, lm):
    from pipelines.engine.target import LabelScorer, score_naive

    task, splits = risk
    examples = list(splits.dev[:24])
    texts = [e.text for e in examples]
    template = task.seed_template()
    naive = score_naive(lm, template, texts, ["yes", "no"])
    scorer = LabelScorer(lm, ["yes", "no"], batch_size=8)
    fast = scorer.score(template, texts)
    odds_naive, odds_fast = naive[:, 0] - naive[:, 1], fast[:, 0] - fast[:, 1]
    # Tolerance in bfloat16: 0.35 in log-odds per pair (padding changes matmul shapes and rounding, and the
    # naive logits are rounded to bfloat16 steps of 0.125, which ties many pairs), and ROC-AUC within 0.08
    # on these 24 examples (one of the 144 positive/negative pairs changing order moves it by 0.007).
    assert np.abs(odds_fast - odds_naive).max() < 0.35
    positive = [e.label == "high_risk" for e in examples]
    assert abs(pbm.roc_auc(odds_fast, positive) - pbm.roc_auc(odds_naive, positive)) < 0.08
    scored = scorer.stats.pairs_scored
    again = scorer.score(template, texts)
    assert np.array_equal(again, fast)  # identical, not merely close
    assert scorer.stats.pairs_scored == scored and scorer.stats.pairs_cached == len(texts)


@pytest.mark.e2e
def test_candidate_scorer_measures_every_component(risk, lm):
    from pipelines.scoring import build_scorer

    task, splits = risk
    task = task.with_overrides(**{"scoring.robustness_examples": 8})
    small = type(splits)(splits.train[:16], splits.dev[:16], splits.test[:16])
    scorer = build_scorer(task, small, lm)
    assert scorer.judge_scorer.inner is scorer.target.inner  # yes/no answers: the target judges with the same scorer
    seed = task.seed_template().text
    scored = scorer.measure([seed, "no placeholder at all", task.compose("Look for prizes and urgent payment requests.")])
    assert [s.measured.valid for s in scored] == [True, False, True]
    for s in (scored[0], scored[2]):
        m = s.measured
        assert 0.0 <= m.metrics["roc_auc"] <= 1.0
        assert set(m.pdr) == {"checklist", "stresstest"}
        assert set(m.judge) == set(task.judge.all_rubrics) and all(0 < v < 1 for v in m.judge.values())
        kept, answered = m.rates["instruction_following"]
        assert answered == 16 and 0 <= kept <= 16  # every dev answer parsed under the contract
        kept, with_entities = m.rates["entity_consistency"]
        assert 0 < with_entities <= 16 and 0 <= kept <= with_entities
        assert len(m.samples) == 4 and all(isinstance(row["answer"], str) for row in m.samples)
        assert s.reward == scorer.reward(m) and s.reward.valid and np.isfinite(s.reward.total)
    assert scored[1].reward.total == task.reward.invalid_penalty and scored[1].target_calls == 0
    # the latency predicted from the prompts' tokens: the seed's is 1, a longer instruction's more, by what its
    # extra tokens add to a whole prompt (chat frame and message included)
    assert scored[0].measured.prompt_ratio == 1.0
    extra = scorer.count_tokens(task.compose("Look for prizes and urgent payment requests.")) - scorer.count_tokens(seed)
    assert 1.0 < scored[2].measured.prompt_ratio < 1.0 + extra / scorer.count_tokens(seed)
    # Counted by the scorer: 16 dev examples, their entity-swapped variants, and one perturbed template per
    # attack on the 8-example robustness sample (its clean pairs are among the dev pairs), unless a
    # perturbation matched the clean template. The answers' pass scores the labels too, in every dtype
    # (pipelines.engine.packed_llama.PackedLlama.greedy).
    assert 16 <= scored[0].target_calls <= 16 + 16 + 2 * 8
    assert scorer.measure([seed])[0].target_calls == 0  # a template seen again costs nothing


def test_the_shortfall_counts_a_prompt_predicted_too_slow_for_the_latency_bar():
    shortfall = components_for({}, {"instruction_following": 0.82}, latency_ceiling=1.125)["threshold_shortfall"]
    base = dict(template="x {text}", valid=True, rates={"instruction_following": (90, 100)})
    assert shortfall(Measured(**base, prompt_ratio=1.1)) == 0.0
    assert shortfall(Measured(**base, prompt_ratio=1.325)) == pytest.approx(-0.2)
    assert shortfall(Measured(**base)) == 0.0  # not predicted: nothing to count
    # with the rates: both shortfalls add up
    assert shortfall(Measured(template="x {text}", valid=True, rates={"instruction_following": (72, 100)},
                              prompt_ratio=1.225)) == pytest.approx(-0.2)


@pytest.mark.e2e
@pytest.mark.parametrize("packed_llama", [True, False], ids=["packed-llama", "transformers-forward"])
def test_an_answered_pair_is_scored_for_free_exactly_when_the_budget_prices_it_so(risk, lm, packed_llama):
    """The scorer charges a call for ``score`` after ``answer`` on the same pairs exactly when the rule the budget
    prices by says the answer's pass did not give the labels (the embedded model, this machine's dtype)."""
    from pipelines.engine.models import EMBEDDED, default_dtype, load_config
    from pipelines.engine.target import LabelScorer, answers_give_label_rows

    task, splits = risk
    texts = [e.text for e in splits.dev[:4]]
    scorer = LabelScorer(lm, ["yes", "no"], packed_llama=packed_llama)
    predicted = answers_give_label_rows(load_config(EMBEDDED), default_dtype(), packed_llama=packed_llama)
    assert scorer.labels_with_answers == predicted
    scorer.answer(task.seed_template(), texts, 2)
    before = scorer.usage.calls
    scorer.score(task.seed_template(), texts)
    assert scorer.usage.calls - before == (0 if predicted else len(texts))
