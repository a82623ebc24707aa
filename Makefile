# `make demo` and `make test` each create or refresh .venv and run; nothing else is needed on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/char_lm.py --mesh 2x2 --virtual

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -x tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
