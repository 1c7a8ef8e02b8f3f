# Each target sets up its own virtual env on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make test-torch TORCH=2.14.1`: the torch-sensitive tests on another torch, in a venv of its own.
TORCH ?= 2.14.1
TVENV := .venv-torch-$(TORCH)
TSTAMP := $(TVENV)/.installed
TORCH_SENSITIVE := tests/test_compile.py tests/test_compile_models.py tests/test_rank_random.py tests/test_random.py \
	tests/test_checkpoint.py tests/test_checkpoint_gloo.py tests/test_parallel.py \
	tests/test_resume.py tests/test_transformers.py tests/test_torch_hooks.py tests/test_default_generator.py

.PHONY: demo lint test test-torch test-gpu gpu-check bench verify clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardops demo

# Two workers, a test file each at a time (pytest-xdist): CI's 2 cores both busy, a file's tests in one process.
test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=600 -n 2 --dist loadfile

# Lint, format and type check (CI runs it first): pinned tools, so findings do not move under us.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

$(TSTAMP): pyproject.toml constraints.txt
	test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)
	grep -v '^torch==' constraints.txt > $(TVENV)/constraints.txt
	$(TVENV)/bin/pip install -q -c $(TVENV)/constraints.txt 'torch==$(TORCH)' -e '.[dev,cli]'
	touch $(TSTAMP)

test-torch: $(TSTAMP)
	$(TVENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	$(TVENV)/bin/python -m pytest -q -x --timeout=600 -n 2 --dist loadfile $(wildcard $(TORCH_SENSITIVE))

# `make test-gpu`: the device-sensitive tests (tests/test_gpu.py: threads world and nccl) and the
# ops demo on CUDA tensors, in both worlds. Fails, saying why, on a machine without a CUDA device.
GPUS = $(shell $(BIN)/python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)

gpu-check:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) tests/gpu_check.py

test-gpu: gpu-check $(STAMP)
	$(BIN)/python tests/gpu_check.py
	SHARDOPS_TEST_DEVICE=cuda $(BIN)/python -m pytest -q -x --timeout=600 -m gpu tests/test_gpu.py
	$(BIN)/shardops demo --ops --device cuda
	$(if $(filter-out 0 1,$(GPUS)),$(BIN)/torchrun --nproc-per-node $(GPUS) -m shardops.demo --ops --device cuda,@echo "one GPU: the demo under torchrun (nccl) needs 2 or more")

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli,plot]'
	$(BIN)/python -m benchmarks.run --quick

verify: $(STAMP)
	$(BIN)/shardops verify

clean:
	rm -rf $(VENV) .venv-torch-*
