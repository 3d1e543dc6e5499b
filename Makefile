# The README's commands. Each target sets up .venv first (torch pinned to 2.13.0, CPU build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo check-configs test test-gpu gpu-deps bench-gpu test-drills test-numerics test-interop lint bench bench-setup deepspeed-suite clean

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
	$(BIN)/python -m pytest -q -m "not drill" tests
	$(MAKE) --no-print-directory test-numerics

## test-drills: the fault-tolerance drill matrix (six drills x local/ssh/pdsh/slurm/openmpi runners on
## 3 loopback nodes, tests/integration/test_drill_matrix.py) and the single-node hung rank; each cell
## waits out timeouts or restarts (up to ~90 s), so outside `make test`
test-drills: $(STAMP)
	$(BIN)/python -m pytest -q -m drill tests

## test-gpu: the `cuda` tests (tests/gpu: ZeRO 0-3, fp16/bf16, offload, activation checkpointing, checkpoints,
## sparse attention, compression, data efficiency on one GPU with nccl). It runs with PYTHON_GPU's own torch
## (a CUDA build) and shardwise from src/, without the CPU venv: e.g. `make test-gpu PYTHON_GPU=python3` on a
## GPU machine (that interpreter needs pytest, pydantic, hjson, tqdm, numpy, xxhash; `make gpu-deps` puts the
## pure-Python ones for CPython GPU_PYVER in .gpu-deps/, which test-gpu adds to PYTHONPATH when present).
## Extra pytest flags through PYTEST_ADDOPTS (e.g. -rA, --junitxml=gpu.xml); SHARDWISE_GPU_REPORT=FILE appends each
## test's measured differences and peak memory to FILE as JSON lines. Fails at once if no GPU is visible.
PYTHON_GPU ?= $(BIN)/python
define GPU_PREFLIGHT
import importlib, sys, torch
missing = []
for name in ("pytest", "pydantic", "hjson", "tqdm", "numpy", "xxhash"):
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
if missing:
    sys.exit("make test-gpu: %s lacks %s; fix: make gpu-deps (GPU_DEPS_EXTRA=numpy if numpy is missing) where pip works, then bring .gpu-deps/ along" % (sys.executable, ", ".join(missing)))
print("make test-gpu: torch %s, CUDA %s, %s, python %s" % (torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), sys.version.split()[0]))
endef
export GPU_PREFLIGHT
GPU_PYVER ?= 3.12
test-gpu:
	@$(PYTHON_GPU) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
		echo "make test-gpu: no CUDA GPU is visible to $(PYTHON_GPU) (torch.cuda.is_available() is False)." >&2; \
		echo "  fix: run it on a machine with an NVIDIA GPU and a CUDA build of torch, e.g." >&2; \
		echo "  make test-gpu PYTHON_GPU=python3; without a GPU, SHARDWISE_GPU_TESTS_ON=cpu pytest -m cuda tests/gpu" >&2; \
		echo "  runs the same tests' logic on the CPU with gloo" >&2; exit 1; }
	@PYTHONPATH=src$(if $(wildcard .gpu-deps),:.gpu-deps)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON_GPU) -c "$$GPU_PREFLIGHT"
	OMP_NUM_THREADS=1 PYTHONPATH=src$(if $(wildcard .gpu-deps),:.gpu-deps)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PYTHON_GPU) -m pytest -q -m cuda -p no:cacheprovider tests/gpu

## gpu-deps: shardwise's and pytest's pure-Python dependencies (and pydantic-core, numpy, xxhash wheels) for
## CPython GPU_PYVER in .gpu-deps/, for a GPU machine without network whose python has torch but not these
## (numpy is expected beside that torch; GPU_DEPS_EXTRA=numpy adds it)
GPU_DEPS_EXTRA ?=
gpu-deps: $(STAMP)
	rm -rf .gpu-deps
	$(BIN)/pip install --quiet --target .gpu-deps --no-deps --no-compile --only-binary=:all: --python-version $(GPU_PYVER) \
		--implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		pytest pluggy iniconfig packaging pygments pydantic pydantic-core annotated-types typing-extensions \
		typing-inspection hjson tqdm xxhash $(GPU_DEPS_EXTRA)
	find .gpu-deps -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +

test-numerics: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m numeric tests
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m numeric tests

## bench: the engine-core benchmark, side by side with DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed
bench: $(STAMP)
	$(BIN)/python benchmarks/engine_core.py --out bench-results.json

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

## bench-gpu: the GPU benchmark (benchmarks/gpu_bench.py: a 1.3B GPT at ZeRO 2 / 3 / 3 + CPU offload,
## shardwise vs FSDP2 vs DeepSpeed, world size 1) with PYTHON_GPU's own CUDA torch; BENCH_GPU_ARGS: its flags
## (e.g. --deepspeed-path DIR, --largest 4b 6.7b, --out gpu-bench.json)
BENCH_GPU_ARGS ?=
bench-gpu:
	PYTHONPATH=src$(if $(wildcard .gpu-deps),:.gpu-deps)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PYTHON_GPU) benchmarks/gpu_bench.py $(BENCH_GPU_ARGS)

## bench-setup: a separate venv with DeepSpeed, the engine-core benchmark's peer (never imported by src/)
DS_VENV := .venv-ds
bench-setup:
	test -x $(DS_VENV)/bin/python || $(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/pip install --quiet --upgrade pip
	$(DS_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(DS_VENV)/bin/pip install --quiet "deepspeed==0.19.8" || $(DS_VENV)/bin/pip install --quiet deepspeed

## test-interop: universal checkpoints between real DeepSpeed 0.19.8 and shardwise, both directions, over
## {stage 0-3} x {fp32, bf16} x {AdamW, Muon} x {1:1 2:2 2:1 3:3 2:3 3:2 3:1 save:resume ranks}
## (outside `make test`, which never needs DeepSpeed; about an hour on 2 busy cores: narrow it).
## DS_PYTHON: an interpreter with DeepSpeed 0.19.8 (default: .venv-ds, created as bench-setup does);
## INTEROP_ARGS: extra driver flags (see --help): --stages, --dtypes, --optimizers, --worlds SAVE:RESUME...,
## --writers deepspeed|shardwise, --json FILE; e.g. "--stages 2 --dtypes fp32 --optimizers Muon --worlds 3:2".
## Then DeepSpeed's per-expert MoE checkpoint files both ways (benchmarks/moe_checkpoint_interop.py, 14 bitwise
## checks; DS_TESTS=<DeepSpeed checkout>/tests adds its AutoEP test model).
DS_PYTHON ?=
INTEROP_ARGS ?=
test-interop: $(STAMP)
	$(if $(DS_PYTHON),,$(MAKE) --no-print-directory bench-setup)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/universal_interop.py \
		--ds-python "$(if $(DS_PYTHON),$(DS_PYTHON),$(DS_VENV)/bin/python)" $(INTEROP_ARGS)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/moe_checkpoint_interop.py \
		--ds-python "$(if $(DS_PYTHON),$(DS_PYTHON),$(DS_VENV)/bin/python)" $(if $(DS_TESTS),--ds-tests "$(DS_TESTS)")

## deepspeed-suite: DeepSpeed's own unit tests against shardwise's `deepspeed` package, a per-file table.
## DS_TESTS: a DeepSpeed checkout's tests/ directory, kept outside this repository (required);
## DS_CONTROL: an interpreter with real DeepSpeed 0.19.8 and pytest<8.4/pytest-forked/pytest-timeout (optional,
## adds the control column); DS_FILES: files under tests/unit (default: issue 38's 27); DS_TIMEOUT: per test.
DS_TESTS ?=
DS_CONTROL ?=
DS_FILES ?=
DS_TIMEOUT ?= 600
deepspeed-suite: $(STAMP)
	@test -n "$(DS_TESTS)" || { echo "usage: make deepspeed-suite DS_TESTS=/path/to/DeepSpeed/tests [DS_CONTROL=/venv/bin/python]"; exit 2; }
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/deepspeed_suite.py --ds-tests "$(DS_TESTS)" --timeout $(DS_TIMEOUT) \
		$(if $(DS_CONTROL),--control-python "$(DS_CONTROL)") $(if $(DS_FILES),--files $(DS_FILES))

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
