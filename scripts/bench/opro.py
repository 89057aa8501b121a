"""OPRO (Yang et al., 2023), a method of the bench (``bench.tuning``): rounds of the untrained policy whose
meta-prompt shows the best instructions so far with their scores. It lives here, not in ``pipelines/``, because
``tune-prompts`` never runs it: it is a peer the bench compares PPO with."""

from __future__ import annotations

from pipelines.config import TaskConfig


def history_meta_prompt(task: TaskConfig, scored: list[tuple[str, float]], top: int = 5) -> str:
    """OPRO's meta-prompt (Yang et al., 2023): the task, then the ``top`` best instructions so far with their
    rewards, worst first (so the best sits nearest to the request), then the request for a better one.
    ``scored``: (instruction, reward) pairs in any order."""
    role = task.generation.meta_prompt.split("\n", 1)[0]
    best: dict[str, float] = {}
    for instruction, reward in scored:
        best[instruction] = max(reward, best.get(instruction, reward))
    shown = sorted(best.items(), key=lambda item: item[1])[-top:]
    lines = [role, f"Task: {task.description.strip()}",
             "Earlier instructions and their scores (higher is better):"]
    lines += [f"Instruction: \"{text.strip() or '(none)'}\" Score: {reward:.2f}" for text, reward in shown]
    lines.append("Write a new instruction, different from these, that scores higher than all of them, in one to "
                 "three sentences. Reply with the instruction only.")
    return "\n".join(lines)
