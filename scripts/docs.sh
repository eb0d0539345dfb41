#!/usr/bin/env bash
# The docs check of `make test`: a strict MkDocs build, in which any warning (a broken link or
# cross-reference, a missing snippet) fails. Only MkDocs 2's announcement banner is silenced,
# by its own variable. Runs from any directory (the config's paths are relative to it);
# MKDOCS names the mkdocs to use (default: the repository's .venv).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "${MKDOCS:-$root/.venv/bin/mkdocs}" build --strict -f "$root/mkdocs.yml" --site-dir "$site"
