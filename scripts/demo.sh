#!/usr/bin/env bash
# The main job: run minimax-jax on the embedded default. Sets up .venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
# the demo's settings: penalties keep the small default out of greedy loops (docs/MODEL_CARD.md, "Sampling")
if [ $# -eq 0 ]; then set -- generate --repetition-penalty 1.15 --frequency-penalty 0.2; fi
exec "$PYTHON_BIN" -m spec_decode "$@"
