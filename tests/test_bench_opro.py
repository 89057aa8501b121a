"""bench.opro: OPRO's meta-prompt, one of the bench's methods (pure text, no model)."""

from bench.opro import history_meta_prompt
from pipelines.config import load_task


def test_the_opro_meta_prompt_shows_the_best_instructions_worst_first_with_their_scores():
    task = load_task("risk")
    scored = [(f"rule {i}", i / 10) for i in range(8)] + [("rule 1", 0.95)]  # a repeat keeps its best score
    prompt = history_meta_prompt(task, scored, top=3)
    lines = prompt.splitlines()
    assert lines[0] == task.generation.meta_prompt.splitlines()[0] and task.description.strip() in prompt
    shown = [line for line in lines if line.startswith("Instruction:")]
    assert shown == ['Instruction: "rule 6" Score: 0.60', 'Instruction: "rule 7" Score: 0.70',
                     'Instruction: "rule 1" Score: 0.95']
    assert lines[-1].startswith("Write a new instruction")
