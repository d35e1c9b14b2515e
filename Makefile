# One command per guardrail. `make test` and `make sample` set up .venv first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SAMPLE_STAMP := $(VENV)/.installed-sample

comma := ,
.PHONY: check-pypi lock setup lint typecheck pytest test test-quick durations sample dashboard schema bench clean gpu-check

LOCK := requirements-lock.txt
SAMPLE_LOCK := requirements-sample-lock.txt
# every extra, so the tests run against the real Lightning, transformers, trackers and HTA
EXTRAS := torch,dashboard,dev,lightning,transformers,trackers,hta

# the editable install's build prints setuptools' notes on editable mode: informational, silenced
INSTALL_SELF := PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps -e .

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# everything the tests use: every package at the version the lock names (torch is the CPU build: an
# unpinned torch pulls several GB of CUDA packages), then perfscope itself with nothing more
$(STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PY) -m pip install -q -r $(LOCK)
	$(INSTALL_SELF)
	touch $(STAMP) $(SAMPLE_STAMP)

# the sample needs the analysis and the report only: no torch, no frameworks, no trackers (the
# sample lock takes its versions from the full lock, so a later `make test` installs only the rest)
$(SAMPLE_STAMP): pyproject.toml $(SAMPLE_LOCK) | $(PY)
	$(PY) -m pip install -q -r $(SAMPLE_LOCK)
	$(INSTALL_SELF)
	touch $(SAMPLE_STAMP)

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

# a developer's quick answer: lint, types and every test that launches no job, process or browser
# and took under a second when last measured (tests/durations.py)
test-quick: lint typecheck
	$(PY) -m pytest -q -m "not slow"

# measure every test's time again (the whole suite) and fold it into tests/durations.json: on purpose,
# on a machine as loaded as usual, then commit the file
durations: setup
	mkdir -p artifacts
	$(PY) -m pytest -q --junitxml=artifacts/durations.xml
	$(PY) tests/durations.py update artifacts/durations.xml

# both locks resolved against PyPI alone (no local wheels, no other index, no pip configuration), as on
# a user's machine: a dry run, nothing installed (it downloads the wheels' metadata, torch's several GB
# of CUDA packages among them)
check-pypi: | $(PY)
	cd /tmp && for lock in $(CURDIR)/$(LOCK) $(CURDIR)/$(SAMPLE_LOCK); do \
		$(CURDIR)/$(PY) -m pip install --isolated --no-cache-dir --dry-run --ignore-installed -q \
			--index-url https://pypi.org/simple -r $$lock || exit 1; done

# the main job on the bundled sample data
sample: $(SAMPLE_STAMP)
	mkdir -p artifacts
	$(VENV)/bin/perfscope analyze sample_traces/seed-study
	$(VENV)/bin/perfscope analyze sample_traces/demo-cpu
	$(VENV)/bin/perfscope report sample_traces/seed-study -o artifacts/sample-report.html

# the sample study in the browser (adds the dashboard's packages at the full lock's versions)
dashboard: $(SAMPLE_STAMP)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -c $(LOCK) -e '.[dashboard]'
	$(VENV)/bin/perfscope dashboard sample_traces/seed-study

# refresh the lock on purpose: after changing a dependency in pyproject.toml, or to take new releases
lock: setup
	# perfscope names itself through the dashboard extra: never pinned, installed editable above
	CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile -q --strip-extras --no-emit-find-links --no-emit-index-url --unsafe-package perfscope --unsafe-package pip \
		$(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) -c constraints-cpu.txt -o $(LOCK) pyproject.toml
	# a local CPU wheel (torch==X+cpu) is not on PyPI: pin the version, which the CPU build satisfies too
	sed -i 's/^torch==\(.*\)+cpu$$/torch==\1/' $(LOCK)
	# the sample's install set, at the full lock's versions
	CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile -q --strip-extras --no-emit-find-links --no-emit-index-url --unsafe-package perfscope --unsafe-package pip \
		--extra report -c $(LOCK) -o $(SAMPLE_LOCK) pyproject.toml

schema: setup
	$(PY) -m perfscope.store.schema > docs/schema.md

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
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# the check for the first GPU: at most 5 minutes on one GPU (a CUDA build of torch in .venv), a verdict
# per check on the terminal, the JSON summary in artifacts/gpu-check.json; no GPU: every check skipped
gpu-check: setup
	$(PY) benchmarks/gpu_check.py --json artifacts/gpu-check.json
