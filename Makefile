# Two commands do all the set-up on a fresh machine with Python >= 3.10 and pip:
#   make demo    plans a collective on a shipped topology and runs it under mpiexec
#   make test    runs the whole test suite
# Both create .venv and install ddl with its test extras into it the first time.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: demo test clean
.DEFAULT_GOAL := demo

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bf16]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

# Two pytest workers: most tests plan on one core, and the second keeps the other busy.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) build *.egg-info
