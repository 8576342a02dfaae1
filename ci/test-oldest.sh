#!/usr/bin/env bash
# The oldest releases schedlang declares (pyproject.toml: torch, transformers), in a fresh virtualenv of their
# own, pinned by ci/constraints-oldest.txt: the tests of what touches them, HF models (tensor parallelism,
# tracing), distributed (FSDP2, DDP, pipelines), checkpoints (resharding, async saves) and the trainer
# (resuming, a damaged checkpoint, a rank killed under torchrun). .ci/run calls it after the main suite; a
# failure fails CI.
#
# Older torch releases come from PyPI as CUDA builds (about 3 GB of wheels with their CUDA libraries; they
# run on the CPU). Those wheels are downloaded once per machine into $SCHEDLANG_CI_WHEELS and installed from
# there (pip keeps no cache of its own here), so a machine that ran this lane before downloads nothing again.
# Prints how long the install and the tests took.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SCHEDLANG_CI_OLDEST_VENV:-.ci-venv-oldest}
wheels=${SCHEDLANG_CI_WHEELS:-$HOME/.cache/schedlang-ci-wheels}
mkdir -p "$wheels"
started=$(date +%s)
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
torch_pin=$(grep -E '^torch==' ci/constraints-oldest.txt)
# torch first and alone, with everything it needs, from the wheels kept on this machine ("File was already
# downloaded" for those already there)
"$py" -m pip download --quiet -d "$wheels" "$torch_pin"
"$py" -m pip install --quiet --no-index --find-links "$wheels" "$torch_pin"
"$py" -m pip install --quiet -e ".[hf]" pytest pytest-timeout hypothesis -c ci/constraints-oldest.txt
installed=$(date +%s)
echo "ci (oldest): $("$py" --version), in $venv; installed in $((installed - started)) s"
"$py" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|triton|transformers|tokenizers|huggingface.hub|safetensors|pytest|numpy)==' \
  | sed "s/^/ci (oldest): installed /"
export SCHEDLANG_REQUIRE_OLDEST=1  # tests/test_compat.py checks the installed versions against the declared minimums
log=$(mktemp)
set +e
"$py" -m pytest -q -p no:cacheprovider --durations=15 \
  tests/test_compat.py \
  "tests/models/test_tp_gpt2.py::test_logits_loss_and_gradients_match_single_device" \
  "tests/models/test_trace_hf.py::test_whole_model_traces_hierarchically_and_finds_qkv" \
  "tests/models/test_trace_hf.py::test_masks_are_specialized_and_guarded_unless_made_inputs" \
  "tests/models/test_trace_hf.py::test_a_submodule_of_a_meta_model_traces_with_examples_on_one_device" \
  "tests/distributed/test_data_parallel.py::test_fsdp2_on_two_ranks_trains_like_one_process" \
  "tests/distributed/test_data_parallel.py::test_ddp_on_two_ranks_trains_like_one_process" \
  "tests/distributed/test_pipeline.py::test_two_stages_train_like_one_process" \
  "tests/test_checkpoint.py::test_checkpoint_of_one_layout_resumes_under_another" \
  tests/checkpoint/test_async_save.py \
  "tests/train/test_resume.py::test_async_saves_resume_exactly" \
  "tests/train/test_resume.py::test_a_rank_killed_mid_run_restarts_and_continues_exactly" \
  "tests/train/test_resume.py::test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before[corrupt-bytes]" \
  2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
echo "ci (oldest): tests ran in $(($(date +%s) - installed)) s; install and tests $(($(date +%s) - started)) s"
if [ "$status" -eq 5 ] || ! grep -Eq '[0-9]+ passed' "$log"; then
  echo "ci (oldest): no tests ran" >&2
  exit 1
fi
exit "$status"
