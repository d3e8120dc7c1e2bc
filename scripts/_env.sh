# Sourced by scripts/demo.sh and scripts/test.sh: find Python >= 3.12 and make .venv with the project installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MINIMAX_JAX_VENV:-$ROOT/.venv}"

find_python() {
  local c
  for c in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  # pyenv installs that are not the active version
  for c in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /root/.pyenv/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "error: Python >= 3.12 not found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  PY="$(find_python)"
  echo "creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.minimax_jax_installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # [amd]: the pinned jax + triton pair of the AMD compile gate (CPU; about 290 MB of wheels). A venv that must
  # keep its own jax (a GPU box) sets MINIMAX_JAX_EXTRAS=test; the gate then skips.
  "$VENV/bin/python" -m pip install -q -e "$ROOT[${MINIMAX_JAX_EXTRAS:-test,amd}]" >&2
  touch "$STAMP"
fi
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
PYTHON_BIN="$VENV/bin/python"
