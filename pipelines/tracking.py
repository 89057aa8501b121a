"""Weights & Biases review: scalars per step, a table of each step's candidates, a final leaderboard.

The only module that imports wandb. Offline by default: the run is written under the run folder
(``wandb/offline-run-*``) and can be uploaded later with ``wandb sync``; ``--wandb-mode online`` logs live.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

CANDIDATE_COLUMNS = ["step", "template", "instruction", "valid", "tokens", "total_reward", "invalid_reasons"]


class Tracker:
    def __init__(self, *, run_dir: Path, mode: str, project: str, entity: str | None, name: str, config: dict,
                 component_names: Sequence[str], resume_id: str | None = None):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        self.components = list(component_names)
        self.run = wandb.init(
            project=project, entity=entity, name=name, dir=str(run_dir), mode=mode, config=config,
            id=resume_id, resume="allow" if resume_id else None, settings=wandb.Settings(console="off"),
        )

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def folder(self) -> str:
        return str(Path(self.run.dir).parent)

    def log_step(self, step: int, scalars: Mapping[str, float], rows: Sequence[dict]) -> None:
        """One step: scalars plus the table of its candidates (one row per candidate)."""
        columns = CANDIDATE_COLUMNS + self.components
        table = self._wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({**scalars, "candidates": table}, step=step)

    def log_leaderboard(self, rows: Sequence[dict]) -> None:
        if not rows:
            return
        columns = list(rows[0])
        table = self._wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"leaderboard": table})
        for key, value in rows[0].items():
            if isinstance(value, (int, float)):
                self.run.summary[f"best/{key}"] = value

    def finish(self) -> None:
        self.run.finish()
