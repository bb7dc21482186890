# Two commands matter: `make run` and `make test`. Both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PORT ?= 8000

.PHONY: install image-triton kernels run test test-fast lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build on this machine's disk; the project's range then keeps it
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[executor,test]'
	touch $(STAMP)

install: $(STAMP)

# the GPU image's Triton in .cache/, for the compile check's second run (bench/gpu/image_triton.py); a no-op once there
image-triton: install
	$(PY) -m bench.gpu.image_triton

run: install
	$(VENV)/bin/kvserve model pull
	@echo "Starting kvserve on http://127.0.0.1:$(PORT) (Ctrl-C stops all of it). Try:"
	@echo "  curl http://127.0.0.1:$(PORT)/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "    -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
	$(VENV)/bin/kvserve up --host 127.0.0.1 --port $(PORT)

# the CPU kernels compiled for this checkout (a minute, once; later starts load that build), before the tests
# time anything; where they cannot be built, everything runs on torch's ops and this says why
kernels: install
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); from kvkernels.cpu_extension import cpu_kernels; cpu_kernels()"

# two workers, each test file on one of them (its module-scoped stacks start once): much of a test's time is spent
# waiting on processes it started, so two files at once fill the two cores that one leaves half idle
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test: install image-triton kernels
	$(VENV)/bin/kvserve model pull
	$(PYTEST)

test-fast: install image-triton kernels
	$(PYTEST) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: install
	$(PY) -m bench.offline.throughput
	$(PY) -m bench.offline.prefix_cache

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .cache
