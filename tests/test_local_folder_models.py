"""Local Hugging Face model folders as target, judge and policy (`--model /path/to/folder`): a tiny random Llama
with grouped-query attention, saved with the embedded model's tokenizer (and its chat template) into a
temporary folder. Nothing is downloaded."""

import json
from pathlib import Path

import numpy as np
import pytest

from pipelines.cli import main
from pipelines.engine import models
from pipelines.engine.models import ModelLoadError, check_model_spec
from templates.template import Template

SMALL_TASK = str(Path(__file__).parent / "data" / "risk_small.yaml")
TEXTS = [
    "WINNER!! You have been selected to receive a 900 prize. Call 09061701461 to claim now.",
    "Ok lar... Joking wif u oni...",
    "Are you coming to dinner tonight? Mum says 7.",
    "URGENT! Your mobile number has been awarded a bonus. Text CLAIM to 81010.",
    "hi",
]


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    """A random Llama (2 layers, 4 query heads over 2 key/value heads of 16 dims) with the embedded tokenizer.
    Weights with a standard deviation of 0.1 rather than 0.02, so that the input moves the label scores."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = models.load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_folder_model_scores_like_the_naive_scorer_and_answers(tiny_llama_folder):
    """The packed fast path (and transformers' forward with packed attention) on a GQA layout other than
    SmolLM2's equals the naive scorer in float32; greedy answers agree between the two paths."""
    import torch

    from pipelines.engine.target import LabelScorer, score_naive

    lm = models.load_causal_lm(str(tiny_llama_folder), dtype="float32")
    assert lm.name == str(tiny_llama_folder) and lm.model.dtype == torch.float32
    assert lm.model.config.num_key_value_heads == 2 and lm.tokenizer.chat_template
    template = Template("Read the SMS message below.\nMessage: {text}\nIs this message a scam? Answer yes or no.",
                        ("text",))
    naive = score_naive(lm, template, TEXTS, ["yes", "no"])
    odds = naive[:, 0] - naive[:, 1]
    assert odds.max() - odds.min() > 0.05  # the inputs move the scores (measured: 0.33), far beyond the tolerance
    answers = {}
    for packed_llama in (True, False):
        scorer = LabelScorer(lm, ["yes", "no"], batch_size=2, packed_llama=packed_llama)
        assert (scorer._packed is not None) == packed_llama  # the written-out pass covers this layout
        fast = scorer.score(template, TEXTS)
        assert np.abs(fast - naive).max() < 1e-4, np.abs(fast - naive).max()  # float32 (measured: 2e-7)
        assert scorer.stats.prefix_fallbacks == 0
        answers[packed_llama] = scorer.answer(template, TEXTS, max_new_tokens=3)
        assert len(answers[packed_llama]) == len(TEXTS)
        assert all(a.tokens <= 3 and (a.truncated == (a.tokens == 3)) for a in answers[packed_llama])
    assert [a.text for a in answers[True]] == [a.text for a in answers[False]]


@pytest.mark.e2e
def test_eval_with_a_folder_model(tiny_llama_folder, capsys):
    assert main(["eval", "--task", SMALL_TASK, "--model", str(tiny_llama_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["split"] == "dev" and report["examples"] == 24
    assert 0.0 <= report["metrics"]["roc_auc"] <= 1.0 and 0.0 <= report["metrics"]["balanced_accuracy"] <= 1.0
    assert report["rates"]["instruction_following"]["of"] == 24
    assert set(report["judge"]) == {"coherence", "clarity"}  # the folder model judged too
    assert report["latency_ms"]["p95"] > 0


@pytest.mark.slow  # one more real tuning run
def test_tuning_with_folder_target_judge_and_policy(tiny_llama_folder, tmp_path, capsys, monkeypatch, ray_session):
    """One step with the folder as target, judge and policy. The policy is loaded in this process (recorded);
    the target and judge in the Ray workers: their held-out figures for the seed equal `eval`'s with the
    folder model, which the embedded model would not give."""
    folder = str(tiny_llama_folder)
    loaded = []
    real_load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm",
                        lambda spec=models.EMBEDDED, **kw: loaded.append(spec) or real_load(spec, **kw))
    run_dir = tmp_path / "run"
    code = main(["--task", SMALL_TASK, "--steps", "2", "--update", "ppo", "--dev-examples", "8", "--model", folder,
                 "--judge-model", folder, "--policy-model", folder, "--run-dir", str(run_dir),
                 "--no-store", "--wandb-mode", "disabled"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert loaded == [folder]  # the policy
    report = json.loads((run_dir / "report.json").read_text())
    # two steps with --update ppo: the first updates the policy, the last defers its update (PPOLearner.defer)
    assert report["steps"] == 2 and len(report["history"]) == 2 and "promotion" not in report
    for key in ("reward/total/mean", "train/policy_loss", "train/kl", "timing/generate_s", "timing/score_s"):
        assert key in report["history"][0], key
    assert "train/policy_loss" not in report["history"][-1]
    seed = report["test"][0]
    assert seed["template_name"] == "seed" and seed["valid"]

    assert main(["eval", "--task", SMALL_TASK, "--model", folder, "--split", "test", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    rate = expected["rates"]["instruction_following"]
    assert seed["instruction_following_n"] == f"{rate['kept']}/{rate['of']}" and rate["of"] == 40
    assert seed["roc_auc"] == pytest.approx(expected["metrics"]["roc_auc"], abs=0.01)  # a flipped near-tie: 0.0025
    assert seed["coherence"] == pytest.approx(expected["judge"]["coherence"], abs=1e-3)


@pytest.mark.parametrize("name, message", [
    ("no-config", "the folder has no config.json; point at a Hugging Face model folder"),
    ("missing", "no such folder; give a Hugging Face model folder or hub id"),
], ids=["folder-without-config", "missing-path"])
def test_unusable_model_folder_exits_2_with_one_line_naming_the_fix(tmp_path, capsys, name, message):
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").write_bytes(b"\0" * 10)
    folder = str(tmp_path / name)
    with pytest.raises(ModelLoadError, match=message):
        check_model_spec(folder)  # what a caller checks before it starts workers that load the model
    assert main(["eval", "--task", SMALL_TASK, "--model", folder]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: cannot load model {folder!r}: {message}"


def test_a_base_model_without_a_chat_template_exits_2_naming_the_fix(tiny_llama_folder, tmp_path, capsys):
    import shutil

    base = tmp_path / "base-model"
    shutil.copytree(tiny_llama_folder, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in base.glob("chat_template.*"):  # newer transformers keep it in a file of its own
        extra.unlink()
    assert not models.load_tokenizer(str(base)).chat_template
    assert main(["eval", "--task", SMALL_TASK, "--model", str(base)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]  # after "loading ..."
    assert "has no chat template" in line and "template.chat_template: false" in line
