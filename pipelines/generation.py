"""Candidate generation: the meta-prompt the policy reads, and turning its reply into a candidate template.

The policy writes only the *instruction* that goes into the task's fixed skeleton. Asked to rewrite a
whole template, SmolLM2-135M kept the input placeholder in 1 of 16 samples; asked to write only an
instruction into a fixed skeleton, 16 of 16 replies were usable. The skeleton keeps the input
placeholder and the answer words, so a candidate is invalid only when the instruction itself breaks it
(a brace, a placeholder, a reply over the token budget) and then it earns the fixed penalty.
"""

from __future__ import annotations

import re
from typing import Mapping

from pipelines.config import TaskConfig

_PREFIX = re.compile(r"^\s*(?:new |better |improved )?(?:instruction|prompt)\s*:\s*", re.IGNORECASE)
DESCRIBE = {
    "task_metric": "it barely separates the two labels",
    "robustness": "small changes to it change the answers",
    "length": "it is long",
    "instruction_following": "the answers it gets do not start with one of the answer words",
    "entity_consistency": "its answers change when the numbers, amounts or links in the input change",
    "threshold_shortfall": "it is too long, unclear, or its answers break the required answer format",
    "coherence": "the answers it gets are unclear",
    "readability": "it is unclear",
}
DESCRIBE_GENERATION = {  # a generation task's answers are structured values, not label words
    **DESCRIBE,
    "task_metric": "the answers it gets often miss the reference values",
    "instruction_following": "the answers it gets break the required output format",
    "entity_consistency": "its answers give values that are not in the input",
}


def weaknesses(components: Mapping[str, float | None], weights: Mapping[str, float], n: int = 2,
               describe: Mapping[str, str] = DESCRIBE) -> str:
    """The ``n`` weighted components where the current template loses most, in words."""
    losses = []
    for name, weight in weights.items():
        value = components.get(name)
        if value is None or weight <= 0:
            continue
        ceiling = 0.0 if name in ("length", "threshold_shortfall") else 1.0
        losses.append((weight * (ceiling - value), name))
    worst = [name for _, name in sorted(losses, reverse=True)[:n]]
    return "; ".join(describe.get(name, name.replace("_", " ")) for name in worst) or "none measured yet"


def meta_prompt(task: TaskConfig, instruction: str, components: Mapping[str, float | None]) -> str:
    """What the policy reads. Filled with plain string replacement: the instruction may contain braces."""
    text = task.generation.meta_prompt
    for key, value in (
        ("{description}", task.description.strip()),
        ("{weaknesses}", weaknesses(components, task.reward.weights,
                                    describe=DESCRIBE_GENERATION if task.is_generation else DESCRIBE)),
        ("{instruction}", instruction.strip() or "(none)"),
    ):
        text = text.replace(key, value)
    return text


def clean_instruction(reply: str) -> str:
    """The policy's reply as an instruction: first paragraph, without quotes or an 'Instruction:' label."""
    text = reply.strip().split("\n\n")[0].strip()
    text = _PREFIX.sub("", text).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'`":
        text = text[1:-1].strip()
    return " ".join(text.split())


def candidate_text(task: TaskConfig, reply: str) -> str:
    """The candidate template text for one policy reply (validated later, by the scorer)."""
    return task.compose(clean_instruction(reply))


def instruction_of(task: TaskConfig, template_text: str) -> str:
    """The instruction inside a template built from the task's skeleton ('' if it was not)."""
    skeleton = task.template.skeleton
    head, _, _ = skeleton.partition("{instruction}")
    first_input = task.skeleton().placeholders[1]
    tail = skeleton.split("{instruction}", 1)[1].split("{" + first_input + "}")[0]
    if template_text.startswith(head) and tail in template_text:
        return template_text[len(head) : template_text.index(tail, len(head))].strip()
    return ""
