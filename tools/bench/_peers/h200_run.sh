#!/bin/bash
# The H200 part of `tools.bench peers` (issue 20): kvstore's GPU load path against LMCache 0.5.3's
# CUDA paged-KV connector, one prefix restored into a vLLM-layout paged cache. Run from inside the
# bundle that tools/bench/_peers/h200_bundle.sh builds (the repository's code + wheels/), on the GPU
# machine (no network there): installs the wheels, probes, runs the bench, writes JSON lines and a
# log under "$OUT/peers/". Stays under 280 s in all.
set -u
OUTD="${OUT:-/tmp/peers-out}/peers"
mkdir -p "$OUTD"
LOG="$OUTD/peers-cuda.log"
exec > >(tee -a "$LOG") 2>&1
START=$SECONDS
left() { echo $((275 - (SECONDS - START))); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/peers-site wheels/*.whl || { echo "peers: wheel install failed"; exit 1; }
export PYTHONPATH="$PWD:/tmp/peers-site" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1

echo "== probe ($(date -u +%T))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
df -h /dev/shm /tmp | tail -n +2 || true
timeout 90 python3 - <<'PY' || echo "peers: probe failed (rc $?), the bench runs anyway"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import lmcache
print("lmcache", getattr(lmcache, "__version__", "?"), lmcache.__file__)
import lmcache.c_ops as ops
print("c_ops formats:", [n for n in dir(ops.EngineKVFormat) if n.isupper()][:40])
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2  # noqa: F401
import kvstore, engine.gpu  # noqa: F401
print("imports ok")
PY

echo "== bench, every store in one run ($(date -u +%T))"
timeout 200 python3 -m tools.bench peers --device cuda --json --dir /tmp/peers-scratch > "$OUTD/peers-cuda.jsonl"
rc=$?
echo "peers: bench exit $rc after $((SECONDS - START)) s"
if [ $rc -ne 0 ]; then
    # A crash in one store (a CUDA fault in LMCache's kernel, say) takes the process with it:
    # run each side alone, so that whatever works still comes back.
    echo "== split: kvstore alone, then lmcache alone ($(date -u +%T))"
    t=$(left); [ "$t" -gt 20 ] && timeout $((t / 2)) python3 -m tools.bench peers --device cuda --json \
        --only kvstore,kvstore-rows --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: kvstore alone exit $?"
    t=$(left); [ "$t" -gt 20 ] && timeout "$t" python3 -m tools.bench peers --device cuda --json \
        --only lmcache --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: lmcache alone exit $?"
fi
echo "== done after $((SECONDS - START)) s ($(date -u +%T))"
