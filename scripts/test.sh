#!/usr/bin/env bash
# Run the test suite (CPU; Pallas kernels in interpret mode). Sets up .venv on first use.
# pytest-xdist's worksteal distribution: a worker that runs out takes tests queued on the other, so the two
# finish together (2026-12-07: both busy 98.6% of a run's wall time; README, "Quick start").
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec "$PYTHON_BIN" -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal "$@"
