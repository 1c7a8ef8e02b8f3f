# Each target sets up its own virtual env on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make test-torch TORCH=2.14.1`: the torch-sensitive tests on another torch, in a venv of its own.
TORCH ?= 2.14.1
TVENV := .venv-torch-$(TORCH)
TSTAMP := $(TVENV)/.installed
TORCH_SENSITIVE := tests/test_compile.py tests/test_rank_random.py tests/test_random.py \
	tests/test_checkpoint.py tests/test_checkpoint_gloo.py tests/test_parallel.py \
	tests/test_resume.py tests/test_transformers.py tests/test_torch_hooks.py tests/test_default_generator.py

.PHONY: demo test test-torch bench verify clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardops demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=600

$(TSTAMP): pyproject.toml constraints.txt
	test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)
	grep -v '^torch==' constraints.txt > $(TVENV)/constraints.txt
	$(TVENV)/bin/pip install -q -c $(TVENV)/constraints.txt 'torch==$(TORCH)' -e '.[dev,cli]'
	touch $(TSTAMP)

test-torch: $(TSTAMP)
	$(TVENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	$(TVENV)/bin/python -m pytest -q -x --timeout=600 $(wildcard $(TORCH_SENSITIVE))

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli,plot]'
	$(BIN)/python -m benchmarks.run --quick

verify: $(STAMP)
	$(BIN)/shardops verify

clean:
	rm -rf $(VENV) .venv-torch-*
