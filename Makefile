# The two entry points of the README. Both set up what they need first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test run test reliability clean

setup:
	@sh packaging/setup.sh

setup-test:
	@sh packaging/setup.sh --test

# The daemon in the foreground on a default config, state under ./var/.
run: setup
	$(VENV)/bin/flamed daemon --config packaging/flamed.dev.toml

# Type checking first (pyproject's [tool.mypy]: strict on flamed/; an error fails
# the target), then the whole test suite in two runs: the tests that may share the
# machine (marked concurrent: tests/unit, tests/fuzz, the offline toolkit, the
# fake-sampler daemons) on three workers (on two cores: a third keeps the CPUs busy
# while a daemon test waits), then the rest (BPF, daemons sampling the host) one at
# a time (tests/conftest.py). Exit 5 (no tests collected) counts as failure.
test: setup-test
	$(PY) -m mypy --strict flamed/
	$(PY) -m pytest -q -n 3 -m "not serial" --durations=10 $(PYTEST_ARGS)
	$(PY) -m pytest -q -m serial --durations=30 $(PYTEST_ARGS)

# docs/reliability.md's figures: the fault and security suite at the issue's scale
# (20 kills, 1,000 churn processes, every capability), then 100,000 fuzz inputs per parser.
reliability: setup-test
	FLAMED_FAULT_SCALE=1 $(PY) -m pytest -q -rxXfs tests/faults tests/fuzz $(PYTEST_ARGS)
	$(PY) bench/fuzz.py -n 100000 -j 2

clean:
	rm -rf $(VENV) var build *.egg-info tests/.node
