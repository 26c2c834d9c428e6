#!/usr/bin/env bash
# One script for a lent single GPU (see the device tool's README): CUDA-marked tests,
# then yafsdp vs FSDP2 on a ~1B Llama in bf16. Uses the machine's own python3 and CUDA
# torch (nothing is installed: the device reaches no registry); the engine and the
# reference model need only torch, so the repo root on PYTHONPATH is enough.
# Writes under ${OUT:-gpu_check_out}; budget ~8 minutes.   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    | tee "$out/summary.txt"
echo "== CUDA tests" | tee -a "$out/summary.txt"
if python3 -c "import pytest" 2>/dev/null; then
    timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_core_cuda.py 2>&1 \
        | tee -a "$out/summary.txt"
else
    echo "pytest missing on this machine: carry its wheel (device README)" | tee -a "$out/summary.txt"
fi
echo "== yafsdp vs FSDP2, llama-1b bf16" | tee -a "$out/summary.txt"
timeout 300 python3 benchmarks/gpu_bench.py --model llama-1b --batch 2 --seq 2048 \
    --steps 8 --warmup 3 --out "$out/gpu_bench.md" 2>&1 | tee -a "$out/summary.txt"
timeout 300 python3 benchmarks/gpu_bench.py --model llama-1b --batch 2 --seq 2048 --steps 8 --warmup 3 --compile --out "$out/gpu_bench_compile.md" 2>&1 | tee -a "$out/summary.txt"
