#!/usr/bin/env bash
# The docs check of `make test`: a strict MkDocs build, in which any warning (a broken link or
# cross-reference, a missing snippet) fails. Only MkDocs 2's announcement banner is silenced,
# by its own variable. Run from the directory of mkdocs.yml; MKDOCS names the mkdocs to use.
set -euo pipefail
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "${MKDOCS:-.venv/bin/mkdocs}" build --strict --site-dir "$site"
