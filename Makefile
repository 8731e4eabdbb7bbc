# Two commands on a fresh machine: `make demo` and `make test`. Both create the venv once.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Tests are dominated by single-threaded XLA compilation: one worker per core, whole files per
# worker so module fixtures (models, compiled engines) are built once.
PYTEST := $(PY) -m pytest -n auto --dist loadfile

.PHONY: install demo test test-slow test-all lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specjax generate --config configs/demo.yaml

test: $(STAMP)
	$(PYTEST) -q --durations=20

test-slow: $(STAMP)
	$(PYTEST) -q -m slow

test-all: $(STAMP)
	$(PYTEST) -q -m 'slow or not slow'

lint: $(STAMP)
	$(VENV)/bin/ruff format --check specjax tests benchmarks
	$(VENV)/bin/ruff check specjax tests benchmarks
	$(VENV)/bin/mypy specjax

format: $(STAMP)
	$(VENV)/bin/ruff format specjax tests benchmarks
	$(VENV)/bin/ruff check --fix specjax tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/speculative.py --overwrite

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
