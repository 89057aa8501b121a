"""Pure pieces of generation and the loop: the meta-prompt, cleaning policy replies, the leaderboard, checkpoints."""

import json

import pytest

from pipelines.config import load_task
from pipelines.generation import candidate_text, clean_instruction, instruction_of, meta_prompt, weaknesses
from pipelines.loop import LoopState, _load_checkpoint, _save_checkpoint, _update_leaderboard


@pytest.fixture(scope="module")
def task():
    return load_task("risk")


def test_meta_prompt_names_the_task_the_instruction_and_its_weakest_components(task):
    text = meta_prompt(task, "Read {carefully}.", {"task_metric": 0.1, "instruction_following": 0.9, "robustness": 0.2})
    assert "Decide whether a message is a fraud or scam attempt" in text
    assert '"Read {carefully}."' in text  # braces in the instruction are inserted literally
    assert "barely separates the two labels" in text  # task_metric loses most: weight 1.0 x (1 - 0.1)


def test_weaknesses_rank_by_weighted_loss():
    weights = {"task_metric": 1.0, "instruction_following": 0.45, "length": 0.05}
    assert weaknesses({"task_metric": 0.95, "instruction_following": 0.1, "length": -1.0}, weights, n=1) == \
        "the answers it gets do not start with one of the answer words"
    assert weaknesses({}, weights) == "none measured yet"
    # threshold_shortfall is at its best at 0, like length: a template below the gate's bars hears about it
    weights = {"task_metric": 3.0, "threshold_shortfall": 5.0}
    assert weaknesses({"task_metric": 0.7, "threshold_shortfall": -0.4}, weights, n=1) == \
        "it is too long, unclear, or its answers break the required answer format"
    assert weaknesses({"task_metric": 0.7, "threshold_shortfall": 0.0}, weights, n=1) == "it barely separates the two labels"


@pytest.mark.parametrize(
    "reply, expected",
    [
        ('"Check the message for prizes."', "Check the message for prizes."),
        ("Instruction: Look for urgent payment requests.\n\nThis helps because...", "Look for urgent payment requests."),
        ("  Flag   premium numbers.  ", "Flag premium numbers."),
    ],
)
def test_clean_instruction(reply, expected):
    assert clean_instruction(reply) == expected


def test_candidates_compose_into_the_skeleton_and_round_trip(task):
    text = candidate_text(task, '"Flag prize offers as scams."')
    assert text == "Flag prize offers as scams.\nMessage: {text}\nIs this message a scam? Answer yes or no."
    assert instruction_of(task, text) == "Flag prize offers as scams."
    assert task.make_template(text).render(text="hi").endswith("Answer yes or no.")
    # an instruction that smuggles a placeholder in makes the candidate invalid rather than evaluated
    from templates.template import validate_candidate

    assert not validate_candidate(candidate_text(task, "Use {text.__class__} here."), ("text",), 500).ok
    assert not validate_candidate(candidate_text(task, "Repeat {text} twice."), ("text",), 500).ok


def test_leaderboard_keeps_the_best_distinct_valid_candidates():
    rows = [{"template": "a", "valid": True, "total_reward": 0.5}, {"template": "b", "valid": False, "total_reward": -1.0},
            {"template": "c", "valid": True, "total_reward": 0.9}]
    board = _update_leaderboard([], rows)
    assert [r["template"] for r in board] == ["c", "a"]
    board = _update_leaderboard(board, [{"template": "a", "valid": True, "total_reward": 1.2}])
    assert [r["template"] for r in board] == ["a", "c"] and board[0]["total_reward"] == 1.2


class _Learner:
    def __init__(self, marker):
        self.marker = marker

    def save_adapter(self, path):
        path.mkdir(parents=True)
        (path / "adapter.txt").write_text(self.marker)


def test_checkpoints_swap_whole(tmp_path):
    _save_checkpoint(tmp_path, _Learner("one"), LoopState(step=1))
    _save_checkpoint(tmp_path, _Learner("two"), LoopState(step=2))
    state, policy = _load_checkpoint(tmp_path)
    assert state.step == 2 and (policy / "adapter.txt").read_text() == "two"
    assert not (tmp_path / "checkpoint.tmp").exists() and not (tmp_path / "checkpoint.old").exists()
    # a kill between the two renames leaves only checkpoint.old: it is used
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    state, _ = _load_checkpoint(tmp_path)
    assert state.step == 2
    assert _load_checkpoint(tmp_path / "nothing") is None


def test_a_run_folder_is_never_overwritten(tmp_path, capsys):
    from pipelines.cli import main

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"step": 1}))
    assert main(["--task", "risk", "--run-dir", str(tmp_path), "--no-store"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["--task", "risk", "--run-dir", str(tmp_path / "empty"), "--resume", "--no-store"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
