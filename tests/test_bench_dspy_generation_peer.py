"""scripts/bench/peers/dspy_generation.py: DSPy's COPRO, MIPROv2 and GEPA on a generation task, scored per example by the task's
production figure against the reference. The target and proposer are scripted (``LocalLM._generate`` replaced)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

dspy = pytest.importorskip("dspy")

REPO = Path(__file__).resolve().parent.parent

from bench.peers import dspy_generation as peer
from bench.peers.dspy import UNPARSED, LocalLM
from pipelines.config import load_task
from pipelines.data import load_splits
from pipelines.engine.models import LoadedLM, load_tokenizer

NUMBER = re.compile(r"\+?\d(?:[ -]?\d){4,14}")


@pytest.fixture(scope="module")
def callback():
    return load_task("callback")


@pytest.fixture(scope="module")
def fake_loaded():
    return LoadedLM(model=None, tokenizer=load_tokenizer(), name="scripted")


@pytest.fixture
def scripted(monkeypatch):
    """``install(target=f, proposer=g)``: each role's reply is f(prompt text) -> completion; prompts are kept."""
    def install(**replies):
        prompts = []

        def generate(lm, text, n, temperature, max_new):
            prompts.append((lm.role, text))
            return [replies[lm.role](text)] * n, ["stop"] * n, 10 * n, 2 * n
        monkeypatch.setattr(LocalLM, "_generate", generate)
        return prompts
    return install


def message_of(text: str) -> str:
    return text.rsplit("Message: ", 1)[-1].split("\nWhat is the phone number", 1)[0]


def number_reader(text: str) -> str:
    """A target that copies the first number of the message when the instruction says "number", else the last."""
    message = message_of(text)
    found = NUMBER.findall(message) or ["none"]
    return f"The number is {found[0] if 'number' in text.split('Message: ')[0] else found[-1]}."


def test_the_metric_is_the_tasks_figure_of_one_answer(callback):
    json_task = load_task(REPO / "tests" / "data" / "transactions_json.yaml")
    assert peer.example_metric(callback, "08712300220", "08712300220") == 1.0
    assert peer.example_metric(callback, "0871 230", "08712300220") == 0.0
    assert peer.example_metric(callback, UNPARSED, "08712300220") == 0.0  # broke the contract: nothing usable
    assert peer.example_metric(json_task, {"a": 1, "b": "x"}, {"a": 1, "b": "y"}) == 0.5  # a share of fields
    assert peer.example_metric(json_task.with_overrides(**{"scoring.metric": "contract_rate"}), {}, {"a": 1}) == 1.0


@pytest.mark.parametrize("method", ["copro", "miprov2", "gepa"])
def test_optimize_runs_dspy_within_the_budget_on_train_and_dev_only(callback, fake_loaded, scripted, method):
    prompts = scripted(target=number_reader, proposer=lambda text: "Copy the phone number from the message.")
    splits = load_splits(callback)
    result = peer.optimize(callback, splits, fake_loaded, method, budget_calls=60, seed=0)
    assert 0 < result["target_calls"] <= 60 and "finished" in result["note"], result
    assert result["instruction"].strip()
    sent = [text for role, text in prompts if role == "target"]
    assert sent and not {message_of(text) for text in sent} & {e.text for e in splits.test}
    if method == "copro":  # the proposal that makes the target copy the first number is measured better, and kept
        assert "number" in result["instruction"]


def test_a_classification_task_is_refused(fake_loaded):
    task = load_task(REPO / "tests" / "data" / "risk_small.yaml")
    with pytest.raises(ValueError, match="classification"):
        peer.optimize(task, load_splits(task), fake_loaded, "copro", 10, 0)
