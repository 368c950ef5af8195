#!/bin/bash
# The H200 part of `tools.bench peers` (issue 20): kvstore's GPU load path against LMCache 0.5.3's
# CUDA paged-KV connector, one prefix restored into a vLLM-layout paged cache. Run from inside the
# bundle that tools/bench/_peers/h200_bundle.sh builds (the repository's code + wheels/), on the GPU
# machine (no network there): installs the wheels, probes, runs the bench once with every store,
# then twice more with the stores of the goal row (a spread of three), then the host copy's
# scaling with threads on this 16-core host (what kvstore's default copy_threads should be);
# writes JSON lines and a log under "$OUT/peers/". Every step checks the time left: under 290 s
# in all (`timeout 300 bash run.sh`).
set -u
OUTD="${OUT:-/tmp/peers-out}/peers"
mkdir -p "$OUTD"
LOG="$OUTD/peers-cuda.log"
exec > >(tee -a "$LOG") 2>&1
START=$SECONDS
left() { echo $((285 - (SECONDS - START))); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/peers-site wheels/*.whl || { echo "peers: wheel install failed"; exit 1; }
export PYTHONPATH="$PWD:/tmp/peers-site" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1

echo "== probe ($(date -u +%T))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc || true
timeout 60 python3 - <<'PY' || echo "peers: probe failed (rc $?), the bench runs anyway"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import lmcache
print("lmcache", getattr(lmcache, "__version__", "?"), lmcache.__file__)
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2  # noqa: F401
import kvstore, engine.gpu  # noqa: F401
print("imports ok")
PY

echo "== run 1: every store ($(date -u +%T))"
timeout 130 python3 -m tools.bench peers --device cuda --json --dir /tmp/peers-scratch > "$OUTD/peers-cuda.jsonl"
rc=$?
echo "peers: run 1 exit $rc after $((SECONDS - START)) s"
if [ $rc -ne 0 ]; then
    # A crash in one store (a CUDA fault in LMCache's kernel, say) takes the process with it:
    # run each side alone, so that whatever works still comes back.
    t=$(left); [ "$t" -gt 40 ] && timeout $((t / 3)) python3 -m tools.bench peers --device cuda --json \
        --only kvstore,kvstore-blocks --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: kvstore alone exit $?"
    t=$(left); [ "$t" -gt 40 ] && timeout $((t / 2)) python3 -m tools.bench peers --device cuda --json \
        --only lmcache-nhd --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: lmcache alone exit $?"
fi

for i in 2 3; do
    t=$(left)
    if [ "$t" -lt 70 ]; then echo "peers: $t s left, run $i skipped"; continue; fi
    echo "== run $i: the goal row's stores ($(date -u +%T))"
    timeout $((t - 25)) python3 -m tools.bench peers --device cuda --json --only kvstore,kvstore-blocks,lmcache-nhd \
        --dir /tmp/peers-scratch > "$OUTD/peers-cuda-r$i.jsonl"
    echo "peers: run $i exit $? after $((SECONDS - START)) s"
done

t=$(left)
if [ "$t" -gt 15 ]; then
    echo "== host copy threads ($(date -u +%T))"
    timeout $((t - 5)) python3 -m tools.bench._peers.copyscale --json > "$OUTD/copy-threads.jsonl"
    echo "peers: copy threads exit $?"
fi
echo "== done after $((SECONDS - START)) s ($(date -u +%T))"
