"""The bench: how tune-prompts' methods, scorer, store and served-model client measure, beside the product.

A package of its own (installed with the project, imported as ``bench``): it reads the product through its public
API (``pipelines``, ``rewards``, ``templates``) and the product never imports it. Each module is a script:

    .venv/bin/python -m bench.tuning --help        # methods at an equal budget, held-out test, over seeds
    .venv/bin/python -m bench.default_run --help   # the default `tune-prompts --task risk` over seeds

``peers/`` holds the other tools a user would pick instead (DSPy's optimizers); ``results/`` the ledgers,
tables and plots the docs quote. ``ledger.py`` says when a recorded row still counts (its fingerprint).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: tasks and test data the benches read
RESULTS = Path(__file__).resolve().parent / "results"
