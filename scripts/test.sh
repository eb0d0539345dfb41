#!/usr/bin/env bash
# Set up, then run every check: lint, types, the main test suite, the vLLM suite (in its own
# venv) and the strict docs build. Fails on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NO_MKDOCS_2_WARNING=1
# tests/test_clients.py fails, rather than skips, without the client libraries in .clients/
# (GENLM_REQUIRE_CLIENTS= make test opts out, e.g. on Python 3.10, which they do not support)
export GENLM_REQUIRE_CLIENTS=${GENLM_REQUIRE_CLIENTS-1}

step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
started=$SECONDS

step "set-up"
bash scripts/setup.sh --vllm

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "mypy (genlm/backend)"
.venv/bin/mypy

step "main test suite (.venv)"
.venv/bin/pytest -q -p no:cacheprovider --durations=15 tests

step "vLLM test suite (.venv-vllm)"
.venv-vllm/bin/pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py

step "docs (mkdocs build --strict)"
.venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"

step "all checks passed in $((SECONDS - started)) s"
