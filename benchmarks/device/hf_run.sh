#!/bin/bash
# The device's measuring call for "memfit on real models": the CUDA tests and
# benchmarks/hf_models.py on the GPU, in parallel processes (the tests are done before the
# benchmark's later rows; its step times are medians). Logs and results land in $OUT.
# usage: bash benchmarks/device/hf_run.sh TEST_TIMEOUT BENCH_TIMEOUT [hf_models args...]
set -u
TT=$1 BT=$2; shift 2
source benchmarks/device/env.sh
if [ "$TT" -gt 0 ]; then
  timeout $TT python3 -m pytest -p no:cacheprovider -n 6 -q -rfE -k cuda tests \
    > $OUT/pytest.log 2>&1 &
fi
timeout $BT python3 benchmarks/hf_models.py --device cuda --out $OUT "$@" > $OUT/hf_models.log 2>&1 &
wait
ls -la $OUT; tail -n 5 $OUT/pytest.log; tail -n 40 $OUT/hf_models.log
