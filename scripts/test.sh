#!/usr/bin/env bash
# The test command of the README: set up (idempotent), start a throwaway PostgreSQL for the store's
# tests, type-check the product (mypy), run the default test suite (fast tests plus the end-to-end ones;
# `slow` ones are left out).
#   bash scripts/test.sh                 # the default suite (CI)
#   bash scripts/test.sh -m slow         # the slow tier alone (extra arguments go to pytest)
#   bash scripts/test.sh -m ''           # everything
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck source=/dev/null
source .ci/pg_env.sh || exit 1
trap 'bash scripts/start_postgres.sh --stop >/dev/null 2>&1 || true' EXIT
# Types first (pyproject.toml [tool.mypy]): a type error fails the run before the tests start.
.venv/bin/python -m mypy
# Idle torch threads must not spin while another process (a Ray actor, a test's child) computes.
export OMP_WAIT_POLICY=PASSIVE
.venv/bin/python -m pytest -q "$@"
