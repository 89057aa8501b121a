"""Weights & Biases review: scalars per step, a table of each step's candidates, a final leaderboard.

The only module that imports wandb. Offline by default: the run is written under the run folder
(``wandb/offline-run-*``) and can be uploaded later with ``wandb sync``; ``--wandb-mode online`` logs live.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

CANDIDATE_COLUMNS = ["step", "template", "instruction", "valid", "tokens", "total_reward", "invalid_reasons",
                     "instruction_following_n", "entity_consistency_n"]
SAMPLE_COLUMNS = ["step", "instruction", "input", "answer", "parsed", "contract_kept", "decision", "label"]


class Tracker:
    def __init__(self, *, run_dir: Path, mode: str, project: str, entity: str | None, name: str, config: dict,
                 component_names: Sequence[str], resume_id: str | None = None):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        self.components = list(component_names)
        self.note = ""  # what a resumed run should say about its W&B run

        def init(run_id: str | None):
            return wandb.init(project=project, entity=entity, name=name, dir=str(run_dir), mode=mode, config=config,
                              id=run_id, resume="allow" if run_id else None, settings=wandb.Settings(console="off"))

        try:
            self.run = init(resume_id)
        except Exception as exc:  # wandb's own error types move between releases; the message says which this is
            if not resume_id or "in use" not in str(exc):
                raise
            # A killed run's W&B service can outlive it and still hold its run id: the resumed part is a new run.
            self.run = init(None)
            self.note = (f"W&B run {resume_id} is still held by the stopped process's W&B service; the resumed "
                         f"steps are logged as W&B run {self.run.id}")

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def folder(self) -> str:
        return str(Path(self.run.dir).parent)

    def log_step(self, step: int, scalars: Mapping[str, float], rows: Sequence[dict]) -> None:
        """One step: scalars, the table of its candidates (one row per candidate) and a few sampled answers of
        each (input, what the target said, what the contract made of it), so a reviewer sees the responses."""
        columns = CANDIDATE_COLUMNS + self.components
        table = self._wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        answers = [[row.get("step"), row.get("instruction"), *[sample.get(c) for c in SAMPLE_COLUMNS[2:]]]
                   for row in rows for sample in row.get("samples") or []]
        samples = self._wandb.Table(columns=SAMPLE_COLUMNS, data=answers)
        self.run.log({**scalars, "candidates": table, "answers": samples}, step=step)

    def log_leaderboard(self, rows: Sequence[dict]) -> None:
        if not rows:
            return
        columns = [c for c in rows[0] if c != "samples"]
        table = self._wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
        self.run.log({"leaderboard": table})
        for key, value in rows[0].items():
            if isinstance(value, (int, float)):
                self.run.summary[f"best/{key}"] = value

    def log_summary(self, values: Mapping[str, float]) -> None:
        """Run-level figures (e.g. the calls and tokens of the whole run) in the run's summary."""
        for key, value in values.items():
            self.run.summary[key] = value

    def finish(self) -> None:
        self.run.finish()


def _cell(value):
    """A table cell: lists (the gate's reasons) as one line each."""
    return "\n".join(map(str, value)) if isinstance(value, list) else value
