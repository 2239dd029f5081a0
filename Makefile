# One entry point for people and CI: `make test` (runs `make setup` first when needed).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint bench clean

setup: $(STAMP)

# torch first, pinned: anything that lets pip choose torch by itself may pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[test,bench,deepspeed]"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/run.py
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/distributed.py
	$(PY) benchmarks/trainer.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
