#!/bin/bash
# The device's measuring call for issue 68's headline: benchmarks/max_batch.py on the GPU (each
# method's largest batch in plain PyTorch's memory at b0, host offload over pinned memory), the
# CUDA tests beside it when TEST_TIMEOUT > 0. The report is rewritten after each model
# (max_batch.json, .md, .png), so a call cut by its limit still returns the models done.
# usage: bash benchmarks/device/max_batch_run.sh TEST_TIMEOUT BENCH_TIMEOUT [max_batch args...]
#   e.g. bash benchmarks/device/max_batch_run.sh 0 470 --models deep_resnet --limit 16
#   (DEV=cpu PY=.venv/bin/python OUT=/tmp/x ...: a rehearsal here)
set -u
TT=$1 BT=$2; shift 2
DEV=${DEV:-cuda}
[ "$DEV" != cpu ] && source benchmarks/device/env.sh
PY=${PY:-python3}
if [ "$TT" -gt 0 ]; then
  timeout $TT $PY -m pytest -p no:cacheprovider -n 6 -q -rfE -k cuda tests \
    > $OUT/pytest.log 2>&1 &
fi
timeout $BT $PY benchmarks/max_batch.py --device $DEV --out $OUT "$@" > $OUT/max_batch.log 2>&1 &
wait
ls -la $OUT; [ -f $OUT/pytest.log ] && tail -n 5 $OUT/pytest.log; tail -n 60 $OUT/max_batch.log
