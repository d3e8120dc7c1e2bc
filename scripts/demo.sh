#!/usr/bin/env bash
# The main job: run minimax-jax on the embedded default. Sets up .venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
if [ $# -eq 0 ]; then set -- generate; fi
exec "$PYTHON_BIN" -m spec_decode "$@"
