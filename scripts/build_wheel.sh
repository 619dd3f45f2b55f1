#!/usr/bin/env bash
# Builds a TensorFlow wheel carrying the LMS patch: a thin wrapper over `tflms build-wheel`,
# so the shell entry point and the CLI share one implementation (and its tests).
#
#   scripts/build_wheel.sh --tf-version 2.21.0 [--cuda | --cpu] [--docker] [--tf-source DIR]
#                          [--output DIR] [--jobs N] [--dry-run]
#
# TFLMS_PYTHON picks the interpreter (default: python3). The wheel is built for that
# interpreter's Python version, so use the one you will train with.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${TFLMS_PYTHON:-python3}"

if ! command -v "$python" >/dev/null 2>&1; then
  echo "build_wheel.sh: $python not found: install Python 3.10-3.13 or set TFLMS_PYTHON" >&2
  exit 2
fi
# Run from this checkout even when the package is not installed.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m tflms build-wheel "$@"
