#!/usr/bin/env bash
# First pass at the GPU check (issue 11 builds `make gpu-check` from it): on a machine with an NVIDIA GPU, run every
# solution with NCCL for a few steps, the mixed-precision benchmark and the GradScaler read benchmark on the GPU,
# and the tests that need CUDA. Writes logs and a summary into the folder given as $1 (default results/gpu).
# Uses the machine's own python3 (its PyTorch), with this checkout on PYTHONPATH; installs nothing.
set -uo pipefail
OUT_DIR=${1:-results/gpu}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PY=python3
NPROC=$($PY -c "import torch; print(max(torch.cuda.device_count(), 0))")
if [ "$NPROC" -lt 1 ]; then echo "gpu_check: no CUDA device visible to $PY; nothing to check" >&2; exit 1; fi
SUMMARY="$OUT_DIR/summary.md"
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  $PY - <<'EOF'
import platform, subprocess, torch
print(f"- GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; PyTorch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Python {platform.python_version()}")
driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
print(f"- driver: {driver.stdout.strip() or 'unknown'}")
EOF
  echo
  echo "| script | result | first error line |"
  echo "|---|---|---|"
} > "$SUMMARY"

run() {  # name, then the command; logs to $OUT_DIR/solutions.log, a row in the summary
  local name=$1; shift
  echo "=== $name: $*" >> "$OUT_DIR/solutions.log"
  if timeout 240 "$@" >> "$OUT_DIR/solutions.log" 2>&1; then
    echo "| $name | pass | |" >> "$SUMMARY"
  else
    local line
    line=$(grep -E "Error|error:|Exception" "$OUT_DIR/solutions.log" | tail -1 | cut -c1-160 | tr '|' '/')
    echo "| $name | FAIL | $line |" >> "$SUMMARY"
  fi
}

TR=(torchrun --standalone --nproc_per_node="$NPROC")
QUICK=(--dataset digits --epochs 1 --max-steps 5)
run 01_ddp_basic "${TR[@]}" solutions/01_ddp_basic.py "${QUICK[@]}"
run 02_gradient_accumulation "${TR[@]}" solutions/02_gradient_accumulation.py "${QUICK[@]}"
run 03_fsdp "${TR[@]}" solutions/03_fsdp.py "${QUICK[@]}" --model mlp
for precision in fp32 bf16 fp16; do
  run "04_mixed_precision $precision" "${TR[@]}" solutions/04_mixed_precision.py "${QUICK[@]}" --precision "$precision"
done
run 05_multi_node "${TR[@]}" --max-restarts 1 solutions/05_multi_node.py "${QUICK[@]}" \
    --checkpoint-dir "$OUT_DIR/ckpt" --checkpoint-every 2 --fail-at-step 3
rm -rf "$OUT_DIR/ckpt"
run 07_ring_allreduce "${TR[@]}" solutions/07_ring_allreduce.py --sizes 4K 1M 16M
run 08_dp_vs_ddp "${TR[@]}" solutions/08_dp_vs_ddp.py --model simplecnn --steps 10

echo >> "$SUMMARY"
$PY benchmarks/mixed_precision.py --model simplecnn --batch-size 256 > "$OUT_DIR/mixed_precision.txt" 2>&1 \
  || echo "mixed_precision benchmark FAILED (see mixed_precision.txt)" >> "$SUMMARY"
$PY benchmarks/scaler_sync.py --device cuda > "$OUT_DIR/scaler_sync.txt" 2>&1 \
  || echo "scaler_sync benchmark FAILED (see scaler_sync.txt)" >> "$SUMMARY"
$PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_mixed_precision.py tests/test_multiprocess.py \
  -k "cuda or gpu or autocast" > "$OUT_DIR/cuda_tests.txt" 2>&1
echo "- CUDA tests: $(tail -1 "$OUT_DIR/cuda_tests.txt")" >> "$SUMMARY"
cat "$SUMMARY"
