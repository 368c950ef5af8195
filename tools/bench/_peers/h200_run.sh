#!/bin/bash
# The GPU part of `tools.bench peers`: kvstore's GPU save and restore
# against LMCache 0.5.3's CUDA paged-KV connector, one prefix saved from and restored into a
# vLLM-layout paged cache, 4K and 32K tokens, each restore beside the same run's pinned
# host->device copy (the link) and each save beside a device->pinned copy. Three consecutive runs
# of the goal row's stores: `kvstore` (the save straight into reserved arena slots, the restore
# with its head), `kvstore-nohead` (the restore without the head), `kvstore-put` (the save
# through a pinned buffer, then a put) and `lmcache-nhd` (LMCache on vLLM's CUDA default
# layout). Run from inside the bundle that tools/bench/_peers/h200_bundle.sh builds (the
# repository's code + wheels/), on the GPU machine (no network there): installs the wheels, probes,
# runs the bench three times; writes JSON lines and a log under "$OUT/peers/". Every step checks
# the time left: under 290 s in all (`timeout 300 bash run.sh`).
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
(lscpu | grep -i -e "model name" -e "numa node(s)"; ldd --version | head -1) || true
timeout 60 python3 - <<'PY' || echo "peers: probe failed (rc $?), the bench runs anyway"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import lmcache
print("lmcache", getattr(lmcache, "__version__", "?"), lmcache.__file__)
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2  # noqa: F401
import kvstore, engine.gpu  # noqa: F401
from engine.gpu import ArenaSlots  # noqa: F401  (the seventh bundle's code)
from kvstore.buffers import default_copy_threads
print("imports ok; default copy_threads", default_copy_threads(),
      "cudaMemcpy2DAsync", engine.gpu._memcpy2d() is not None)
PY

if [ -n "${PROBE:-}" ]; then
    echo "== head probe ($(date -u +%T))"
    timeout 60 python3 -m tools.bench._peers.headprobe > "$OUTD/headprobe.jsonl" || echo "peers: head probe exit $?"
    cat "$OUTD/headprobe.jsonl"
fi

KV=${KV:-kvstore,kvstore-head32,kvstore-leasehead}
for i in 1 2 3; do
    t=$(left)
    if [ "$t" -lt 50 ]; then echo "peers: $t s left, run $i skipped"; continue; fi
    echo "== run $i: $KV,lmcache-nhd ${PAIRED---paired} ($(date -u +%T))"
    timeout $((t - 10)) python3 -m tools.bench peers --device cuda --json --only $KV,lmcache-nhd ${PAIRED---paired} \
        --dir /tmp/peers-scratch > "$OUTD/peers-cuda-r$i.jsonl"
    rc=$?
    echo "peers: run $i exit $rc after $((SECONDS - START)) s"
    if [ $rc -ne 0 ]; then
        # A crash in one store (a CUDA fault in LMCache's kernel, say) takes the process with it:
        # run each side alone, so that whatever works still comes back.
        t=$(left); [ "$t" -gt 40 ] && timeout $((t / 3)) python3 -m tools.bench peers --device cuda --json \
            --only $KV --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-r$i-split.jsonl"
        echo "peers: run $i, kvstore alone exit $?"
        t=$(left); [ "$t" -gt 40 ] && timeout $((t / 2)) python3 -m tools.bench peers --device cuda --json \
            --only lmcache-nhd --dir /tmp/peers-scratch >> "$OUTD/peers-cuda-r$i-split.jsonl"
        echo "peers: run $i, lmcache alone exit $?"
    fi
done
echo "== the goal rows (kvstore / lmcache-nhd)"
python3 - "$OUTD" <<'PY' || true
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("peers-cuda-r*.jsonl")):
    for line in f.read_text().splitlines():
        r = json.loads(line)
        m = r.get("metric", "")
        if m.startswith(("kvstore_vs_lmcache-nhd", "kvstore-put_vs_lmcache-nhd", "kvstore-head4_vs_lmcache-nhd",
                         "kvstore-g16_vs_lmcache-nhd", "kvstore-groups_vs_lmcache-nhd", "kvstore-leasehead_vs_lmcache-nhd", "kvstore-head32_vs_lmcache-nhd")):
            print(f.name, m, round(r["ratio"], 3))
        elif m.startswith(("kvstore_paged_", "kvstore-head4_paged_", "kvstore-g16_paged_", "kvstore-groups_paged_", "kvstore-leasehead_paged_", "kvstore-head32_paged_")) and ("phases_ms" in r or "save_phases_ms" in r):
            print(f.name, m, r.get("ms"), r.get("phases_ms") if m.endswith("restore") else r.get("save_phases_ms"))
PY
echo "== done after $((SECONDS - START)) s ($(date -u +%T))"
