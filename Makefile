# make run   - install into .venv (first time) and run the default experiment through `flwr run`
# make lint  - ruff check, ruff format --check, mypy, lint-imports (the import contracts; settings in pyproject.toml), dead code
# make deadcode - dead code found by vulture (scripts/dead_code.py: the registries and framework-called names whitelisted)
# make test  - install into .venv (first time), then the test suite on TEST_WORKERS pytest-xdist workers with the lint
#              beside it
#              (ARGS="-n 0" runs it in one process; ARGS="tests/test_x.py" runs one file)
# make test-fast - the edit loop: the suite less the tests marked heavy, raycluster or netns, the lint beside it
#              (<= 3 min)
# make mutate - mutation testing: the named mutations of #10, then mutmut over the maths (docs/development.md)
# make docs  - regenerate the reference pages, then build the site into site/ (offline; open site/index.html)
# make docs-reference - regenerate docs/reference/ from the code (config, CLI, strategy params, bench figures)
# make docs-serve - the site at http://127.0.0.1:8000 while you edit
VENV    ?= .venv
PYTHON  ?= python3
CONFIG  ?= configs/default.yaml
ARGS    ?=
TEST_WORKERS ?= 3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.fedapps-installed

.PHONY: run lint deadcode test test-fast bench mutate docs docs-reference docs-serve clean-results

# pip compiles every installed module (~35 of the ~90 s): keep it. Where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) nothing writes a .pyc later, so every process of the suite (each Ray actor, each `flwr run` process) would
# compile torch from source again; `make test` compiles the project's own modules for the same reason.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/fedapps run $(CONFIG) --output-dir $(CURDIR)/results $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) scripts/dead_code.py

deadcode: $(STAMP)
	$(PY) scripts/dead_code.py

# tests dealt to the workers a few at a time in collection order (heavy first), except that the tests sharing a module- or
# session-scoped fixture go to one worker together (tests/conftest.py marks them xdist_group): it is built once
DIST    := --dist loadgroup --no-loadscope-reorder

COMPILE := $(PY) -m compileall -q fedapps strategies fedapps_tools server_app.py client_app.py

# the suite on TEST_WORKERS workers with `make lint` beside it (its ~40 s, most of it mypy on one core, fill what the
# suite's waits leave of the cores); its output follows the tests', and either failing fails the target
LINT_LOG := $(VENV)/lint.log

define TESTS_WITH_LINT
	$(COMPILE)
	@$(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(DIST) $(1) $(ARGS); tests=$$?; \
	if wait $$lint; then echo "make lint: passed (its output: $(LINT_LOG))"; \
	else cat $(LINT_LOG); echo "make lint: FAILED (its output above)"; exit 1; fi; \
	exit $$tests
endef

test: $(STAMP)
	$(call TESTS_WITH_LINT,)

FAST    := not heavy and not raycluster and not netns

test-fast: $(STAMP)
	$(call TESTS_WITH_LINT,-m "$(FAST)")

docs-reference: $(STAMP)
	$(PY) -m fedapps_tools.docgen

docs: docs-reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: docs-reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

mutate: $(STAMP)
	$(PY) -m pip install -q -e ".[test,mutate]"
	OMP_NUM_THREADS=1 $(PY) scripts/named_mutations.py
	OMP_NUM_THREADS=1 $(PY) scripts/mutate.py $(ARGS)

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-results:
	rm -rf results
