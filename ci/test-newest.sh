#!/usr/bin/env bash
# What a new user installs today: the newest releases of everything schedlang uses with HF models, resolved
# freely (no constraints file; ci/constraints.txt pins the main suite, so a release that breaks schedlang
# shows here first), in a fresh virtualenv of its own. Runs README.md's quick start 1 (`schedlang demo` on the
# CPU, and tracing an HF LLaMA attention) and the tests of what the newest torch, transformers, tokenizers and
# torchao touch most: the tracer and the primitives on torch.fx (tests/graph, tests/primitives, tests/lowering),
# HF models (tracing, the automatic tensor-parallel plan of every family, optimize_model with float8) and the
# trainer (a recent family under every parallelism, text through a tokenizer, resuming), in two pytest-xdist
# workers. .ci/run calls it after the main suite; a failure fails CI. Prints the versions it got and how long the
# install and the tests took. The rest (distributed training and checkpoints beyond the trainer's) stays with the
# main suite, on the pinned versions, for the time budget.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SCHEDLANG_CI_NEWEST_VENV:-.ci-venv-newest}
started=$(date +%s)
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# torch is the newest release too, as a new user gets it: PyPI's build, CUDA included (several GB, and it runs on
# the CPU here). This machine's pip configuration caps torch at 2.14.1 (/etc/xdg/pip) and offers a local CPU build
# of 2.13.0; PIP_CONFIG_FILE=/dev/null reads no configuration file, so neither stands in for the newest release.
# Where PyPI cannot be reached for it, the lane says so and runs on the local 2.13.0 (the newest transformers and
# torchao are still tested) rather than fail for the network.
packages=(-e ".[hf]" transformers tokenizers huggingface_hub torchao safetensors pytest pytest-timeout pytest-xdist
  hypothesis)
if ! PIP_CONFIG_FILE=/dev/null "$py" -m pip install --quiet --upgrade torch "${packages[@]}"; then
  echo "ci (newest): WARNING: could not install the newest torch from PyPI; this lane runs on torch 2.13.0" >&2
  "$py" -m pip install --quiet --upgrade "torch==2.13.0" "${packages[@]}"
fi
installed=$(date +%s)
echo "ci (newest): $("$py" --version), in $venv; installed in $((installed - started)) s"
"$py" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|triton|transformers|tokenizers|huggingface.hub|safetensors|torchao|pytest|hypothesis|numpy)==' \
  | sed "s/^/ci (newest): installed /"
export SCHEDLANG_REQUIRE_NEWEST=1  # tests/test_ci_setup.py checks that nothing older than the pins was installed
failed=0

# README.md, quick start 1: the demo on the CPU through the installed `schedlang` command (tensor parallelism
# over two gloo ranks, the SwiGLU found in transformers' code and fused, Verify, compile), sized down: the
# default size spends minutes verifying and compiling what the small one exercises too. Its output must not
# carry torchao's import noise (schedlang/quiet_imports.py).
echo "ci (newest): schedlang demo --device cpu (small)"
demo_log=$(mktemp)
set +e
"$venv/bin/schedlang" demo --device cpu --layers 2 --hidden 64 --heads 4 --batch 2 --seq 32 --repeats 1 2>&1 \
  | tee "$demo_log"
demo=${PIPESTATUS[0]}
set -e
if [ "$demo" -ne 0 ] || ! grep -q "Verify passed" "$demo_log"; then
  echo "ci (newest): schedlang demo failed (exit $demo)" >&2
  failed=1
elif grep -Eq "Failed to load|is an Enum subclass" "$demo_log"; then
  echo "ci (newest): schedlang demo printed torchao's import noise" >&2
  failed=1
fi
demo_done=$(date +%s)

log=$(mktemp)
set +e
"$py" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --durations=15 \
  tests/test_ci_setup.py tests/test_compat.py tests/test_quiet_imports.py \
  tests/graph tests/primitives tests/lowering \
  tests/models/test_trace_hf.py \
  tests/models/test_tp_llama.py tests/models/test_tp_families.py tests/models/test_tp_gpt2.py \
  tests/models/test_tp_bert.py tests/models/test_tp_patterns.py tests/models/test_capture_masks.py \
  tests/models/test_packed_sequences.py tests/models/test_optimize.py \
  "tests/train/test_families.py::test_a_family_trains_under_every_parallelism_like_one_process[qwen3]" \
  "tests/train/test_text.py::test_text_is_tokenized_once_packed_with_eos_and_trains" \
  "tests/train/test_resume.py::test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before[corrupt-bytes]" \
  2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
echo "ci (newest): demo ran in $((demo_done - installed)) s, tests in $(($(date +%s) - demo_done)) s; install, demo" \
  "and tests $(($(date +%s) - started)) s"
if [ "$status" -eq 5 ] || ! grep -Eq '[0-9]+ passed' "$log"; then
  echo "ci (newest): no tests ran" >&2
  exit 1
fi
echo "ci (newest): tests exit $status, demo $([ "$failed" -eq 0 ] && echo passed || echo failed)"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
