"""scripts/bench/peers/dspy.py: DSPy's COPRO, MIPROv2 and GEPA through an adapter to the project's target model.

The unit tests script the model (``LocalLM._generate`` replaced; the real tokenizer renders the chat template), so
they need no model computation; the slow test runs COPRO with the real SmolLM2 at a tiny budget."""

from __future__ import annotations

from pathlib import Path

import pytest

dspy = pytest.importorskip("dspy")

from bench.peers import dspy as dspy_peer  # noqa: E402
from pipelines.config import load_task  # noqa: E402
from pipelines.data import load_splits  # noqa: E402
from bench.peers.dspy import (  # noqa: E402
    ANSWER, UNPARSED, BudgetExceeded, CallLedger, LocalLM, ProposerAdapter, RoleAdapter, TargetAdapter,
)
from pipelines.engine.models import LoadedLM, load_tokenizer  # noqa: E402
from pipelines.engine.target import prompt_frame  # noqa: E402

TASK_FILE = Path(__file__).resolve().parent / "data" / "risk_small.yaml"


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_FILE)


@pytest.fixture(scope="module")
def fake_loaded():
    return LoadedLM(model=None, tokenizer=load_tokenizer(), name="scripted")


class Script:
    """A scripted model: ``replies[role]`` is a function (prompt text, i) -> (completion, finish reason)."""

    def __init__(self, **replies):
        self.replies, self.prompts = replies, []

    def __call__(self, lm, text, n, temperature, max_new):
        self.prompts.append((lm.role, text))
        out = [self.replies[lm.role](text, i) for i in range(n)]
        return [t for t, _ in out], [f for _, f in out], 10 * n, 2 * n


@pytest.fixture
def scripted(monkeypatch):
    def install(**replies):
        script = Script(**replies)
        monkeypatch.setattr(LocalLM, "_generate", lambda self, *a: script(self, *a))
        return script
    return install


def signature(instruction: str):
    return dspy.Signature({"text": (str, dspy.InputField()), ANSWER: (str, dspy.OutputField())}, instruction)


def target_setup(task, fake_loaded, budget=None):
    ledger = CallLedger(budget=budget)
    lm = LocalLM(fake_loaded, role="target", ledger=ledger, max_tokens=4, temperature=0.0)
    adapter = RoleAdapter(TargetAdapter(task, fake_loaded.tokenizer, ledger), ProposerAdapter())
    return ledger, lm, adapter


class TokenScript:
    """A scripted stand-in for the torch model: ``generate`` appends the given replies' tokens (each followed by
    the end of sequence, cut at max_new_tokens) and records the options it was given."""

    config = type("Config", (), {"max_position_embeddings": 8192})()

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, []

    def generate(self, ids, attention_mask=None, **options):
        import torch

        self.calls.append(options)
        rows = []
        for reply in self.replies[: options.get("num_return_sequences") or 1]:
            new = (self.tokenizer(reply, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id])
            new = new[: options["max_new_tokens"]]
            new += [options["pad_token_id"]] * (options["max_new_tokens"] - len(new))
            rows.append(ids[0].tolist() + new)
        return torch.tensor(rows)


def test_the_lm_returns_an_openai_style_response_and_counts_completions(fake_loaded):
    tok = fake_loaded.tokenizer
    model = TokenScript(tok, ["yes", "no it is a long answer that runs on", "maybe"])
    ledger = CallLedger()
    lm = LocalLM(LoadedLM(model, tok, "scripted"), role="proposer", ledger=ledger, max_tokens=5)
    response = lm.forward(messages=[{"role": "user", "content": "hi"}], n=3, temperature=0.9, rollout_id=3)
    assert [c["message"]["content"] for c in response["choices"]] == ["yes", "no it is a long", "maybe"]
    assert [c["finish_reason"] for c in response["choices"]] == ["stop", "length", "stop"]
    assert response["choices"][0]["message"]["content"] == "yes" and response["usage"]["total_tokens"] > 0
    assert model.calls[-1]["do_sample"] and model.calls[-1]["temperature"] == 0.9
    assert ledger.calls == {"proposer": 3}
    assert lm(messages=[{"role": "user", "content": "hi"}], n=3, temperature=0.9) == ["yes", "no it is a long", "maybe"]
    greedy = lm.forward(prompt="hi")  # temperature unset: greedy, one completion
    assert not model.calls[-1]["do_sample"] and len(greedy["choices"]) == 1 and ledger.calls == {"proposer": 7}


def test_a_completion_ends_at_the_chats_end_of_turn_not_only_at_the_tokenizers_end_of_sequence(fake_loaded):
    """SmolLM2 ends a chat turn with <|im_end|>, which its generation config names and the GGUF tokenizer's eos
    is not: a one-word answer followed by the next turn is that word, finished, not a cut-off run-on."""
    tok = fake_loaded.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id

    class EndOfTurn(TokenScript):
        generation_config = type("GenerationConfig", (), {"eos_token_id": im_end})()

        def generate(self, ids, attention_mask=None, **options):
            import torch

            self.calls.append(options)
            new = [*tok("No", add_special_tokens=False).input_ids, im_end,
                   *tok("\nuser\nmore", add_special_tokens=False).input_ids]
            return torch.tensor([ids[0].tolist() + new[: options["max_new_tokens"]]])

    model = EndOfTurn(tok, [])
    lm = LocalLM(LoadedLM(model, tok, "scripted"), role="target", max_tokens=8, temperature=0.0)
    response = lm.forward(messages=[{"role": "user", "content": "Is it a scam?"}])
    assert response["choices"][0]["message"]["content"] == "No"
    assert response["choices"][0]["finish_reason"] == "stop"
    assert im_end in model.calls[-1]["eos_token_id"] and tok.eos_token_id in model.calls[-1]["eos_token_id"]


def test_the_target_adapter_sends_the_projects_prompt(task, fake_loaded, scripted):
    script = scripted(target=lambda text, i: ("yes", "stop"))
    ledger, lm, adapter = target_setup(task, fake_loaded)
    message = "WIN a {prize} now!! call 0906170"
    messages = adapter.target.format(signature(task.template.seed_instruction), [], {"text": message})
    before, after = prompt_frame(fake_loaded.tokenizer, task.seed_template(), chat_template=True)
    assert lm.prompt_text(messages) == before + message + after
    with dspy.context(lm=lm, adapter=adapter):  # and that is what the model reads through dspy.Predict
        prediction = dspy.Predict(signature(task.template.seed_instruction))(text=message)
    assert script.prompts == [("target", before + message + after)]
    assert prediction.answer == "high_risk" and ledger.calls == {"target": 1}


@pytest.mark.parametrize("reply, finish, expected", [
    ("Yes.", "stop", "high_risk"),
    ("no, it is fine", "length", "low_risk"),  # the first word is settled before the limit
    ("Maybe, I think", "stop", UNPARSED),
    ("", "stop", UNPARSED),  # dspy's own adapters raise on an empty completion
    ("ye", "length", UNPARSED),  # cut off mid-word at the token limit
    ("[[ ## answer ## ]]", "stop", UNPARSED),
])
def test_contract_breaking_output_is_data_not_an_exception(task, fake_loaded, scripted, reply, finish, expected):
    scripted(target=lambda text, i: (reply, finish))
    _, lm, adapter = target_setup(task, fake_loaded)
    with dspy.context(lm=lm, adapter=adapter):
        prediction = dspy.Predict(signature("Decide."))(text="hello mum")
    assert prediction.answer == expected


def test_an_invalid_instruction_is_not_sent(task, fake_loaded, scripted):
    script = scripted(target=lambda text, i: ("yes", "stop"))
    ledger, lm, adapter = target_setup(task, fake_loaded)
    with dspy.context(lm=lm, adapter=adapter):
        prediction = dspy.Predict(signature("Use {text} twice."))(text="hello")
        long = dspy.Predict(signature("word " * 400))(text="hello")
    assert prediction.answer == UNPARSED and long.answer == UNPARSED
    assert script.prompts == [] and ledger.calls == {}


def test_the_proposer_falls_back_to_the_raw_completion(fake_loaded, scripted):
    from dspy.teleprompt.copro_optimizer import BasicGenerateInstruction

    replies = ["  Check the sender and any links before answering.\n", "", "[[ ## proposed_instruction ## ]]\nBe brief."]
    scripted(proposer=lambda text, i: (replies[i], "stop"))
    ledger = CallLedger()
    lm = LocalLM(fake_loaded, role="proposer", ledger=ledger, max_tokens=48)
    with dspy.context(lm=lm, adapter=RoleAdapter(None, ProposerAdapter())):
        out = dspy.Predict(BasicGenerateInstruction, n=3, temperature=1.4)(basic_instruction="Read the SMS.")
    assert out.completions.proposed_instruction == ["Check the sender and any links before answering.", "", "Be brief."]
    assert out.completions.proposed_prefix_for_output_field == ["", "", ""]
    assert ledger.calls == {"proposer": 3}  # one call per completion
    copy = lm.copy(rollout_id=7, temperature=1.0)  # DSPy's proposers copy the prompt model: the count is shared
    with dspy.context(lm=copy, adapter=RoleAdapter(None, ProposerAdapter())):
        dspy.Predict(BasicGenerateInstruction)(basic_instruction="Read the SMS.")
    assert ledger.calls == {"proposer": 4}


def test_the_budget_raises_before_the_call_and_dspy_cannot_swallow_it(task, fake_loaded, scripted):
    script = scripted(target=lambda text, i: ("no", "stop"))
    ledger, lm, adapter = target_setup(task, fake_loaded, budget=3)
    examples = [dspy.Example(text=f"message {i}", label="low_risk").with_inputs("text") for i in range(5)]
    evaluate = dspy.Evaluate(devset=examples, metric=lambda e, p, trace=None: p.answer == e.label, num_threads=1)
    with dspy.context(lm=lm, adapter=adapter), pytest.raises(BudgetExceeded) as raised:
        evaluate(dspy.Predict(signature("Decide.")))
    assert ledger.calls == {"target": 3} and len(script.prompts) == 3
    assert (raised.value.calls, raised.value.asked, raised.value.budget) == (3, 1, 3)
    with pytest.raises(BudgetExceeded):  # n completions count n, checked before any is generated
        CallLedger(budget=4).charge("target", 5)


def test_settings_fit_the_budget():
    for budget in (2, 5, 10, 37, 84, 300, 1300):
        for n_train in (1, 4, 24, 100):
            copro = dspy_peer.copro_settings(budget, n_train)
            assert copro["breadth"] >= 2 and copro["depth"] >= 1 and copro["examples"] >= 1
            assert copro["breadth"] * copro["depth"] * copro["examples"] == copro["max_calls"] <= budget
            mipro = dspy_peer.miprov2_settings(budget, n_train, 24)
            if mipro is not None:
                assert mipro["max_calls"] <= budget and mipro["num_candidates"] >= 2
            gepa = dspy_peer.gepa_settings(budget, n_train, 24)
            if gepa is not None:  # its own budget leaves room for the iteration past its last check
                assert gepa["max_metric_calls"] + gepa["val"] + 2 * gepa["minibatch"] == gepa["max_calls"] == budget
                assert 10 <= gepa["val"] <= 24 and gepa["train"] <= n_train
    assert dspy_peer.copro_settings(1, 10) is None and dspy_peer.miprov2_settings(4, 10, 10) is None
    assert dspy_peer.gepa_settings(30, 100, 200) is None and dspy_peer.gepa_settings(4000, 100, 200)["val"] == 35
    assert dspy_peer.miprov2_settings(84, 24, 24) == {"num_candidates": 3, "num_trials": 4, "val": 12, "train": 12,
                                                     "max_calls": 84}


def scam_reader(text, i):
    """A scripted target that answers by a word of the message, so instructions do not matter."""
    message = text.rsplit("Message: ", 1)[-1]
    return ("yes" if any(w in message.lower() for w in ("free", "win", "prize", "call", "txt")) else "no"), "stop"


@pytest.mark.parametrize("method", ["copro", "miprov2", "gepa"])
def test_optimize_runs_dspy_within_the_budget(task, fake_loaded, scripted, method):
    script = scripted(target=scam_reader,
                      proposer=lambda text, i: (f"Say yes if the message asks for money. ({i})", "stop"))
    splits = load_splits(task)
    budget = 60 if method == "gepa" else 40
    result = dspy_peer.optimize(task, splits, fake_loaded, method, budget_calls=budget, seed=0)
    assert isinstance(result["instruction"], str) and result["instruction"].strip()
    assert 0 < result["target_calls"] <= budget and "finished" in result["note"], result
    test_texts = {e.text for e in splits.test}
    assert script.prompts and not any(t in prompt for _, prompt in script.prompts for t in test_texts)


def test_gepa_reflects_on_each_examples_outcome_as_text(task, fake_loaded, scripted):
    """GEPA's reflection prompt shows the proposer the answers and the labels, and its proposal is measured."""
    script = scripted(target=scam_reader, proposer=lambda text, i: ("Say yes when the message offers a prize.", "stop"))
    result = dspy_peer.optimize(task, load_splits(task), fake_loaded, "gepa", budget_calls=60, seed=0)
    reflections = [text for role, text in script.prompts if role == "proposer"]
    assert reflections and "finished" in result["note"], result
    assert any("the correct label is" in text or "is the right label" in text for text in reflections)
    assert dspy_peer.label_outcome(task, "yes", "yes")[0] == 1.0
    assert dspy_peer.label_outcome(task, "yes", UNPARSED) == (
        0.0, "The answer broke the output contract: no label could be read from it. It must be one of "
        f"{', '.join(task.labels)}; the correct one here is 'yes'.")


def test_a_run_cut_short_keeps_the_best_measured_instruction(task, fake_loaded, scripted, monkeypatch):
    scripted(target=scam_reader, proposer=lambda text, i: ("Answer yes for prizes.", "stop"))
    oversized = {"breadth": 3, "depth": 2, "examples": 6, "max_calls": 36}  # more than the budget, on purpose
    monkeypatch.setattr(dspy_peer, "copro_settings", lambda budget, n: oversized)
    result = dspy_peer.optimize(task, load_splits(task), fake_loaded, "copro", budget_calls=20, seed=0)
    assert result["target_calls"] <= 20 and "cut short" in result["note"]
    assert result["instruction"] in (task.template.seed_instruction, "Answer yes for prizes.")


@pytest.mark.slow
@pytest.mark.parametrize("method, budget", [("copro", 8), ("gepa", 40)])
def test_dspy_with_the_real_small_model_at_a_tiny_budget(task, method, budget):
    from pipelines.engine.models import load_causal_lm

    result = dspy_peer.optimize(task, load_splits(task), load_causal_lm(), method, budget_calls=budget, seed=0)
    print(result)
    assert isinstance(result["instruction"], str) and result["instruction"].strip()
    assert 0 < result["target_calls"] <= budget and "finished" in result["note"], result


def test_with_a_real_model_the_target_answers_through_the_projects_scorer_as_generate_does(task):
    """The adapter's fast path (the project's ``LabelScorer.answer``) sends the same prompt as the LM path
    (``generate`` on the chat template): in float32 their answers are equal, and each call is counted once."""
    from pipelines.engine.models import load_causal_lm
    from pipelines.scoring import label_scorer, scorer_words

    loaded = load_causal_lm(dtype="float32")
    examples = load_splits(task).dev[:8]
    answers = {}
    for path in ("scorer", "generate"):
        ledger = CallLedger()
        scorer = label_scorer(loaded, scorer_words(task), chat_template=True) if path == "scorer" else None
        lm = LocalLM(loaded, role="target", ledger=ledger, max_tokens=dspy_peer.answer_tokens(task), temperature=0.0)
        adapter = RoleAdapter(TargetAdapter(task, loaded.tokenizer, ledger, scorer), ProposerAdapter())
        program = dspy.Predict(signature("Answer yes if the message is a scam, else no."))
        with dspy.context(lm=lm, adapter=adapter):
            answers[path] = [program(text=e.text).answer for e in examples]
        assert ledger.calls == {"target": len(examples)}
    assert answers["scorer"] == answers["generate"] and set(answers["scorer"]) - {UNPARSED}
