#!/usr/bin/env bash
# GPU lane: the whole suite on a CUDA machine (1, 2 or more GPUs), then the gpu / multigpu tests alone.
# Installs nothing: the GPU machines have torch, triton and transformers and no network, so schedlang runs
# from this checkout (PYTHONPATH). Prints a tally per lane; exits non-zero if either lane failed.
# Extra arguments go to both pytest runs (e.g. `ci/gpu.sh tests/distributed` or `ci/gpu.sh -x`).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast (NCCL's NVLS, symmetric memory) stays off: not every machine supports it
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# a collective that never completes fails the test after this long instead of PyTorch's 30 minutes
export SCHEDLANG_PG_TIMEOUT="${SCHEDLANG_PG_TIMEOUT:-120}"
python=${PYTHON:-python}

$python - <<'PY'
import torch
try:
    import triton
    triton_version = triton.__version__
except Exception:  # noqa: BLE001
    triton_version = "absent"
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"ci/gpu.sh: torch {torch.__version__}, triton {triton_version}, {len(gpus)} GPU(s): {', '.join(gpus) or 'none'}")
if not gpus:
    print("ci/gpu.sh: warning: no CUDA device; the gpu/multigpu tests will be skipped")
PY

logs=$(mktemp -d)
declare -A status tally

run_lane() {
  local name=$1; shift
  echo "ci/gpu.sh: lane '$name': pytest $*"
  $python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$logs/$name.log"
  status[$name]=${PIPESTATUS[0]}
  # pytest's last summary line: "12 passed, 3 skipped in 40.1s" (or "no tests ran")
  tally[$name]=$(grep -E "(passed|failed|error|no tests ran|skipped|deselected)" "$logs/$name.log" | tail -n 1 \
                 | sed -E 's/^=+ //; s/ =+$//')
}

run_lane all "$@"
run_lane gpu -m "gpu or multigpu" "$@"

echo
echo "ci/gpu.sh: tally"
failed=0
for lane in all gpu; do
  echo "  $lane: ${tally[$lane]:-no summary} (exit ${status[$lane]})"
  # 5: nothing collected, acceptable for the gpu lane only on a machine without GPUs
  if [ "${status[$lane]}" -ne 0 ] && ! { [ "$lane" = gpu ] && [ "${status[$lane]}" -eq 5 ]; }; then
    failed=1
  fi
done
echo "ci/gpu.sh: logs in $logs"
exit $failed
