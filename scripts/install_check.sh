#!/usr/bin/env bash
# The installation a user makes, tested: build the sdist and the wheel, install the wheel into
# a fresh venv, then the client libraries (genlm-control, genlm-bytes, llamppl) with pip's
# ordinary dependency resolution, and run a short client workload there. scripts/test.sh runs it
# after the main suite.
#
#   scripts/install_check.sh            constrained by locks/main.txt (`make test`)
#   scripts/install_check.sh --latest   the newest releases; torch stays at TORCH_SPEC
#
# It checks that
#   - `python -m build` makes the sdist, then the wheel from the sdist, and `twine check
#     --strict` passes on both; the wheel holds genlm/backend (with py.typed) and no
#     genlm/__init__.py: genlm stays a namespace package;
#   - in a fresh venv (torch first, from TORCH_SPEC as in scripts/setup.sh: a plain torch
#     requirement would pull a multi-GB CUDA build), the wheel installs, then the clients
#     of scripts/client-requirements.txt with resolution: their requirements on
#     genlm-backend (>=0.3.0, >=0.2.0, >=0.1.0a1) are met by ours, so pip keeps the wheel's
#     build rather than PyPI's genlm-backend; `pip check` is clean and (locked) nothing
#     outside locks/main.txt got installed, so the tested set is what a locked install gets;
#   - from outside the repository, genlm.backend, genlm.control, genlm.bytes and llamppl
#     import from that venv's site-packages, and genlm-backend is the wheel's, at pyproject's
#     version; genlm-control's PromptedLLM gives our HF backend's log-probabilities, its SMC
#     samples a few tokens, genlm-bytes' beam reads a few bytes, LLaMPPL's CachedCausalLM
#     gives our rows and its SMC runs a few tokens (scripts/client_workload.py);
#   - the reverse order: with the clients installed first, which pulls PyPI's genlm-backend
#     (0.3.1, a different library under our name), installing the wheel replaces it.
# The default model comes from the cache that the main venv converts it into.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/install_torch.sh
PYTHON=${PYTHON:-python3}
# What the clients pull from PyPI when nothing else provides genlm-backend (locked runs).
REGISTRY_BACKEND=genlm-backend==0.3.1
# No byte-compiling at install: the throwaway venv compiles only what the checks import.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_COMPILE=1 HF_HUB_OFFLINE=1

log() { printf '\033[1m[install-check]\033[0m %s (%d s)\n' "$*" $((SECONDS - started)) >&2; }
started=$SECONDS

# MAIN: the venv whose build and twine make the distributions (setup.sh's main venv).
LOCKED=1
if [ "${1:-}" = "--latest" ]; then
    MAIN=${MAIN:-.venv-latest} LOCKED=0
elif ! head -1 locks/main.txt | grep -qF "on $(uname -m), $("$PYTHON" -V | cut -d. -f1,2)."; then
    log "warning: locks/ were made for $(head -1 locks/main.txt | sed 's/.* on //'): unlocked"
    LOCKED=0
fi
MAIN=${MAIN:-.venv}
LOCK=$PWD/locks/main.txt
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
WORKLOAD=$PWD/scripts/client_workload.py

WORK=$(mktemp -d "${TMPDIR:-/tmp}/genlm-install-check.XXXXXX")
trap 'log "removing $WORK"; rm -rf "$WORK"' EXIT
VENV=$WORK/venv
PIP=$VENV/bin/pip
echo "$TORCH_SPEC" >"$WORK/torch.txt"
if [ $LOCKED = 1 ]; then
    PINS=(-c "$LOCK")
    echo "$REGISTRY_BACKEND" >"$WORK/registry.txt"
else
    PINS=(-c "$WORK/torch.txt")
    : >"$WORK/registry.txt"
fi
quietly() {  # command...: its output only when it fails
    "$@" >"$WORK/out.log" 2>&1 || { cat "$WORK/out.log" >&2; return 1; }
}

log "building the sdist, then the wheel from it (python -m build)"
# The isolated build environment gets the lock's setuptools.
if [ $LOCKED = 1 ]; then export PIP_CONSTRAINT=$LOCK; fi
quietly "$MAIN/bin/python" -m build --outdir "$WORK/dist" .
unset PIP_CONSTRAINT
SDIST=$WORK/dist/genlm_backend-$VERSION.tar.gz
WHEEL=$WORK/dist/genlm_backend-$VERSION-py3-none-any.whl
ls "$SDIST" "$WHEEL" >/dev/null
"$MAIN/bin/twine" check --strict "$SDIST" "$WHEEL"
"$MAIN/bin/python" - "$WHEEL" <<'EOF'
import sys
import zipfile

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for needed in ("genlm/backend/__init__.py", "genlm/backend/py.typed", "genlm/backend/llm/hf/__init__.py"):
    assert needed in names, f"the wheel lacks {needed}"
assert "genlm/__init__.py" not in names, "the wheel ships genlm/__init__.py"
assert not [n for n in names if n.startswith(("tests/", "benchmark/", "docs/"))], "stray files"
EOF

# The workload's model: converted (once per machine) by the main venv into the shared cache.
"$MAIN/bin/python" -c 'from genlm.backend.models import default_model_path; default_model_path()'

log "a fresh venv: $TORCH_SPEC (CPU) first, then the wheel"
"$PYTHON" -m venv "$VENV"
quietly "$PIP" install --upgrade pip setuptools "${PINS[@]}"
quietly install_torch "$PIP"
quietly "$PIP" install "$WHEEL" "${PINS[@]}"

CLIENTS=1
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    log "warning: the client libraries need Python >= 3.11; checking the wheel alone"
    CLIENTS=0
else
    log "the clients, with dependency resolution (scripts/client-requirements.txt)"
    quietly "$PIP" install -r scripts/client-requirements.txt "${PINS[@]}"
fi
quietly "$PIP" check
if [ $LOCKED = 1 ]; then
    extra=$("$PIP" freeze --all | grep -v -e '^torch==' -e '^genlm-backend @ ' \
        | grep -vxFf <(grep -v '^#' "$LOCK") || true)
    if [ -n "$extra" ]; then
        log "error: the venv holds packages that locks/main.txt does not pin:"
        printf '  %s\n' $extra >&2
        exit 1
    fi
fi

log "checks and the client workload, run from outside the repository"
if [ $CLIENTS = 0 ]; then
    (cd "$WORK" && "$VENV/bin/python" "$WORKLOAD" "$WHEEL" "$VERSION" --no-clients)
    log "passed (without the clients)"
    exit 0
fi
(cd "$WORK" && "$VENV/bin/python" "$WORKLOAD" "$WHEEL" "$VERSION" --workload)

log "the reverse order: the clients first pull PyPI's genlm-backend, then the wheel replaces it"
quietly "$PIP" uninstall -y genlm-backend
quietly "$PIP" install -r scripts/client-requirements.txt "${PINS[@]}" -c "$WORK/registry.txt"
(cd "$WORK" && "$VENV/bin/python" -c '
import importlib.metadata as m
d = m.distribution("genlm-backend")
assert d.read_text("direct_url.json") is None, "genlm-backend was not a registry download"
print(f"the clients pulled genlm-backend {d.version} from the registry")')
quietly "$PIP" install "$WHEEL" "${PINS[@]}"
quietly "$PIP" check
(cd "$WORK" && "$VENV/bin/python" "$WORKLOAD" "$WHEEL" "$VERSION")
log "passed"
