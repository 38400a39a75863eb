PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two installs, each with its own stamp: the package alone (what `make demo` needs) and the dev
# extras on top of it (the tests, the docs build, the benches' test-side peers).
STAMP     := $(VENV)/.installed
STAMP_DEV := $(VENV)/.installed-dev
INPUTS := pyproject.toml setup.py constraints.txt $(wildcard src/fireflyer/hfreduce/_core/*.[ch]) \
          src/fireflyer/hfreduce/backend/door.cpp

.PHONY: demo test test-heavy bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# hfreduce's C++ door is compiled here, against the torch just installed (a failed build leaves the Python door).
$(STAMP): $(BIN)/python $(INPUTS)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	-$(BIN)/python -c 'import sys; from fireflyer.hfreduce.backend import cpp_door; sys.exit(cpp_door.main([]))'
	touch $(STAMP)

# Builds on the package's install, so `make demo` then `make test` downloads torch and the rest once.
$(STAMP_DEV): $(STAMP) $(INPUTS)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP_DEV)

demo: $(STAMP)
	$(BIN)/fireflyer demo

# The suite, less the tests marked heavy (whole jobs run many times over); test-heavy runs those; .ci/run runs both.
# Test files run side by side on WORKERS processes (pytest-xdist), a file's tests in one of them, in order; much of
# the suite waits (for a timeout to pass, a daemon to poll, a peer to be named dead), so two workers fill two cores.
WORKERS ?= 2
test: $(STAMP_DEV)
	$(BIN)/python -m pytest -q -m "not heavy" -n $(WORKERS) --dist loadfile --durations=30

test-heavy: $(STAMP_DEV)
	$(BIN)/python -m pytest -q -m heavy -n $(WORKERS) --dist loadfile --durations=15

bench: $(STAMP_DEV)
	$(BIN)/fireflyer bench allreduce
	$(BIN)/fireflyer bench ddp
	$(BIN)/fireflyer bench fsdp
	$(BIN)/fireflyer bench pp

clean:
	rm -rf $(VENV) build src/*.egg-info src/fireflyer/hfreduce/_core.*.so src/fireflyer/hfreduce/backend/_door
