#!/usr/bin/env bash
# Check and measure every CUDA path of genlm.backend, from this source tree (nothing to install):
#   bash benchmark/gpu.sh                                 # on a CUDA machine
#   bash benchmark/gpu.sh --device cpu --tiny --out DIR   # the CPU dry run (tests/test_gpu_command.py)
#   bash benchmark/gpu.sh --quick --out DIR --archive "$OUT/gpu.tar.gz" --deadline-s 540
#       # a device call: stops before the deadline, packs all done so far after each part
# Options: benchmark/gpu.py --help. PYTHON picks the interpreter (default: python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" "$root/benchmark/gpu.py" "$@"
