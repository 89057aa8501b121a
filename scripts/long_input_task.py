"""Write a task like a user's own over long inputs: risk's messages joined into cases of about N characters.

Each case joins messages of one label (spam with spam, ham with ham), drawn at random, with a space until it
has --chars characters, then is cut there; its label is theirs; 400 cases a label, enough for risk's split.
The task file is risk's with this CSV as its data (and a 4,000-character input limit), so the two runs differ
only in input length: what the cost model's "input length" row is measured with.

    .venv/bin/python scripts/long_input_task.py /tmp/long --chars 1000
    .venv/bin/tune-prompts --task /tmp/long/long_risk.yaml          # the default run on these inputs
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from pathlib import Path

import yaml



def long_cases(examples, chars: int, per_label: int, seed: int = 13) -> list[tuple[str, str]]:
    """``per_label`` (label, text) cases of each label, ``chars`` characters long: messages of that label drawn
    at random (seeded) and joined until the case is long enough, then cut. Cases share messages (risk has 747
    spam messages, about 60 cases' worth), so this data measures cost, not what tuning gains."""
    rng = random.Random(seed)
    by_label: dict[str, list[str]] = {}
    for e in examples:
        by_label.setdefault(e.label, []).append(" ".join(e.text.split()))
    cases = []
    for label, texts in by_label.items():
        for _ in range(per_label):
            parts: list[str] = []
            while sum(len(p) + 1 for p in parts) <= chars:
                parts.append(rng.choice(texts))
            cases.append((label, " ".join(parts)[:chars]))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for long_risk.csv and long_risk.yaml")
    parser.add_argument("--chars", type=int, default=1000)
    args = parser.parse_args()

    from pipelines.config import load_task
    from pipelines.data import load_examples

    task = load_task("risk")
    cases = long_cases(load_examples(task), args.chars, per_label=400)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "long_risk.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "text"])
        writer.writerows(cases)
    spec = task.model_dump(mode="json", exclude={"base_dir"}, exclude_defaults=True)
    spec["name"] = "long_risk"
    spec["data"] = {"source": "long_risk.csv", "text_column": "text", "label_column": "label"}
    for name, label in spec["labels"].items():
        label["values"] = [name]  # the CSV holds the label names
    spec["template"]["constraints"] = {"text": {"max_chars": 4 * args.chars}}
    (out / "long_risk.yaml").write_text(yaml.safe_dump(spec, sort_keys=False, width=110))
    print(f"{len(cases)} cases of {args.chars} characters -> {out / 'long_risk.yaml'}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
