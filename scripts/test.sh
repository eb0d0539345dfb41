#!/usr/bin/env bash
# Set up, then run every check: lint, types, the main test suite, the installation check (the
# built wheel and the client libraries in a fresh venv), the vLLM suite (in its own venv) and
# the strict docs build. Fails on the first failing step.
#
# On a machine that gets the GPU set (scripts/setup.sh --print-plan), .venv holds vLLM's CUDA
# build: there is no .venv-vllm, the main suite leaves the vLLM tests out and the vLLM suite
# runs in .venv, on the GPU. Elsewhere (the CPU set, CI; the cuda set) as described.
#
#   scripts/test.sh            on the locked set (locks/*.txt): what `make test` and CI run
#   scripts/test.sh --latest   on the newest releases inside pyproject's ranges, in their own
#                              venvs (`make test-latest`): upstream breakage shows here first;
#                              also the gate against vLLM's newest release (scripts/vllm_gate.py)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--latest" ]; then
    MAIN=.venv-latest VLLM_VENV=.venv-vllm-latest LATEST=(--latest)
else
    MAIN=.venv VLLM_VENV=.venv-vllm LATEST=()
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

started=$SECONDS
step() { printf '\n\033[1m== %s\033[0m (at %d s)\n' "$*" $((SECONDS - started)) >&2; }

PLAN=$(bash scripts/setup.sh --print-plan "${LATEST[@]}")
step "set-up ($MAIN): the ${PLAN%%:*} set"
bash scripts/setup.sh "${LATEST[@]}"
MAIN_SUITE=(tests)
VLLM_SETUP_LOG=$(mktemp)
VLLM_SETUP=
INSTALL_CHECK_LOG=$(mktemp)
INSTALL_CHECK=
trap 'kill -- ${VLLM_SETUP:+-$VLLM_SETUP} ${INSTALL_CHECK:+-$INSTALL_CHECK} 2>/dev/null || true
      rm -f "$VLLM_SETUP_LOG" "$INSTALL_CHECK_LOG"' EXIT
if [ "${PLAN%%:*}" = gpu ]; then
    VLLM_VENV=$MAIN
    MAIN_SUITE=(-m "not vllm" tests)
else
    # The vLLM venv is made meanwhile (pip mostly waits on the disk): its log comes before its
    # suite.
    setsid bash scripts/setup.sh --vllm-only "${LATEST[@]}" >"$VLLM_SETUP_LOG" 2>&1 &
    VLLM_SETUP=$!  # a session of its own: a failed step stops it, pip included
fi

step "ruff"
$MAIN/bin/ruff check .
$MAIN/bin/ruff format --check .

step "mypy (genlm/backend)"
$MAIN/bin/mypy

if [ ${#LATEST[@]} -gt 0 ]; then
    step "the gate against vLLM's newest release (its CUDA wheel's source)"
    $MAIN/bin/python scripts/vllm_gate.py
fi

# The installation check runs beside the main suite: it mostly waits on pip and the disk.
step "installation check (the wheel and the client libraries in a fresh venv), in the background"
MAIN=$MAIN setsid bash scripts/install_check.sh "${LATEST[@]}" >"$INSTALL_CHECK_LOG" 2>&1 &
INSTALL_CHECK=$!

step "main test suite ($MAIN)"
$MAIN/bin/pytest -q -p no:cacheprovider --durations=15 "${MAIN_SUITE[@]}"

step "installation check: its result"
install_check_status=0
wait $INSTALL_CHECK || install_check_status=$?
cat "$INSTALL_CHECK_LOG" >&2
[ $install_check_status = 0 ] || exit $install_check_status

if [ -n "$VLLM_SETUP" ]; then
    step "set-up ($VLLM_VENV), made in the background"
    vllm_setup_status=0
    wait $VLLM_SETUP || vllm_setup_status=$?
    cat "$VLLM_SETUP_LOG" >&2
    [ $vllm_setup_status = 0 ] || exit $vllm_setup_status
fi

step "vLLM test suite ($VLLM_VENV)"
$VLLM_VENV/bin/pytest -q -p no:cacheprovider --durations=15 -m vllm tests/test_vllm.py \
    tests/test_vllm_processor.py tests/test_vllm_gate.py tests/test_vllm_docs.py

step "docs (mkdocs build --strict)"
MKDOCS=$MAIN/bin/mkdocs bash scripts/docs.sh

step "all checks passed in $((SECONDS - started)) s"
