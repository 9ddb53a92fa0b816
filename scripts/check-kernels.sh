#!/usr/bin/env bash
# Compile every kernel in cuda/ with NVRTC for sm_80 and sm_90, on a machine without a GPU.
# NVRTC and the CUDA headers come from the PyPI wheels below, installed into a cache folder
# (TINYLOOP_NVRTC_SITE, default target/nvrtc-site) on first use.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
site="${TINYLOOP_NVRTC_SITE:-$root/target/nvrtc-site}"
python="${PYTHON:-python3}"
if [ ! -f "$site/.installed-13.0.88-13.0.96" ]; then
    rm -rf "$site"
    "$python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --target "$site" nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
    touch "$site/.installed-13.0.88-13.0.96"
fi
exec "$python" "$root/scripts/nvrtc_check.py" --site "$site" --arch sm_80 --arch sm_90 --dir "$root/cuda" "$@"
