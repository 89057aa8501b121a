"""pipelines/tracking.py around wandb (a scripted wandb here; the real offline files are checked in test_tuning.py)."""

import sys
import types

import pytest

from pipelines.tracking import Tracker


def scripted_wandb(monkeypatch, held: set[str]):
    """A wandb whose init refuses a run id that ``held`` holds, as W&B does while a killed run's service lives."""
    calls = []

    def init(*, id=None, resume=None, **kwargs):
        calls.append((id, resume))
        if id in held:
            raise RuntimeError(f"ServerResponseError: run ID {id} is in use")
        return types.SimpleNamespace(id=id or "fresh123", dir="/tmp/run/files")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    return calls


def tracker(tmp_path, resume_id):
    return Tracker(run_dir=tmp_path, mode="offline", project="p", entity=None, name="n", config={},
                   component_names=["task_metric"], resume_id=resume_id)


def test_a_resumed_run_whose_wandb_id_is_still_held_logs_as_a_new_wandb_run_and_says_so(tmp_path, monkeypatch):
    calls = scripted_wandb(monkeypatch, held={"old1"})
    t = tracker(tmp_path, "old1")
    assert calls == [("old1", "allow"), (None, None)] and t.run_id == "fresh123"
    assert "old1 is still held" in t.note and "fresh123" in t.note
    calls.clear()
    assert tracker(tmp_path, "free2").run_id == "free2" and calls == [("free2", "allow")]


def test_any_other_wandb_failure_is_not_hidden(tmp_path, monkeypatch):
    scripted_wandb(monkeypatch, held={None})  # a new run is refused too: not the held-id case
    with pytest.raises(RuntimeError, match="is in use"):
        tracker(tmp_path, None)
