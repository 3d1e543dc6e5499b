# The README's commands. Each target sets up .venv first (torch pinned to 2.13.0, CPU build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo check-configs test test-numerics lint bench bench-setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

## demo: the main job: a 2-process CPU training of a tiny GPT with a ZeRO-2 bf16 config
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		examples/train_gpt.py --deepspeed_config examples/configs/zero2_bf16.json --steps 30

## check-configs: validate the bundled example configs for 2 ranks
check-configs: $(STAMP)
	$(BIN)/shardwise config check --world-size 2 examples/configs/*.json

## test: the whole test suite, then the numeric tests again with torch's portable (default) and AVX2
## CPU kernels, so results hold on any x86 CPU whatever kernels the machine picks natively
test: $(STAMP)
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory test-numerics

test-numerics: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m numeric tests
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m numeric tests

## bench: the engine-core benchmark, side by side with DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed
bench: $(STAMP)
	$(BIN)/python benchmarks/engine_core.py --out bench-results.json

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

## bench-setup: a separate venv with DeepSpeed, the engine-core benchmark's peer (never imported by src/)
DS_VENV := .venv-ds
bench-setup:
	test -x $(DS_VENV)/bin/python || $(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/pip install --quiet --upgrade pip
	$(DS_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(DS_VENV)/bin/pip install --quiet "deepspeed==0.19.8" || $(DS_VENV)/bin/pip install --quiet deepspeed

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
