# make run   - install into .venv (first time) and run the default experiment through `flwr run`
# make test  - install into .venv (first time) and run the test suite on TEST_WORKERS pytest-xdist workers
#              (ARGS="-n 0" runs it in one process; ARGS="tests/test_x.py" runs one file)
# make mutate - mutation testing: the named mutations of #10, then mutmut over the maths (README "Tests and benchmarks")
VENV    ?= .venv
PYTHON  ?= python3
CONFIG  ?= configs/default.yaml
ARGS    ?=
TEST_WORKERS ?= 2
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.fedapps-installed

.PHONY: run test bench mutate clean-results

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/fedapps run $(CONFIG) --output-dir $(CURDIR)/results $(ARGS)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 $(ARGS)

mutate: $(STAMP)
	$(PY) -m pip install -q -e ".[test,mutate]"
	OMP_NUM_THREADS=1 $(PY) scripts/named_mutations.py
	OMP_NUM_THREADS=1 $(PY) scripts/mutate.py $(ARGS)

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-results:
	rm -rf results
