#!/usr/bin/env bash
# Install schedlang with its test and docs extras and run the whole suite (README.md, quick start 2).
# torch==2.13.0 is named explicitly: on the CI machines it resolves to a local CPU build. The versions
# of what the tests exercise come from ci/constraints.txt, and are printed before the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
python3 -m pip install --quiet "torch==2.13.0" -e ".[test,docs]" -c ci/constraints.txt
python3 -m pip check || true
echo "ci: $(python3 --version), in $(python3 -c 'import sys; print(sys.prefix)')"
python3 -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|triton|transformers|tokenizers|huggingface.hub|safetensors|torchao|pytest|pytest.timeout|pytest.xdist|hypothesis|numpy|sphinx|sphinx.gallery)==' \
  | sed "s/^/ci: installed /"
# the report's browser test renders the page in Debian's headless Chromium
if ! command -v chromium >/dev/null 2>&1; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
    || echo "ci: could not install chromium; the browser test will fail" >&2
fi
export SCHEDLANG_REQUIRE_BROWSER=1
export SCHEDLANG_REQUIRE_PINNED=1  # tests/test_ci_setup.py checks the installed versions against the pins
log=$(mktemp)
set +e
python3 -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --durations=30 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 5 ] || ! grep -Eq '[0-9]+ passed' "$log"; then
  echo "ci: no tests ran" >&2
  exit 1
fi
exit "$status"
