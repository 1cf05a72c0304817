#!/usr/bin/env bash
# GPU check of kvtier's device <-> CPU copy path, in one go:
#   1. the CUDA transfer tests (every backend, per-layer / layer-major / block-major
#      layouts, byte for byte, with the region page-locked by cudaHostRegister);
#   2. benchmarks/bench_transfer.py on the GPU with the region pinned, printing
#      kvtier / memcpy ratios (and vLLM's own copy path where vLLM is installed).
#
# Needs: an NVIDIA GPU, a Python with a CUDA build of torch and kvtier installed
# (pip install -e '.[test]'); a CUDA build of vLLM is optional (it adds the
# swap_blocks_batch backend and vLLM's own path to the comparison).
#
#   bash benchmarks/gpu_check.sh                 # uses .venv/bin/python if present
#   PYTHON=/opt/venv/bin/python bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --quick         # fewer sizes and repetitions (about a minute)
#
# Exit status: 0 when the tests pass and the bench ran (the bench's MET/MISSED
# lines are figures, not failures); 1 if a test failed; 2 without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1

echo "=== environment"
if ! "$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed for this Python; install a CUDA build of torch")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no usable CUDA device (torch {torch.__version__}, "
             f"built for CUDA {torch.version.cuda}); this check needs an NVIDIA GPU")
import kvtier
print(f"kvtier {kvtier.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name(0)}")
try:
    import vllm
    from kvtier.integrations.vllm.swap import vllm_swap_backend
    backend = vllm_swap_backend()
    print(f"vllm {vllm.__version__}: swap_blocks_batch {'available' if backend else 'NOT available'}")
except ImportError:
    print("vllm not installed: kvtier uses its torch backend; vLLM's own path is not compared")
EOF
then
    exit 2
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo
echo "=== transfer tests on CUDA (pinned region)"
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider tests/transfer tests/integrations/test_vllm_copier.py -rs || status=1

echo
echo "=== bench_transfer on CUDA, region pinned"
if [ "$QUICK" = 1 ]; then
    "$PYTHON" benchmarks/bench_transfer.py --device cuda --pin --sizes-kib 64 2048 --jobs 1 16 64 --min-reps 5 --max-reps 50
else
    "$PYTHON" benchmarks/bench_transfer.py --device cuda --pin
fi

echo
if [ "$status" = 0 ]; then echo "gpu_check: tests passed"; else echo "gpu_check: TESTS FAILED"; fi
exit "$status"
