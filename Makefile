# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench reliability-long clean

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

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m tools.bench all --json

# The long reliability run (docs/reliability.md): ~8 minutes; figures to reliability-figures.json.
reliability-long: $(STAMP)
	KVSTORE_RELIABILITY=long KVSTORE_RELIABILITY_OUT=reliability-figures.json $(PY) -m pytest tests/reliability -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
