#!/bin/bash
# Build the H200 bundle of the paged peer bench: DEST/bundle/ (this checkout's code, wheels/ with
# lmcache 0.5.3 and the packages the H200 image lacks, run.sh), DEST/run.sh, then DEST/$MARK
# (READY unless MARK says otherwise, e.g. MARK=READY2 for a second hand-off).
# Usage: [MARK=READY2] tools/bench/_peers/h200_bundle.sh DEST [WHEEL_CACHE]
set -euo pipefail
DEST=${1:?usage: h200_bundle.sh DEST [WHEEL_CACHE]}
WHEELS=${2:-/tmp/peers-wheels}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PY:-python3}
# Python 3.12, manylinux x86-64 (the H200 image: torch 2.11 + CUDA 13). lmcache 0.5.3 is the newest
# whose CUDA extensions load with torch 2.11. The rest: what lmcache imports at engine start and the
# image lacks (aiofile + caio, cachetools, msgspec, pyzmq, nvtx), and zstandard for kvstore.
PKGS="lmcache==0.5.3 aiofile==3.12.3 caio==0.12.10 cachetools==8.0.2 msgspec==0.23.0 pyzmq==27.3.0 nvtx==0.2.17 zstandard==0.25.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.3 uvicorn==0.55.0 rocksdict==0.3.29 fastapi-offline==1.7.7 httptools==0.9.0"
mkdir -p "$WHEELS"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS" $PKGS
rm -rf "$DEST/bundle"
mkdir -p "$DEST/bundle/wheels"
# The code only: tracked and untracked-not-ignored files of the checkout, less tests and docs.
git -C "$ROOT" ls-files -co --exclude-standard | grep -v -e '^tests/' -e '^docs/' \
    | (cd "$ROOT" && tar -cf - -T -) | tar -xf - -C "$DEST/bundle"
for p in $PKGS; do
    name=${p%%==*}; ver=${p##*==}
    cp "$WHEELS"/"${name//-/_}"-"$ver"-*.whl "$WHEELS"/"$name"-"$ver"-*.whl "$DEST/bundle/wheels/" 2>/dev/null || true
done
cp "$ROOT/tools/bench/_peers/h200_run.sh" "$DEST/bundle/run.sh"
cp "$ROOT/tools/bench/_peers/h200_run.sh" "$DEST/run.sh"
ls "$DEST/bundle/wheels"
du -sh "$DEST/bundle" "$DEST/bundle/wheels"
touch "$DEST/${MARK:-READY}"
