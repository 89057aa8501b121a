#!/usr/bin/env bash
# Set-up of the llama.cpp test tier (tests/test_llama_cpp_server.py, `-m llama_cpp`): llama.cpp's own
# OpenAI-compatible server, built from source into its own virtual environment so that its pins
# (pydantic, fastapi, numpy, ...) never touch the project's .venv.
#   bash scripts/setup_llama_cpp.sh                 # builds into .venv-llama (about 5+ minutes on 2 cores)
#   bash scripts/setup_llama_cpp.sh --venv DIR      # builds into DIR (then run the tier with LLAMA_VENV=DIR)
# Idempotent: does nothing when DIR already imports llama_cpp.server at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLAMA_VENV:-.venv-llama}
PYTHON=${PYTHON:-python3}
VERSION=0.3.36
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) [ $# -ge 2 ] || { echo "setup_llama_cpp.sh: --venv needs a folder" >&2; exit 2; }; VENV=$2; shift 2 ;;
    *) echo "setup_llama_cpp.sh: unknown option '$1'; use no option, or --venv DIR" >&2; exit 2 ;;
  esac
done

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "
import importlib.metadata, llama_cpp.server.app
assert importlib.metadata.version('llama_cpp_python') == '$VERSION'" >/dev/null 2>&1; then
  echo "[setup-llama] ok: llama-cpp-python $VERSION already in $VENV"
  exit 0
fi
for tool in cmake gcc g++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "[setup-llama] $tool not found: llama-cpp-python builds from source and needs cmake and a C/C++ compiler" >&2; exit 1; }
done
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || { echo "[setup-llama] could not create $VENV with $PYTHON" >&2; exit 1; }
# The package is a source distribution only: pip compiles llama.cpp (about 5 minutes on 2 cores).
# GGML_NATIVE builds for this CPU (AVX-512 where it has it); the build is not portable to other CPUs.
echo "[setup-llama] building llama-cpp-python[server]==$VERSION into $VENV (several minutes)"
if ! CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "llama-cpp-python[server]==$VERSION"; then
  echo "[setup-llama] pip could not build llama-cpp-python[server]==$VERSION (see pip's output above)" >&2
  exit 1
fi
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; print(f'[setup-llama] ok: llama-cpp-python {llama_cpp.__version__} in $VENV')"
