#!/usr/bin/env bash
# One prepared run of every GPU check, for a machine with a CUDA GPU (e.g. the device tool's H200):
#   1. the training step on the GPU reproduces the CPU run (float64, reference kernels; then
#      float32 through the Triton kernels against the float32 CPU run),
#   2. kernel correctness and TFLOP/s vs cuBLAS / the unfused path (benchmarks/kernels.py).
# Usage: bash benchmarks/gpu_suite.sh [--quick]      (prints everything; exits non-zero on a failed check)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import cupy, triton" 2>/dev/null || python3 -m pip install -q cupy-cuda12x triton
python3 -m pip install -q --no-deps -e . >/dev/null
export PYTHONUNBUFFERED=1
tiny="--n-layer 2 --n-head 4 --n-embd 128 --block-size 128 --batch-size 8 --steps 10 --eval-interval 0 --json"
for dtype in float64 float32; do
  kernels=$([ "$dtype" = float32 ] && echo triton || echo reference)
  python3 -m minipar train $tiny --dtype $dtype --device cpu > /tmp/minipar_cpu.jsonl
  python3 -m minipar train $tiny --dtype $dtype --device gpu --kernels $kernels > /tmp/minipar_gpu.jsonl
  python3 - "$dtype" <<'PY'
import json, sys
dtype = sys.argv[1]
cpu = [json.loads(l)["loss"] for l in open("/tmp/minipar_cpu.jsonl")]
gpu = [json.loads(l)["loss"] for l in open("/tmp/minipar_gpu.jsonl")]
ms = [json.loads(l)["ms"] for l in open("/tmp/minipar_gpu.jsonl")]
tol = 1e-9 if dtype == "float64" else 2e-4
worst = max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu))
print(f"GPU vs CPU training, {dtype}: worst relative loss difference {worst:.2e} (tolerance {tol}); "
      f"GPU step {sorted(ms)[len(ms) // 2]:.1f} ms")
assert worst <= tol, "GPU training diverges from CPU training"
PY
done
python3 benchmarks/kernels.py "$@"
