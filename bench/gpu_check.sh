#!/usr/bin/env bash
# GPU readiness in one command: short cwFedAvg, COSMOS and FedAvg simulations through `flwr run` (Flower's Ray engine)
# on CUDA with 0.25 GPU per client, printing rounds per second and peak GPU memory, and for the FedAvg cases the ratio
# of a round to the same clients' work as a bare loop on the GPU, gpu_ratio (bench/gpu_check.py).
# On a machine without a CUDA GPU it says so and exits 0, unless asked to run on the CPU (--device cpu).
#   bash bench/gpu_check.sh                # uses .venv/bin/python if present, else python3
#   bash bench/gpu_check.sh --device cpu --cases fedavg-cnn --clients 2 --rounds 3   # the same on the CPU, small
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
on_cpu=0
prev=""
for arg in "$@"; do
  if [ "$arg" = "--device=cpu" ] || { [ "$prev" = "--device" ] && [ "$arg" = "cpu" ]; }; then on_cpu=1; fi
  prev="$arg"
done
if [ "$on_cpu" = 0 ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }; then
  echo "gpu_check: no CUDA GPU visible here (nvidia-smi missing or torch.cuda.is_available() is False): nothing to check (--device cpu runs it on the CPU)."
  exit 0
fi
exec "$PY" bench/gpu_check.py "$@"
