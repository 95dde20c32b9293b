#!/usr/bin/env bash
# GPU readiness in one command: short cwFedAvg and COSMOS simulations through `flwr run` (Flower's Ray engine)
# on CUDA with 0.25 GPU per client, printing rounds per second and peak GPU memory (bench/gpu_check.py).
# On a machine without a CUDA GPU it says so and exits 0.
#   bash bench/gpu_check.sh                # uses .venv/bin/python if present, else python3
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible here (nvidia-smi missing or torch.cuda.is_available() is False): nothing to check."
  exit 0
fi
exec "$PY" bench/gpu_check.py "$@"
