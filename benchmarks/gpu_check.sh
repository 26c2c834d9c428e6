#!/usr/bin/env bash
# One script for a lent single GPU (see the device tool's README): CUDA-marked tests,
# then yafsdp vs FSDP2 on a ~1B Llama in bf16. Uses the machine's own python3 and CUDA
# torch (nothing is installed: the device reaches no registry). What it runs imports
# torch, lightning, transformers and pytest only (no omegaconf: the CLI is not run), so
# the repo root on PYTHONPATH is enough; docs/testing.md#the-gpu-check lists the versions
# it was proven with.
# Writes under ${OUT:-gpu_check_out}; budget ~8 minutes.   bash benchmarks/gpu_check.sh
#
# --dry-run: on a CPU, before spending a GPU's minutes: prints the versions, imports every
# module the check uses, then runs the tiniest version of each step (the CUDA test file
# collected and skipped, the multi-rank harness on gloo, gpu_bench.py on a tiny model on
# the CPU). Exits non-zero at the first step that fails.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
case "${1:-}" in
    --dry-run) dry_run=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary="$out/summary.txt"
: > "$summary"

say() { echo "$*" | tee -a "$summary"; }

# A step that fails ends a dry run (its purpose is to find that out); a GPU run goes on
# to the next step, so one failure does not waste the lease's remaining minutes.
step() {
    local name=$1; shift
    say "== $name"
    "$@" 2>&1 | tee -a "$summary"
    local status=${PIPESTATUS[0]}
    if [ "$status" -ne 0 ]; then
        say "!! $name failed (exit $status)"
        [ "$dry_run" -eq 1 ] && exit "$status"
    fi
    return 0
}

versions() {
    python3 - <<'EOF'
import importlib.metadata as metadata
import platform

import torch

print("python", platform.python_version(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| cuda available", torch.cuda.is_available())
for name in ("lightning", "transformers", "pytest", "omegaconf", "rich"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name} absent")
EOF
}

# Every module the steps below import, each named if it fails.
imports() {
    python3 - <<'EOF'
import importlib

modules = (
    "lightning_yafsdp", "lightning_yafsdp.core", "lightning_yafsdp.models.llama",
    "lightning.pytorch", "transformers", "pytest", "torch.distributed.fsdp",
    "tests.distributed", "tests.schedule_check", "tests.test_core_cuda",
    "tests.test_torch_compat", "benchmarks.gpu_bench",
)
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:  # report every failing module, not only the first
        failed.append(f"{name}: {type(error).__name__}: {error}")
print("\n".join(failed) if failed else f"all {len(modules)} modules import")
raise SystemExit(1 if failed else 0)
EOF
}

if [ "$dry_run" -eq 0 ]; then
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1
fi
step "versions" versions
step "imports" imports
if [ "$dry_run" -eq 1 ]; then
    # The CUDA test file is collected and skipped here; the harness it uses (dist_run,
    # with every module its ranks preload) runs for real in the compat tests.
    step "CUDA tests (dry run: collected and skipped on CPU; harness on gloo)" \
        timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/test_core_cuda.py tests/test_torch_compat.py
    step "yafsdp vs FSDP2 (dry run: tiny, CPU, gloo)" \
        timeout 300 python3 benchmarks/gpu_bench.py --device cpu --model tiny --batch 1 \
        --seq 32 --steps 1 --warmup 0 --out "$out/gpu_bench_dry_run.md"
    say "dry run passed"
    exit 0
fi
step "CUDA tests" \
    timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_core_cuda.py
step "yafsdp vs FSDP2, llama-1b bf16" \
    timeout 300 python3 benchmarks/gpu_bench.py --model llama-1b --batch 2 --seq 2048 \
    --steps 8 --warmup 3 --out "$out/gpu_bench.md"
step "yafsdp vs FSDP2, llama-1b bf16, blocks compiled (inductor)" \
    timeout 300 python3 benchmarks/gpu_bench.py --model llama-1b --batch 2 --seq 2048 \
    --steps 8 --warmup 3 --compile --out "$out/gpu_bench_compile.md"
