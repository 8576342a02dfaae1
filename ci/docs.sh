#!/usr/bin/env bash
# Build the documentation as README.md shows: every tutorial executed, warnings as errors. A tutorial
# that raises or any Sphinx warning fails the build. Runs in whatever Python environment is active,
# which needs the docs extra (pip install -e ".[docs]" -c ci/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
# sphinx-gallery does not rerun a tutorial whose source is unchanged since the last build, even when
# the library under it changed: start from nothing so that every tutorial runs.
rm -rf docs/_build docs/auto_tutorials
start=$(date +%s)
python -m sphinx -W -b html docs docs/_build
echo "ci: docs built in $(( $(date +%s) - start )) s (docs/_build/index.html)"
