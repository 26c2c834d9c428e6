#!/usr/bin/env bash
# The supported torch range, checked: for each torch version, a venv under $ROOT with the
# project installed normally (`pip install torch==V -e ".[test]"`, no --no-deps), then a
# subset covering the engine, the Trainer and Fabric strategies, a checkpoint saved under
# the first version and loaded under each, the CLI's default recipe for a few steps and
# `gpu_check.sh --dry-run`. Prints one row per (version, check): passed/failed, seconds.
#
#   bash benchmarks/torch_compat.sh [--reuse] [--versions "2.13.0 2.11.0 2.14.1"] [--root DIR]
#
# --reuse keeps a venv that already has the asked-for torch (the project is re-installed
#   into it, which installs nothing new when its requirements hold); without it every venv
#   is made afresh. The first version saves the checkpoint the others load.
# Each version takes ~5 minutes on 2 cores after its install, more on a busy machine (see
# docs/testing.md); a torch other than the machine's 2.13.0 CPU wheel is a CUDA build of
# several GB (a cold install of 2.11 with the test extras: ~9 minutes). Logs: $ROOT/logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

reuse=0
versions="2.13.0 2.11.0 2.14.1"
root=/tmp/yafsdp-torch-compat
while [ $# -gt 0 ]; do
    case "$1" in
        --reuse) reuse=1 ;;
        --versions) versions=$2; shift ;;
        --root) root=$2; shift ;;
        *) echo "usage: bash benchmarks/torch_compat.sh [--reuse] [--versions \"V ...\"] [--root DIR]" >&2
           exit 2 ;;
    esac
    shift
done
logs=$root/logs
checkpoint=$root/checkpoint
rm -rf "$logs" "$checkpoint"  # the summary below reads this run's logs only
mkdir -p "$logs"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
rows=()
failures=0

# The engine (schedule, shims), the Trainer (reference Llama and HF Llama vs "ddp") and
# Fabric (a hand-written loop vs Fabric's "ddp"), the imports and the console script.
subset=(
    tests/test_torch_compat.py
    tests/test_imports.py
    "tests/test_core_engine.py::test_recorded_schedule_meets_the_four_conditions"
    "tests/test_strategy.py::test_llama_32_true_with_accumulation_and_norm_clipping_matches_ddp"
    "tests/test_strategy.py::test_hugging_face_llama_32_true_matches_ddp"
    "tests/test_fabric.py::test_fabric_loop_with_accumulation_and_clipping_matches_ddp"
)

# run VERSION CHECK COMMAND...: times COMMAND, logs it, and records the row.
run() {
    local version=$1 check=$2; shift 2
    local log="$logs/torch-$version-$check.log" start=$SECONDS result=passed
    "$@" > "$log" 2>&1 || { result=failed; failures=$((failures + 1)); }
    rows+=("| $version | $check | $result | $((SECONDS - start)) |")
    echo "torch $version: $check $result ($((SECONDS - start)) s; log $log)"
}

has_torch() {  # has_torch PYTHON VERSION
    [ -x "$1" ] && [ "$("$1" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$2" ]
}

install() {  # install VENV VERSION
    if [ "$reuse" -eq 0 ] || ! has_torch "$1/bin/python" "$2"; then
        rm -rf "$1" && python3 -m venv "$1" || return 1
    fi
    "$1/bin/pip" install "torch==$2" -e "$repo[test]" && has_torch "$1/bin/python" "$2"
}

cli_default_recipe() {  # cli_default_recipe VENV: `yafsdp train`, the default recipe, 5 steps
    local runs=$root/cli-runs
    rm -rf "$runs" && mkdir -p "$runs" \
        && (cd "$runs" && "$1/bin/yafsdp" train trainer.max_steps=5 \
            trainer.val_check_interval=5 trainer.limit_val_batches=2 trainer.log_every_n_steps=1) \
        && ls "$runs"/runs/*/summary.json
}

first=""
for version in $versions; do
    venv=$root/venv-torch-$version
    run "$version" install install "$venv" "$version" || true
    if ! has_torch "$venv/bin/python" "$version"; then
        continue
    fi
    run "$version" tests "$venv/bin/python" -m pytest -q -p no:cacheprovider "${subset[@]}"
    if [ -z "$first" ]; then
        first=$version
        run "$version" checkpoint-save \
            "$venv/bin/python" benchmarks/checkpoint_across_versions.py save "$checkpoint"
    fi
    [ -f "$checkpoint/reference.pt" ] && run "$version" "checkpoint-load-from-$first" \
        "$venv/bin/python" benchmarks/checkpoint_across_versions.py load "$checkpoint"
    run "$version" cli-train cli_default_recipe "$venv"
    run "$version" gpu-check-dry-run \
        env PATH="$venv/bin:$PATH" OUT="$root/gpu-check-$version" bash benchmarks/gpu_check.sh --dry-run
done

echo
echo "| torch | check | result | seconds |"
echo "|---|---|---|---:|"
printf '%s\n' "${rows[@]}"
echo
grep -h "^saved under" "$logs"/*checkpoint-load* 2>/dev/null
echo "$failures failed"
[ "$failures" -eq 0 ]
