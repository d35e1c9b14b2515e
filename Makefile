PY ?= .venv/bin/python

.PHONY: setup lint typecheck test check schema bench

setup:
	python3 -m venv .venv
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[torch,dashboard,dev]'

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck:
	$(PY) -m mypy

test:
	$(PY) -m pytest -q

check: lint typecheck test

schema:
	$(PY) -m perfscope.schema > docs/schema.md
