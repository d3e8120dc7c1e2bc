#!/usr/bin/env bash
# Train the embedded default (docs/MODEL_CARD.md), one step per call; each GPU step fits one <= 10-minute call.
#
#   scripts/train_default.sh prepare            # CPU, here: tokenise the stdlib corpus -> out/corpus/ (~19 MB)
#   scripts/train_default.sh target             # GPU call 1, carry out/corpus                 -> $OUT/target/
#   scripts/train_default.sh collect target DIR # here: the files of call 1 -> out/target_run/
#   scripts/train_default.sh drafter            # GPU call 2, carry out/corpus out/target_run/export -> $OUT/drafter/
#   scripts/train_default.sh collect drafter DIR
#   scripts/train_default.sh install            # CPU, here: minimax_jax/assets/default/ + 16 MB check + card numbers
#
# Both training scripts stop cleanly before MAX_MINUTES (default 7.5) with a checkpoint and still export; rerunning
# a step on the same machine resumes from out/*_run/ckpt. OUT defaults to out/gpu when unset.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out/gpu}"
MAX_MINUTES="${MAX_MINUTES:-7.5}"

copy() {  # copy DEST FILE... (missing files are reported, not fatal: a partial run still returns what it has)
  local dest="$1"; shift
  mkdir -p "$dest"
  for f in "$@"; do
    if [ -f "$f" ]; then cp "$f" "$dest/"; else echo "missing: $f" >&2; fi
  done
}

case "${1:-}" in
  prepare)
    "$PY" scripts/prepare_corpus.py --out out/corpus
    ;;
  target)
    status=0
    "$PY" scripts/train_target.py --corpus out/corpus --run-dir out/target_run --max-minutes "$MAX_MINUTES" \
      || status=$?
    copy "$OUT/target" out/target_run/export/config.json out/target_run/export/model.safetensors \
      out/target_run/results.json out/target_run/loss.png out/target_run/metrics.jsonl
    exit $status
    ;;
  drafter)
    status=0
    "$PY" scripts/train_drafter.py --corpus out/corpus --target out/target_run/export --run-dir out/drafter_run \
      --max-minutes "$MAX_MINUTES" || status=$?
    copy "$OUT/drafter" out/drafter_run/export/config.json out/drafter_run/export/model.safetensors \
      out/drafter_run/results.json out/drafter_run/loss.png out/drafter_run/completions.md \
      out/drafter_run/metrics.jsonl
    exit $status
    ;;
  collect)
    part="${2:?collect target|drafter DIR}"; src="${3:?collect $part DIR (the files a GPU call returned)}"
    copy "out/${part}_run/export" "$src/config.json" "$src/model.safetensors"
    for f in results.json loss.png metrics.jsonl completions.md; do
      [ -f "$src/$f" ] && cp "$src/$f" "out/${part}_run/"
    done
    echo "collected $src -> out/${part}_run/"
    ;;
  install)
    "$PY" scripts/export_default.py --target out/target_run/export --drafter out/drafter_run/export \
      --target-results out/target_run/results.json --drafter-results out/drafter_run/results.json
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
