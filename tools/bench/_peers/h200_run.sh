#!/bin/bash
# The GPU part of `tools.bench peers` on a machine with no network (the lent H100/H200): installs
# the wheels (lmcache 0.5.3, the daemon's packages the image lacks), runs the CUDA tests of the
# data path, then RUNS paired runs of the paged bench: the vLLM connector's rows (its worker side
# as vLLM drives it, against a real daemon over shared memory), the bench's own `kvstore` row and
# LMCache's paged vLLM connector (`lmcache-nhd`), 4K and 32K tokens of a Llama-3-8B shape, every
# page verified. JSON lines and logs under "$OUT/peers/". Run from the repository root:
#   WHEELS=.whl bash tools/bench/_peers/h200_run.sh      (h200_bundle.sh builds the wheels)
# BUDGET: seconds in all (default 560); every step checks the time left. RUNS (3), KV (the kvstore
# rows), SIZES, PEERS_ARGS (more `peers` arguments), TAG (a suffix of the output folder), NO_TESTS.
set -u
OUTD="${OUT:-/tmp/peers-out}/peers${TAG:+-$TAG}"
mkdir -p "$OUTD"
LOG="$OUTD/peers-cuda.log"
exec > >(tee -a "$LOG") 2>&1
START=$SECONDS
BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - (SECONDS - START))); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/peers-site "${WHEELS:-wheels}"/*.whl || { echo "peers: wheel install failed"; exit 1; }
export PYTHONPATH="$PWD:/tmp/peers-site" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1

echo "== probe ($(date -u +%T))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc || true
for n in /sys/devices/system/node/node[0-9]*; do echo "$(basename "$n"): cpus $(cat "$n/cpulist") $(grep MemTotal "$n/meminfo" | awk '{print $(NF-1)/1048576 " GiB"}')"; done || true
nvidia-smi topo -m 2>/dev/null | head -4 || true
python3 -c "import torch, engine.gpu, engine.transfer, kvstore.server.daemon; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" || true

if [ -z "${NO_TESTS:-}" ]; then
    echo "== CUDA tests ($(date -u +%T))"
    timeout $(( $(left) / 4 )) python3 -m pytest -q -p no:cacheprovider tests/engine/test_transfer.py \
        tests/engine/vllm/test_pages_device.py tests/engine/test_gpu.py tests/engine/vllm/test_worker_families.py \
        tests/engine/reference/test_hybrid.py tests/engine/reference/test_mla.py > "$OUTD/cuda-tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUTD/cuda-tests.log" | tail -40
    echo "peers: tests done after $((SECONDS - START)) s"
fi

KV=${KV:-kvstore-connector,kvstore-connector-hnd,kvstore-connector-lw,kvstore}
for i in $(seq 1 "${RUNS:-3}"); do
    t=$(left)
    if [ "$t" -lt 60 ]; then echo "peers: $t s left, run $i skipped"; continue; fi
    echo "== run $i: $KV,lmcache-nhd --paired ($(date -u +%T))"
    timeout $((t - 10)) python3 -m tools.bench peers --device cuda --json --paired --only "$KV,lmcache-nhd" \
        --dir /tmp/peers-scratch ${SIZES:+--sizes $SIZES} ${PEERS_ARGS:-} > "$OUTD/peers-cuda-r$i.jsonl"
    echo "peers: run $i exit $? after $((SECONDS - START)) s"
    if grep -q '"status": "failed"' "$OUTD/peers-cuda-r$i.jsonl"; then  # fix first: no more device time on it
        echo "peers: run $i has failed rows; no further runs"
        break
    fi
done
echo "== the goal rows"
python3 - "$OUTD" <<'PY' || true
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("peers-cuda-r*.jsonl")):
    for line in f.read_text().splitlines():
        r = json.loads(line)
        m = r.get("metric", "")
        if "_vs_" in m and m.startswith("kvstore"):
            print(f.name, m, round(r["ratio"], 3))
        elif m.endswith(("_restore", "_save")) and "ms" in r:
            print(f.name, m, r["ms"], "ms", "baseline", r.get("baseline_ms"), "verified", r.get("verified"),
                  {k: r[k] for k in ("compute_ms",) if k in r})
        elif r.get("status") in ("failed", "unavailable"):
            print(f.name, m, r.get("error"), r.get("traceback", "")[-800:])
PY
echo "== done after $((SECONDS - START)) s ($(date -u +%T))"
