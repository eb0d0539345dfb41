# Sourced by scripts/setup.sh and scripts/install_check.sh: the torch requirement, and
# `install_torch PIP [pip options...]`, which installs the CPU build of torch before anything
# else, so that no later install pulls PyPI's multi-GB CUDA build.
#
# TORCH_SPEC overrides the requirement. Default on Linux: torch==2.13.0+cpu, a build that
# PyPI does not hold; PyTorch's CPU index (TORCH_CPU_INDEX) does. On macOS PyPI's own
# torch==2.13.0 is the CPU build. install_torch first asks pip's configured sources alone
# (a local wheel directory or mirror that holds the build, as on machines that reach no
# other index: a quick "no matching distribution" where they do not), then adds the CPU
# index as an extra index (torch from there, its dependencies from PyPI).

if [ "$(uname -s)" = Linux ]; then
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
else
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
fi
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

install_torch() {  # pip [pip options...]
    local pip=$1; shift
    "$pip" install -q "$@" "$TORCH_SPEC" 2>/dev/null && return 0
    printf '%s\n' "$TORCH_SPEC is not in pip's configured sources; trying PyTorch's CPU index $TORCH_CPU_INDEX" >&2
    "$pip" install -q "$@" --extra-index-url "$TORCH_CPU_INDEX" "$TORCH_SPEC"
}
