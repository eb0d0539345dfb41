# Sourced by scripts/setup.sh and scripts/install_check.sh: the torch requirement, and
# `install_torch PIP [pip options...]`, which installs torch before anything else, so that no
# later install pulls a build the set does not want (PyPI's torch is a multi-GB CUDA build).
#
# `use_torch_build BUILD` sets the requirement (TORCH_SPEC) and the index it comes from
# where pip's configured sources lack it (TORCH_INDEX), unless the environment set them:
#   cpu     (the default) torch==2.13.0+cpu on Linux, a build that PyPI does not hold;
#           PyTorch's CPU index (TORCH_CPU_INDEX) does. On macOS PyPI's own torch==2.13.0 is
#           the CPU build.
#   cu126   torch==2.13.0+cu126 from PyTorch's cu126 index: CUDA 12.6, which NVIDIA drivers
#           from R525 on run (TORCH_CUDA_DRIVER; CUDA 12's minor-version compatibility): the
#           CUDA torch of a machine whose driver, Python or architecture cannot take the GPU
#           set (scripts/setup.sh's "cuda" set).
# install_torch first asks pip's configured sources alone (a local wheel directory or mirror
# that holds the build, as on machines that reach no other index: a quick "no matching
# distribution" where they do not), then adds TORCH_INDEX as an extra index (torch from
# there, its dependencies from PyPI).

TORCH_CUDA_BUILD=cu126
TORCH_CUDA_DRIVER=525
# What the environment gave (empty: each build's default).
TORCH_SPEC_GIVEN=${TORCH_SPEC:-}
TORCH_INDEX_GIVEN=${TORCH_INDEX:-}

use_torch_build() {  # cpu | cuXYZ
    local index=https://download.pytorch.org/whl/$1
    if [ "$1" = cpu ]; then index=${TORCH_CPU_INDEX:-$index}; fi
    if [ "$(uname -s)" = Linux ]; then
        TORCH_SPEC=${TORCH_SPEC_GIVEN:-torch==2.13.0+$1}
    else
        TORCH_SPEC=${TORCH_SPEC_GIVEN:-torch==2.13.0}
    fi
    TORCH_INDEX=${TORCH_INDEX_GIVEN:-$index}
}
use_torch_build cpu

install_torch() {  # pip [pip options...]
    local pip=$1; shift
    "$pip" install -q "$@" "$TORCH_SPEC" 2>/dev/null && return 0
    printf '%s\n' "$TORCH_SPEC is not in pip's configured sources; trying PyTorch's index $TORCH_INDEX" >&2
    "$pip" install -q "$@" --extra-index-url "$TORCH_INDEX" "$TORCH_SPEC"
}
