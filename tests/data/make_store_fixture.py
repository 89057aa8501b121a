"""Make tests/data/store_fixture_main.sqlite: a small template store written by the store code of its day.

Run once, with the project installed (``pip install -e .``, as scripts/setup.sh does), and commit the file it
writes:

    python tests/data/make_store_fixture.py

The fixture was made by main at 567331d, before templates/store.py was split into the registry and its
database layer (issue #39). tests/test_store_fixture.py opens a copy of it with today's code: the on-disk
format (tables, columns, triggers, meta rows, JSON encodings) must stay readable and writable. Do not
remake it with newer code; that would test nothing. Make a new fixture beside it for a new format.

What it holds, all through the public store API (the test checks these values):

* task ``risk``: v1 a seed (never gated, forced to production), v2 gated and promoted (carries a calibrated
  decision rule), v3 promoted and rolled back (so production is v2 again) and labelled ``staging``,
  v4 refused by the gate, v5 gated and canaried at 5% then advanced to 20% of callers.
* task ``spam``: one seed version, forced to production.
"""

from pathlib import Path

from templates.decision import DecisionRule
from templates.gate import Decision
from templates.store import TemplateStore
from templates.template import Constraint, Template

OUT = Path(__file__).with_name("store_fixture_main.sqlite")
RULE = DecisionRule("calibrated", ("risky", "safe"), ("yes", "no"), positive="risky", threshold=0.5)
PASSED = Decision(True, ("pass: test roc_auc 0.81 >= 0.70", "pass: latency_p95_ms 41.0 <= 250"))
REFUSED = Decision(False, ("fail: test roc_auc 0.64 < 0.70", "pass: latency_p95_ms 40.0 <= 250"))
LIMIT = (Constraint("text", "max_chars", 2000),)


def risk(text: str) -> Template:
    return Template("Transaction: {text}\n" + text + "\nAnswer yes or no:", ("text",), LIMIT, RULE)


def main() -> None:
    if OUT.exists():
        sys.exit(f"{OUT} exists: it is a fixture of an older store format; keep it (see this file's docstring)")
    with TemplateStore(f"sqlite:///{OUT}") as store:
        v1 = store.add_version("risk", Template.from_text("Is this transaction risky? {text}\nAnswer:", LIMIT),
                               scores={"dev": {"roc_auc": 0.62}, "test": {"roc_auc": 0.6}},
                               latency={"template_tokens": 9, "latency_p95_ms": 38.5})
        store.promote("risk", v1.id, force=True)
        v2 = store.add_version("risk", risk("Is it risky?"), parent_id=v1.id, run_id="run-fixture-1",
                               scores={"dev": {"roc_auc": 0.8}, "test": {"roc_auc": 0.81}},
                               latency={"template_tokens": 14, "latency_p95_ms": 41.0}, decision=PASSED)
        store.promote("risk", v2.id)
        v3 = store.add_version("risk", risk("Would a fraud analyst flag it?"), parent_id=v2.id,
                               run_id="run-fixture-2", scores={"dev": {"roc_auc": 0.83}, "test": {"roc_auc": 0.82}},
                               latency={"template_tokens": 19, "latency_p95_ms": 44.0}, decision=PASSED)
        store.promote("risk", v3.id)
        store.rollback("risk")
        store.set_label("risk", "staging", v3.id)
        v4 = store.add_version("risk", risk("Risky?"), parent_id=v2.id, run_id="run-fixture-3",
                               scores={"dev": {"roc_auc": 0.66}, "test": {"roc_auc": 0.64}},
                               latency={"template_tokens": 11, "latency_p95_ms": 40.0}, decision=REFUSED)
        v5 = store.add_version("risk", risk("Should we hold this payment?"), parent_id=v2.id, run_id="run-fixture-4",
                               scores={"dev": {"roc_auc": 0.84}, "test": {"roc_auc": 0.85}},
                               latency={"template_tokens": 16, "latency_p95_ms": 42.0}, decision=PASSED)
        store.set_canary("risk", v5.id)
        store.advance_canary("risk")
        spam = store.add_version("spam", Template.from_text("Is this spam? {text}"))
        store.promote("spam", spam.id, force=True)
        assert (v4.id, v5.id, spam.id) == (4, 5, 6)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
