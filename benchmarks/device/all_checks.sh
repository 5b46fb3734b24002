#!/bin/bash
# Every GPU check the open issues ask for, in one device call (about 9 minutes; timeout_s 590):
#  1. the CUDA tests (pytest -k cuda), beside the rest, in their own process;
#  2. memfit.fit's accuracy: benchmarks/fit_accuracy.py (a 1.1B Llama in bf16 with AdamW planned
#     on fake tensors on this machine's CPU, then run for real: three policies, batches 1, 2, 4;
#     the largest batch fit finds for an RTX 4090, run on this GPU held to the 4090's memory);
#  3. issue 68's headline on the goal's two models: benchmarks/max_batch.py --size cpu (a 102-block
#     CIFAR ResNet and a 12-layer Llama with a 32,000 vocabulary), host offload over pinned memory,
#     after the accuracy run so that its timings share the GPU with nothing but the tests' end.
# Results land under $OUT (fit_accuracy.{json,md}, max_batch_cpu.{json,md,png}, logs), each
# rewritten as it goes, so a call cut by its limit keeps what finished. After setup.sh (README.md).
# usage: bash benchmarks/device/all_checks.sh [TEST_TIMEOUT=240] [FIT_TIMEOUT=300] [BATCH_TIMEOUT=260]
set -u
TT=${1:-240} FT=${2:-300} BT=${3:-260}
source benchmarks/device/env.sh
PY=${PY:-python3}
timeout $TT $PY -m pytest -p no:cacheprovider -n 4 -q -rfE -k cuda tests > $OUT/pytest.log 2>&1 &
timeout $FT $PY benchmarks/fit_accuracy.py --device cuda --out $OUT > $OUT/fit_accuracy.log 2>&1
timeout $BT $PY benchmarks/max_batch.py --device cuda --size cpu --models deep_resnet,llama_lm \
  --methods "plain,per-block checkpoint,memfit memory,memfit budget + offload" --limit 16 \
  --rounds 5 --out $OUT > $OUT/max_batch.log 2>&1
wait
ls -la $OUT; tail -n 5 $OUT/pytest.log; cat $OUT/fit_accuracy.md; tail -n 30 $OUT/max_batch.log
