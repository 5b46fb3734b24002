#!/bin/bash
# The device's one measuring call: the CUDA tests and the three models' Inductor frontiers, in
# parallel processes; the frontiers time one at a time once nothing compiles (--timing-lock).
# usage: [MODELS="resnet unet"] bash benchmarks/device/run.sh DEVICE TEST_TIMEOUT FRONTIER_TIMEOUT
#          [frontier args...]   (TEST_TIMEOUT 0: no tests; MODELS: the frontiers to run, default all)
set -u
DEV=$1 TT=$2 FT=$3; shift 3
[ -f benchmarks/device/env.sh ] && [ "$DEV" != cpu ] && source benchmarks/device/env.sh
PY=${PY:-python3}
W=/tmp/frontier; rm -rf $W; mkdir -p $W; L=$W/timing.lock
if [ "$TT" -gt 0 ]; then
  timeout $TT $PY -m pytest -p no:cacheprovider -n 6 -v -rA -k cuda tests \
    > $OUT/pytest.log 2>&1 &
  touch $L.warming.$!
fi
for m in ${MODELS:-resnet transformer unet}; do
  timeout $FT $PY benchmarks/budget_frontier.py --device $DEV --executor inductor --models $m \
    --peers torch.compile memfit --timing-lock $L --out-dir $W/$m "$@" \
    > $OUT/frontier_$m.log 2>&1 &
done
wait
tar czf $OUT/frontier.tgz -C $W --exclude='timing.lock*' .
ls -la $OUT; tail -n 3 $OUT/*.log
