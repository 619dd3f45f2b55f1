#!/usr/bin/env bash
# Runs a command on the CPUs and memory of its GPU's NUMA node:
#
#   scripts/numa_pin.sh python train.py
#   scripts/numa_pin.sh --gpu local-rank -- python train.py     # one process per GPU (MPI)
#
# A thin wrapper over `tflms run --numa auto` (same code, same tests). On a machine with one
# NUMA node the command runs plainly. TFLMS_NUMA overrides the mode (auto, none, or a node).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${TFLMS_PYTHON:-python3}"

if ! command -v "$python" >/dev/null 2>&1; then
  echo "numa_pin.sh: $python not found: set TFLMS_PYTHON to a Python with tflms" >&2
  exit 2
fi
opts=()
while [[ $# -gt 0 && "$1" == --* && "$1" != "--" ]]; do
  case "$1" in
    --gpu|--numa) opts+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    *) opts+=("$1"); shift ;;
  esac
done
[[ "${1:-}" == "--" ]] && shift
if [[ $# -eq 0 ]]; then
  echo "usage: numa_pin.sh [--gpu N|local-rank] [--numa auto|none|N] [--] COMMAND [ARGS...]" >&2
  exit 2
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m tflms run --numa "${TFLMS_NUMA:-auto}" ${opts[@]+"${opts[@]}"} -- "$@"
