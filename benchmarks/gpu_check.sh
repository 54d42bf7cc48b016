#!/usr/bin/env bash
# The checks for a lent GPU machine, in one call (README, "On a GPU"): the CUDA tests, then
# step_time.py on the GPT-2-small set, profiled, with and without inductor's combo kernels.
# Logs and JSON under $OUT (default gpu_check_out). From the repository root:
#   bash benchmarks/gpu_check.sh [WHEEL_DIR]    # WHEEL_DIR: wheels to install first (expecttest, pytest-xdist)
# TEST_S and BENCH_S bound each part in seconds (cold caches: ~190 s of tests, ~3 min per benchmark);
# their defaults add up to 540 s, within a lent machine's 600 s per command.
set -u
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
if [ -n "${1:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$1"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself: its torch may not satisfy pip's torch>=2.13
{ nvidia-smi -L; python3 -c "import torch, lowbit_optim; print(torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.log"

start=$(date +%s)
# -v: each result is named as it comes, so a time limit keeps them
timeout "${TEST_S:-200}" python3 -m pytest -n "${WORKERS:-14}" -v -p no:cacheprovider \
    test/test_cuda.py test/test_optimizers.py test/test_formats.py -k cuda > "$OUT/tests.log" 2>&1
echo "tests: rc $? in $(($(date +%s) - start)) s; $(grep -c ' PASSED' "$OUT/tests.log") passed, $(grep -c ' FAILED' "$OUT/tests.log") failed"
grep -E ' (FAILED|ERROR) ' "$OUT/tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | head -20

rows=torch-fused,lowbit-fp32,lowbit-8bit,lowbit-8bit-compiled
for variant in plain combo; do
    extra=()
    [ "$variant" = combo ] && extra=(--inductor combo_kernels=True)
    start=$(date +%s)
    timeout "${BENCH_S:-170}" python3 benchmarks/step_time.py --device cuda --steps 10 --warmup 3 --only "$rows" \
        --profile "$OUT/profile_$variant" --json "$OUT/step_time_$variant.json" "${extra[@]}" > "$OUT/bench_$variant.log" 2>&1
    echo "step_time ($variant): rc $? in $(($(date +%s) - start)) s"
    grep -A8 '^| optimizer' "$OUT/bench_$variant.log"
done
