#!/usr/bin/env bash
# Compile every kernel in cuda/ with NVRTC for sm_80 and sm_90a, on a machine without a GPU.
# NVRTC and the CUDA headers come from the pinned PyPI wheels (scripts/nvrtc-wheels).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
site="$("$root/scripts/nvrtc-wheels")"
python="${PYTHON:-python3}"
exec "$python" "$root/scripts/nvrtc_check.py" --site "$site" --arch sm_80 --arch sm_90a --dir "$root/cuda" "$@"
