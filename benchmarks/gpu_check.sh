#!/usr/bin/env bash
# Every GPU check in one command, sized for a short lease of a GPU machine (at most
# 9.5 minutes, 570 s of step limits: every step has one): dynajax's device tests, the per-call layers of
# two tiny graphs, the per-step profile of four rows (with Chrome traces of two), the
# decode benchmark and the benchmark table.
#
#     OUT=gpu-out bash benchmarks/gpu_check.sh                       # every step
#     OUT=gpu-out STEPS="tests overhead" bash benchmarks/gpu_check.sh  # some of them
#
# Steps: tests overhead profile decode table (the versions are always printed), and
# memory (not in the default list: about 4 minutes more), the peak host and device
# memory of two train_step rows against eager's, each in fresh processes.
# Needs CUDA builds of torch and jax (and transformers) in the python3 it finds; the
# checkout goes on PYTHONPATH (no install needed). Writes at most 7 files to $OUT:
# log.txt (everything printed), bench.json (the table's results), traces/*.json.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out/traces"
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log="$out/log.txt"
steps=" ${STEPS:-tests overhead profile decode table} "
step() { echo "== $* ($(date -u +%H:%M:%S))" >>"$log"; }
want() { [[ $steps == *" $1 "* ]] && step "$1"; }
step versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$log" 2>&1
python3 -c "import torch, jax; print(torch.__version__, jax.__version__, jax.devices())" >>"$log" 2>&1
if want tests; then
# (the training cache's tests: whether this torch release has what aot/rebuild.py records)
timeout 100 python3 -m pytest -q -p no:cacheprovider -o log_level=WARNING \
    tests/runtime/test_devices.py tests/runtime/test_conversion.py \
    tests/capability/test_verdicts.py tests/runtime/test_inputs.py \
    tests/cache/test_aot_training_cache.py 2>&1 \
    | grep -v "^DEBUG" | tail -60 >>"$log"
fi
if want overhead; then
timeout 95 python3 -m benchmarks.overhead --device cuda --calls 1000 --rounds 5 \
    --no-context --cprofile 300 >>"$log" 2>&1
fi
if want table; then
timeout 240 python3 -m benchmarks.run --device cuda --no-first-call --no-memory --no-plot \
    --repeats 6 --warmup 3 --budget 1.5 --out "$tmp" 2>&1 | grep -v "^\[bench\]" >>"$log"
cp "$tmp/latest.json" "$out/bench.json" 2>/dev/null || cp "$tmp/partial.json" "$out/bench.json"
fi
if want profile; then
timeout 45 python3 -m benchmarks.profile --device cuda --workloads mlp,resnet18 --steps 5 \
    --trace-dir "$out/traces" >>"$log" 2>&1
timeout 25 python3 -m benchmarks.profile --device cuda --workloads add-one,gpt2 --steps 10 \
    >>"$log" 2>&1
fi
if want decode; then
timeout 65 python3 -m benchmarks.decode --device cuda --rounds 3 --new-tokens 32 2>&1 \
    | grep -v "^\[decode\]" >>"$log"
fi
if want memory; then
timeout 300 python3 -m benchmarks.memory --device cuda --rows gpt2-train-step,resnet18-train-step \
    --peers eager,dynajax >>"$log" 2>&1
fi
step done
rm -rf "$tmp"
