#!/bin/bash
# On the device, in the last chunk's call: unpack the torch/triton wheels sent in chunks, install
# them beside the machine's own torch, build the NCCL stub (README.md says why).
# The torchvision wheel (7.7 MB) travels whole in that call: the machine's own torchvision is built
# for its torch 2.11 and breaks `import transformers` under 2.13 (the GPT-2 cases).
set -eu
mkdir -p /root/w && cat /root/parts/p* | tar x -C /root/w
cp .whl/torchvision-*.whl /root/w/
(cd /root/w && md5sum -c "$OLDPWD/benchmarks/device/wheels.md5")
# transformers, peft and regex at the versions memfit's integrations are tested with (the machine
# has transformers 5.17), where they travel too (benchmarks/hf_models.py)
for w in transformers peft regex; do cp .whl/$w-*.whl /root/w/ 2>/dev/null || true; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /root/w/*.whl
cat > /root/ncclstub.c <<'C'
int ncclCommMemStats(void) { return 3; }
int ncclCommResume(void) { return 3; }
int ncclCommSuspend(void) { return 3; }
int ncclGetLsaMultimemDevicePointer(void) { return 3; }
int ncclGetPeerDevicePointer(void) { return 3; }
int ncclPutSignal(void) { return 3; }
int ncclSignal(void) { return 3; }
int ncclWaitSignal(void) { return 3; }
C
gcc -shared -fPIC -O2 -o /root/libncclstub.so /root/ncclstub.c
source benchmarks/device/env.sh
python3 -c "import torch, triton, memfit, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.is_available())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
