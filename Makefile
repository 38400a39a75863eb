PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt $(wildcard src/fireflyer/hfreduce/_core/*.[ch])
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fireflyer demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/fireflyer bench allreduce
	$(BIN)/fireflyer bench ddp
	$(BIN)/fireflyer bench fsdp
	$(BIN)/fireflyer bench pp

clean:
	rm -rf $(VENV) build src/*.egg-info src/fireflyer/hfreduce/_core.*.so
