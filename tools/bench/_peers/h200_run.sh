#!/bin/bash
# The H200 part of `tools.bench peers` (issue 20), third and fourth bundles (sixth session): kvstore's GPU
# load and save paths against LMCache 0.5.3's CUDA paged-KV connector, one prefix restored into
# and saved from a vLLM-layout paged cache, 4K and 32K tokens, each restore beside the same run's
# pinned host->device copy (the link) and each save beside a device->pinned copy. Run from inside
# the bundle that tools/bench/_peers/h200_bundle.sh builds (the repository's code + wheels/), on
# the GPU machine (no network there): installs the wheels, probes, runs the bench once with the
# kvstore variants and both LMCache layouts, twice more with the goal row's stores (a spread of
# three), kvstore's save with 4 and 16 copy threads beside the default, then the host copy's
# scaling with threads, out of and into the arena (and into it with glibc's non-temporal
# threshold at 4 MiB); writes JSON lines and a log under
# "$OUT/peers/". Every step checks the time left: under 290 s in all (`timeout 300 bash run.sh`).
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
(lscpu | grep -i -e "model name" -e "cache" -e "numa node(s)"; ldd --version | head -1) || true
timeout 60 python3 - <<'PY' || echo "peers: probe failed (rc $?), the bench runs anyway"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import lmcache
print("lmcache", getattr(lmcache, "__version__", "?"), lmcache.__file__)
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2  # noqa: F401
import kvstore, engine.gpu  # noqa: F401
from kvstore.buffers import default_copy_threads, default_piece_bytes, nontemporal_threshold
print("imports ok; default copy_threads", default_copy_threads(), "glibc non-temporal threshold",
      hex(nontemporal_threshold()), "copy piece", default_piece_bytes())
PY

GOAL=kvstore,kvstore-nohead,lmcache-nhd
echo "== run 1: kvstore's variants and both LMCache layouts ($(date -u +%T))"
timeout 140 python3 -m tools.bench peers --device cuda --json \
    --only kvstore,kvstore-nohead,kvstore-blocks,lmcache,lmcache-nhd \
    --dir /tmp/peers-scratch > "$OUTD/peers-cuda.jsonl"
rc=$?
echo "peers: run 1 exit $rc after $((SECONDS - START)) s"
if [ $rc -ne 0 ]; then
    # A crash in one store (a CUDA fault in LMCache's kernel, say) takes the process with it:
    # run each side alone, so that whatever works still comes back.
    t=$(left); [ "$t" -gt 40 ] && timeout $((t / 3)) python3 -m tools.bench peers --device cuda --json \
        --only kvstore,kvstore-nohead --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: kvstore alone exit $?"
    t=$(left); [ "$t" -gt 40 ] && timeout $((t / 2)) python3 -m tools.bench peers --device cuda --json \
        --only lmcache-nhd --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-split.jsonl"
    echo "peers: lmcache alone exit $?"
fi

for i in 2 3; do
    t=$(left)
    if [ "$t" -lt 60 ]; then echo "peers: $t s left, run $i skipped"; continue; fi
    echo "== run $i: the goal row's stores ($(date -u +%T))"
    timeout $((t - 20)) python3 -m tools.bench peers --device cuda --json --only $GOAL \
        --dir /tmp/peers-scratch > "$OUTD/peers-cuda-r$i.jsonl"
    echo "peers: run $i exit $? after $((SECONDS - START)) s"
done

for k in 4 16; do
    t=$(left)
    if [ "$t" -lt 35 ]; then echo "peers: $t s left, copy_threads $k skipped"; continue; fi
    echo "== kvstore with copy_threads $k ($(date -u +%T))"
    timeout $((t - 15)) python3 -m tools.bench peers --device cuda --json --only kvstore --copy-threads $k \
        --dir /tmp/peers-scratch > "$OUTD/peers-cuda-ct$k.jsonl"
    echo "peers: copy_threads $k exit $? after $((SECONDS - START)) s"
done

for way in out into; do
    t=$(left)
    if [ "$t" -lt 12 ]; then echo "peers: $t s left, copy threads ($way) skipped"; continue; fi
    flag=""; what="out of the arena"; [ $way = into ] && flag="--into-arena" && what="into the arena"
    echo "== host copy threads, $what ($(date -u +%T))"
    timeout $((t - 4)) python3 -m tools.bench._peers.copyscale --json $flag > "$OUTD/copy-threads-$way.jsonl"
    echo "peers: copy threads ($way) exit $?"
done
t=$(left)
if [ "$t" -gt 12 ]; then
    # glibc copies with non-temporal stores only above a threshold (a share of the L3): the same
    # copy into the arena with the threshold at 4 MiB says whether the 32 MiB pieces miss them.
    echo "== host copy threads into the arena, non-temporal from 4 MiB ($(date -u +%T))"
    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x400000 timeout $((t - 4)) \
        python3 -m tools.bench._peers.copyscale --json --into-arena > "$OUTD/copy-threads-into-nt4m.jsonl"
    echo "peers: copy threads (into, nt 4 MiB) exit $?"
fi
echo "== done after $((SECONDS - START)) s ($(date -u +%T))"
