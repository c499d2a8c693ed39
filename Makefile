# Two commands on a fresh machine (see README):
#   make run       set up .venv and train the tiny SDXL model on the built-in demo set (CPU)
#   make test      set up .venv and run the fast tier (tests not marked slow)
#   make test-all  every test, with the 50 slowest listed (what CI runs: .ci/run)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch; a bare `torch` would pull a multi-GB CUDA build. GPU users:
# `make setup TORCH=` keeps the torch already in the venv (create it with your CUDA torch first).
TORCH  ?= torch==2.13.0
ARGS   ?=
# pytest-xdist workers: one per core of the 2-core CI machine; a module's tests stay on one worker so its
# shared fixtures (full-size plans, tiny pipelines) are built once. JOBS=0 runs in one process.
JOBS   ?= 2
XDIST  := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

.PHONY: setup run test test-all plan clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q $(TORCH))
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: setup
	$(BIN)/python -m runner +preset=sdxl_24gb $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(ARGS)

test-all: setup
	$(BIN)/python -m pytest -q --durations=50 $(XDIST) $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
