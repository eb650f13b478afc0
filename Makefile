# treepipe: `make demo` and `make test` on a fresh Debian/Ubuntu machine with Python 3.11.
PYTHON ?= python3.11
ifeq (, $(shell command -v $(PYTHON) 2>/dev/null))
PYTHON := python3
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

DEMO_PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: install demo test test-grid lint model clean proto

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# pinned CPU torch first: an open-ended torch requirement would pull GBs of CUDA wheels
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/treepipe model fetch smollm2-135m

# The demo trains nothing: it uses a distilled draft when `treepipe draft distill` has
# left one in the cache (see docs/drafts.md; ~1 h on 2 CPU cores), else the n-gram source.
DEMO_DRAFT ?= $(shell $(BIN)/python -c "from orchestrator.lab.drafting.distill import default_drafts_dir as d; print(d() / 'smollm2-135m-l6')" 2>/dev/null)

demo: model
	@if [ -n "$(DEMO_DRAFT)" ] && [ -f "$(DEMO_DRAFT)/config.json" ]; then \
		echo "demo: token source = distilled draft $(DEMO_DRAFT) with n-gram (hybrid)"; \
		src="--draft hybrid --draft-model $(DEMO_DRAFT)"; \
	else \
		echo "demo: no distilled draft in $(DEMO_DRAFT); the demo trains none (train one with 'treepipe draft distill', docs/drafts.md), token source = n-gram"; \
		src="--draft ngram"; \
	fi; \
	$(BIN)/treepipe generate --model smollm2-135m --stages 4 --method specpipe \
		$$src --width 16 --topk 8 --max-new-tokens 64 --chat \
		--prompt "$(DEMO_PROMPT)"

lint: install
	$(BIN)/ruff check .

# Two pytest workers (pytest-xdist), a file each at a time so module fixtures (a Redis
# server, a pipeline) start once; one torch thread per process, since two workers with
# torch's default thread count each spin-wait on 2 cores (a try ran ten times slower than one worker).
# Stage workers the tests start inherit OMP_NUM_THREADS=1 as well.
# Files go out longest first (tests/conftest.py, FILE_SECONDS), so neither worker ends
# on a long file alone.
TEST_WORKERS ?= 2
# Tests marked grid are the rest of a cross product whose pairwise subset runs here
# (each pair of its factors met at least once); `make test-grid` runs the whole product.
test: model lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 -m "not grid"

test-grid: model
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m grid

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

proto: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		protocol/treepipe.proto
