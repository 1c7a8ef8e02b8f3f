# Each target sets up its own virtual env on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench verify clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardops demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=600

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,cli,plot]'
	$(BIN)/python -m benchmarks.run --quick

verify: $(STAMP)
	$(BIN)/shardops verify

clean:
	rm -rf $(VENV)
