"""bench.ledger: a bench record's fingerprint follows what its figures depend on (the scorer's outputs on a probe
set, and its method's own code), not the source text of the whole product."""

from __future__ import annotations

import shutil

import pytest

from bench import REPO
from bench import ledger as L


@pytest.fixture
def checkout(tmp_path):
    """A copy of the code the fingerprint could read: the product and the bench."""
    for folder in ("pipelines", "rewards", "templates", "scripts/bench"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    return tmp_path


def prints(root):
    return {method: L.method_fingerprint("scorer", method, root=root) for method in L.METHOD_CODE}


def test_edits_to_code_no_method_runs_or_to_layout_keep_every_fingerprint(checkout):
    before = prints(checkout)
    assert before == prints(None)  # the copy reads as the checkout
    for unrelated in ("templates/store.py", "pipelines/cli.py", "pipelines/config.py", "rewards/readability.py"):
        path = checkout / unrelated
        path.write_text("# an edit nobody runs\n" + path.read_text() + "\n\nTHE_CLI_CHANGED = True\n")
    ppo = checkout / "pipelines/rl/ppo.py"  # a method's own code, but only comments, a docstring and layout
    text = ppo.read_text().replace('"""', '"""Reworded. ', 1).replace("\n\n\n", "\n\n\n# a comment\n\n")
    ppo.write_text(text + "\n\n")
    assert prints(checkout) == before


def test_a_change_to_a_methods_own_code_voids_that_methods_rows_only(checkout):
    before = prints(checkout)
    loop = checkout / "pipelines/loop.py"  # the loop, which only PPO and its variants run
    loop.write_text(loop.read_text() + "\n\nSTEPS_CHANGED = 2\n")
    after = prints(checkout)
    assert {m for m in before if before[m] != after[m]} == {"PPO", "expert iteration", "no update"}
    racing = checkout / "pipelines/racing.py"  # how the project's methods race their candidates
    racing.write_text(racing.read_text() + "\n\nRUNG_CHANGED = 2\n")
    changed = {m for m, fp in prints(checkout).items() if fp != before[m]}
    assert changed == {"best-of-N", "OPRO", "PPO", "expert iteration", "no update"}
    assert L.method_fingerprint("another scorer", "seed") != L.method_fingerprint("scorer", "seed")


def test_a_task_setting_added_later_counts_only_when_it_is_not_its_default():
    from pipelines.config import load_task

    task = load_task("risk").with_overrides(**{"ppo.update": "ppo"})  # as the bench loads it (bench.tuning.task_setup)
    dumped = L.task_settings(task)
    assert not {"update", "expert_top_k", "expert_epochs"} & dumped["ppo"].keys()  # as records made before them
    assert dumped == {**task.model_dump(mode="json"), "ppo": dumped["ppo"]}  # everything else is there
    variant = L.task_settings(task.with_overrides(**{"ppo.update": "expert_iteration"}))
    assert variant["ppo"]["update"] == "expert_iteration" and variant != dumped


def test_the_prices_a_search_is_counted_by_are_part_of_its_settings():
    """best-of-N's rounds and PPO's steps stop by the plan's price of a step, the choice and the test: a changed
    estimate voids the searches even where the budget it sums to stays the same."""
    from types import SimpleNamespace

    from pipelines.config import RunOptions, load_task
    from pipelines.engine.usage import Usage

    task, options = load_task("risk"), RunOptions()
    splits = SimpleNamespace(train=[0] * 3, dev=[0] * 2, test=[0] * 4)

    def plan(steps: int, select: int):
        return SimpleNamespace(phases={"steps": {"target": Usage(steps)}, "select": {"target": Usage(select)}})

    same_sum = [L.settings(task, options, 100, splits, plan(steps, 100 - steps)) for steps in (40, 60)]
    assert same_sum[0]["budget"] == same_sum[1]["budget"] and same_sum[0] != same_sum[1]
    assert same_sum[0]["priced"] == {"steps": 40, "select": 60}


@pytest.mark.slow  # the bench's: two probes of the real scorer
def test_a_changed_scorer_output_changes_the_scorers_fingerprint(monkeypatch):
    """The probe runs the real scorer (the embedded model) on the probe set; it repeats exactly, and a scorer that
    computes other log-probs gives another fingerprint."""
    import numpy as np

    from pipelines.config import load_task
    from pipelines.data import load_splits
    from pipelines.engine.models import EMBEDDED
    from pipelines.engine.target import LabelScorer

    task = load_task(str(REPO / "tests" / "data" / "risk_small.yaml"))
    splits = load_splits(task)
    outputs = L.probe(task, splits, EMBEDDED)
    assert len(outputs) == 3 and all(len(o["logprobs"]) == L.PROBE_EXAMPLES for o in outputs)
    assert all(o["measured"]["valid"] and o["answers"] for o in outputs)
    settings = {"task": task.name}
    assert L.scorer_fingerprint(settings, L.probe(task, splits, EMBEDDED)) == L.scorer_fingerprint(settings, outputs)

    score = LabelScorer.score  # the target's label log-probs, a little lower for every label
    monkeypatch.setattr(LabelScorer, "score", lambda self, template, texts: np.asarray(score(self, template, texts)) - 0.5)
    shifted = L.probe(task, splits, EMBEDDED)
    assert L.scorer_fingerprint(settings, shifted) != L.scorer_fingerprint(settings, outputs)


def test_a_ledger_made_under_another_scorer_is_refused_until_asked(tmp_path):
    """A bf16 ledger run from an AVX2 machine (float32): its searches would not pair, so the run stops first."""
    path = tmp_path / "bench.jsonl"
    L.check_same_scorer(path, "risk", "mine", "float32")  # no file yet: a new set
    there = L.Ledger(str(path), "bf16-search", scorer="bf16-scorer")
    there.add("risk/seed 0/PPO", kind="search", template="t")
    there.add("risk/seed 1/PPO", kind="search", template="t")
    L.Ledger(str(path), "old-source-hash").add("risk/seed 2/PPO", kind="search")  # history: names no scorer
    path.write_text(path.read_text() + '{"cut short by a kill\n')
    assert L.other_scorers(path, "risk", "mine") == {"bf16-scorer": 2}
    assert L.other_scorers(path, "risk", "bf16-scorer") == {} and L.other_scorers(path, "sentiment", "mine") == {}
    with pytest.raises(L.ScorerMismatch, match=r"2 risk searches .* 1 other scorer\(s\) \(bf16-sco\) and none under "
                                               r"this machine's \(mine, float32\).*--new-scorer"):
        L.check_same_scorer(path, "risk", "mine", "float32")
    L.check_same_scorer(path, "sentiment", "mine", "float32")  # another task's set is not this one's
