# Sourced by .ci/run before pytest, in the repository root:
#   source .ci/pg_env.sh || exit 1
#   trap 'bash scripts/start_postgres.sh --stop' EXIT    # optional: stop the server when .ci/run ends
# Starts a throwaway PostgreSQL server (installing it from Debian's packages when missing) and
# exports TUNE_PROMPTS_TEST_PG_URL, so that the store's tests run on PostgreSQL as well as SQLite.
# Returns 1 if the server cannot start, so that CI fails rather than quietly skipping those tests.
# Sets no shell options and no traps in the shell that sources it.
if _tp_pg_env=$(bash scripts/start_postgres.sh); then
  eval "$_tp_pg_env"
  unset _tp_pg_env
  echo "[pg_env] store tests will also run on $TUNE_PROMPTS_TEST_PG_URL"
else
  unset _tp_pg_env
  echo "[pg_env] could not start PostgreSQL for the store tests (see above)" >&2
  return 1
fi
