# The two front-door commands: `make up` (bring Sluice up, run a demo request) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test lint clean

up: $(VENV)/.installed
	$(BIN)/sluice up

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check .

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) .sluice
