"""When a bench record still counts: its fingerprint is what the record's figures depend on, and nothing else.

A bench run takes hours, so ``bench.tuning --ledger FILE`` appends every finished search and test to FILE and a
later run reads back the records whose fingerprint matches. The rule:

* **the scorer's fingerprint** (``scorer_fingerprint``): the settings (the task, the budget, the split sizes,
  the models, the dtype, the versions of torch and dspy) and **the scorer's outputs on a fixed probe set**
  (``probe``): three templates on eight dev examples, their label log-probs and greedy answers, and every
  measured figure, rounded (log-probs to 0.1, figures to 0.01) so that float noise does not void a ledger. A
  test or dev record (one template measured) carries it: changing what the scorer or a reward computes voids
  every record; editing code it does not run voids none.
* **a method's fingerprint** (``method_fingerprint``): the scorer's plus the method's own code
  (``METHOD_CODE``: the searcher, the learner for PPO, the adapter for DSPy), read as syntax trees without
  comments, docstrings or layout. A search record carries it: changing PPO voids only PPO's searches.

Moving a file, editing the CLI, the store or the docs voids nothing (``METHOD_CODE`` names code by module and
function, not by path). Records of other fingerprints stay in the file, unread: ``bench.paired`` still reads
them by their fingerprint. Records written before this rule (a hash of every source file under pipelines/,
rewards/ and templates/) are kept but not re-keyed: the code that made them chose differently, so they are
history, and the bench re-runs them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from bench import REPO

# The code of each method's own search, by module[:function]. Shared by the project's methods: how they sample,
# race and choose. What measures a template (pipelines.scoring, rewards/) is the probe's, not listed here.
_SEARCH = ("pipelines.generation", "pipelines.racing", "pipelines.choice", "pipelines.rl.ppo:sample",
           "bench.tuning:search", "bench.tuning:run_method")
METHOD_CODE: dict[str, tuple[str, ...]] = {
    "seed": (),
    "best-of-N": _SEARCH,
    "OPRO": (*_SEARCH, "bench.opro"),
    "PPO": ("pipelines.generation", "pipelines.racing", "pipelines.choice", "pipelines.loop", "pipelines.rl.ppo",
            "pipelines.rl.shared_prompt", "bench.tuning:run_ppo", "bench.tuning:MAX_STEPS"),
    # the same loop and learner with ppo.update expert_iteration (bench.tuning.VARIANTS)
    "expert iteration": ("pipelines.generation", "pipelines.racing", "pipelines.choice", "pipelines.loop",
                         "pipelines.rl.ppo", "pipelines.rl.shared_prompt", "bench.tuning:run_ppo",
                         "bench.tuning:MAX_STEPS", "bench.tuning:VARIANTS"),
    # the same loop with ppo.update none, the product's default (bench.tuning.VARIANTS)
    "no update": ("pipelines.generation", "pipelines.racing", "pipelines.choice", "pipelines.loop",
                  "pipelines.rl.ppo", "pipelines.rl.shared_prompt", "bench.tuning:run_ppo",
                  "bench.tuning:MAX_STEPS", "bench.tuning:VARIANTS"),
    "DSPy COPRO": ("bench.peers.dspy", "bench.tuning:run_dspy"),
    "DSPy MIPROv2": ("bench.peers.dspy", "bench.tuning:run_dspy"),
    "DSPy GEPA": ("bench.peers.dspy", "bench.tuning:run_dspy"),
}
# a generation task's DSPy rows run through the generation peer (bench.tuning.run_dspy_generation)
GENERATION_DSPY = ("bench.peers.dspy", "bench.peers.dspy_generation", "bench.tuning:run_dspy_generation")

PROBE_INSTRUCTIONS = ("Answer with one word.", "Read the input carefully, then give your answer.")
PROBE_EXAMPLES = 8


class Ledger:
    """Finished searches and test evaluations (``--ledger``) of one fingerprint, appended to a JSONL file as each
    one finishes and read back by a later run with the same fingerprint; records of other fingerprints stay in
    the file unread. Without a path it only holds this run's records. ``scorer``: the scorer's fingerprint a
    method's records were made under (written into each record, so that a reader can join a method's searches
    with the scorer's tests)."""

    def __init__(self, path: str | None, fingerprint: str, scorer: str | None = None):
        self.path = Path(path) if path else None
        self.fingerprint = fingerprint
        self.scorer = scorer
        self.records: dict[str, dict] = {}
        self.other = 0  # records of other fingerprints, or a line cut short by a kill
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict) and record.get("fingerprint") == fingerprint and "key" in record:
                    self.records[record["key"]] = record
                else:
                    self.other += 1

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def add(self, key: str, **values) -> dict:
        record = {"fingerprint": self.fingerprint, **({"scorer": self.scorer} if self.scorer else {}), "key": key,
                  **values}
        self.records[key] = record
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record


class ScorerMismatch(Exception):
    """The ledger holds records of the task, but none under this machine's scorer (``other_scorers``)."""


def other_scorers(path: str | Path, task_name: str, scorer: str) -> dict[str, int]:
    """The scorers, other than ``scorer``, that ``path`` holds ``task_name``'s searches under, with how many each.
    Only searches made under this rule name their scorer; those made before it are history (see above)."""
    counts: dict[str, int] = {}
    path = Path(path)
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (isinstance(record, dict) and str(record.get("key", "")).startswith(f"{task_name}/")
                and record.get("scorer") not in (None, scorer)):
            counts[record["scorer"]] = counts.get(record["scorer"], 0) + 1
    return counts


def check_same_scorer(path: str | Path, task_name: str, scorer: str, dtype: str) -> None:
    """Raise ``ScorerMismatch`` when ``path`` holds ``task_name``'s searches under other scorers and none under
    ``scorer``: what a run writes there would not pair with them. The usual cause is another machine: bfloat16
    is computed only where the CPU has AVX-512 BF16 or AMX and measured faster in it (``default_dtype``), float32
    elsewhere, and CPUs round bfloat16 differently; the probe tells them apart."""
    others = other_scorers(path, task_name, scorer)
    if others:
        raise ScorerMismatch(
            f"{path} holds {sum(others.values())} {task_name} searches made under {len(others)} other scorer(s) "
            f"({', '.join(s[:8] for s in others)}) and none under this machine's ({scorer[:8]}, {dtype}), so what "
            f"this run writes would not pair with them. Fix: run where they were made (the same CPU kind), give --ledger a new file, or pass --new-scorer to start a new set in this one")


def _digest(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode() + b"\0")
    return digest.hexdigest()[:16]


# Task settings added after records were made, with the default that does what the code did before they existed.
# At that default they are left out of the settings, so adding a knob voids no record; set otherwise, they count.
LATER_SETTINGS = {("ppo", "update"): "ppo", ("ppo", "expert_top_k"): 4, ("ppo", "expert_epochs"): 4}


def task_settings(task) -> dict:
    """The task as a record's settings: its whole configuration, less ``LATER_SETTINGS`` at their defaults."""
    dumped = task.model_dump(mode="json")
    for (section, key), default in LATER_SETTINGS.items():
        if dumped.get(section, {}).get(key, default) == default:
            dumped.get(section, {}).pop(key, None)
    return dumped


def settings(task, options, budget: int, splits, plan) -> dict:
    """What a record depends on besides code: the task, the budget and split sizes, the target calls ``plan``
    (``pipelines.budget.estimate``'s) prices each phase at, which the searches' rounds and steps are counted by,
    the models, the dtype they compute in and the versions of torch and dspy."""
    import torch

    from pipelines.engine.models import default_dtype

    try:
        dspy = importlib.metadata.version("dspy")
    except importlib.metadata.PackageNotFoundError:
        dspy = None
    return {"task": task_settings(task), "budget": budget, "steps": options.steps,
            "dev_examples": options.dev_examples, "splits": [len(splits.train), len(splits.dev), len(splits.test)],
            "target": str(options.target), "judge": str(options.judge), "policy": options.policy_model,
            "scorers": options.num_scorers, "dtype": default_dtype(), "torch": torch.__version__, "dspy": dspy,
            "priced": {phase: usage["target"].calls for phase, usage in plan.phases.items()}}


def _rounded(value, places: int):
    """``value`` with every float rounded to ``places`` decimals (NaN and inf as text), lists and dicts inside."""
    if isinstance(value, float):
        return repr(value) if value != value or value in (float("inf"), float("-inf")) else round(value, places) + 0.0
    if isinstance(value, dict):
        return {str(k): _rounded(v, places) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_rounded(v, places) for v in value]
    if hasattr(value, "tolist"):  # a numpy array or scalar
        return _rounded(value.tolist(), places)
    return value


def probe(task, splits, target, judge=None) -> list:
    """The scorer's outputs on the probe set: the task's seed template and two fixed rewrites
    (``PROBE_INSTRUCTIONS``) on the first ``PROBE_EXAMPLES`` dev examples: each template's label log-probs and
    greedy answers (log-probs rounded to 0.1), and everything ``measure`` reports of it (its reward, components,
    metrics, rates and judge grades, rounded to 0.01). Deterministic for a given model, dtype and code."""
    from pipelines.data import Splits
    from pipelines.scoring import build_scorer

    small = Splits(train=tuple(splits.train[:PROBE_EXAMPLES]), dev=tuple(splits.dev[:PROBE_EXAMPLES]), test=())
    scorer = build_scorer(task, small, target, judge)
    texts = [task.seed_template().text, *(task.compose(i) for i in PROBE_INSTRUCTIONS)]
    outputs = []
    for text, scored in zip(texts, scorer.measure(texts)):
        template = scorer.validate(text).template
        out = scorer.responses(template, scorer.dev) if template is not None else None
        m = scored.measured
        outputs.append({
            "logprobs": _rounded(out.logprobs if out is not None else None, 1),
            "answers": [a.text for a in out.answers] if out is not None and out.answers is not None else None,
            "measured": _rounded({"valid": m.valid, "metrics": m.metrics, "rates": m.rates, "judge": m.judge,
                                  "pdr": m.pdr, "readability": m.readability, "tokens": m.tokens}, 2),
            "reward": _rounded({"total": scored.reward.total, "components": scored.reward.components}, 2),
        })
    return outputs


def scorer_fingerprint(run_settings: dict, probe_outputs: list) -> str:
    """The fingerprint of a test or dev record: the settings and the scorer's probe outputs."""
    return _digest("scorer", run_settings, probe_outputs)


def code_of(unit: str, root: Path | None = None) -> str:
    """One unit of ``METHOD_CODE`` (``module``, or ``module:name`` of a function, class or assignment) as a
    syntax tree dump: comments, docstrings, blank lines and layout do not change it. The source is read, not
    imported (a peer's library may be missing); ``root``: read it from this copy of the checkout instead (tests)."""
    module_name, _, function = unit.partition(":")
    path = Path(importlib.util.find_spec(module_name).origin)
    if root is not None:
        path = root / path.relative_to(REPO)
    tree: ast.AST = ast.parse(path.read_text())
    if function:
        tree = next(node for node in tree.body if getattr(node, "name", None) == function  # a def or a class
                    or any(getattr(target, "id", None) == function for target in getattr(node, "targets", ())))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]  # a docstring is documentation
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def method_fingerprint(scorer: str, method: str, generation: bool = False, root: Path | None = None) -> str:
    """The fingerprint of a search record: the scorer's and the method's own code (``METHOD_CODE``; a generation
    task's DSPy rows run through ``GENERATION_DSPY``)."""
    units = GENERATION_DSPY if generation and method.startswith("DSPy") else METHOD_CODE[method]
    return _digest("method", scorer, method, [code_of(unit, root) for unit in units])
