#!/usr/bin/env bash
# Run the test suite (CPU; Pallas kernels in interpret mode). Sets up .venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec "$PYTHON_BIN" -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
