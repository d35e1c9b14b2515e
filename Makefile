# One command per guardrail. `make test` and `make sample` set up .venv first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

comma := ,
.PHONY: lock setup lint typecheck pytest test sample schema bench clean

LOCK := requirements-lock.txt
# every extra, so the tests run against the real Lightning, transformers, trackers and HTA
EXTRAS := torch,dashboard,dev,lightning,transformers,trackers,hta

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# every package at the version the lock names (torch is the CPU build: an unpinned torch pulls
	# several GB of CUDA packages), then perfscope itself with nothing more
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy

pytest: setup
	$(PY) -m pytest -q

# the test command: lint, types, then the whole suite
test: lint typecheck pytest

# the main job on the bundled sample data
sample: setup
	$(VENV)/bin/perfscope analyze sample_traces/seed-study
	$(VENV)/bin/perfscope analyze sample_traces/demo-cpu
	$(VENV)/bin/perfscope report sample_traces/seed-study -o artifacts/sample-report.html

# refresh the lock on purpose: after changing a dependency in pyproject.toml, or to take new releases
lock: setup
	# perfscope names itself through the dashboard extra: never pinned, installed editable above
	CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile -q --strip-extras --no-emit-find-links --no-emit-index-url --unsafe-package perfscope --unsafe-package pip \
		$(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) -c constraints-cpu.txt -o $(LOCK) pyproject.toml

schema: setup
	$(PY) -m perfscope.schema > docs/schema.md

# each prints a Markdown table; BENCHMARKS.md holds the figures and how they were measured
bench: setup
	$(PY) benchmarks/writer.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/analysis.py
	$(PY) benchmarks/report.py
	$(PY) benchmarks/dashboard.py
	$(PY) benchmarks/first_segment.py
	$(PY) benchmarks/store_listing.py
	$(PY) benchmarks/dist_recorder.py
	$(PY) benchmarks/import.py
	$(PY) benchmarks/import_formats.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
