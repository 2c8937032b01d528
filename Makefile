# The two entry points of the README. Both set up what they need first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test run test clean

setup:
	@sh packaging/setup.sh

setup-test:
	@sh packaging/setup.sh --test

# The daemon in the foreground on a default config, state under ./var/.
run: setup
	$(VENV)/bin/flamed daemon --config packaging/flamed.dev.toml

# The whole test suite. Exit 5 (no tests collected) counts as failure.
test: setup-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var build *.egg-info
