# Two commands on a fresh machine: `make demo` and `make test`. Both create the venv once.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Deviceless TPU / GPU compilers (specjax/aot.py, benchmarks/accelerators.py,
# tests/test_accelerators.py) in a venv of their own: beside the CPU venv's jax, libtpu and the
# CUDA plugin print a CUDA traceback and libtpu warnings at every start. ~2 GB, ~30 s of pip.
AOT_VENV  := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed-stamp
# Tests are dominated by single-threaded XLA compilation: one worker per core, whole files per
# worker so module fixtures (models, compiled engines) are built once.
PYTEST := $(PY) -m pytest -n auto --dist loadfile

.PHONY: install aot demo test test-slow test-all lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(AOT_STAMP): pyproject.toml $(STAMP)
	test -x $(AOT_VENV)/bin/python || python3 -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/python -m pip install -q --upgrade pip
	$(AOT_VENV)/bin/python -m pip install -q -e . \
	  "jax[cuda12-local,tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')" \
	  nvidia-cuda-nvcc-cu12
	touch $(AOT_STAMP)

# the tests skip (saying why) where this install cannot happen
aot: $(STAMP)
	$(MAKE) $(AOT_STAMP) || echo "make aot: deviceless compilers not installed; their tests skip"

demo: $(STAMP)
	$(VENV)/bin/specjax generate --config configs/demo.yaml

test: $(STAMP) aot
	$(PYTEST) -q --durations=20

test-slow: $(STAMP) aot
	$(PYTEST) -q -m slow

test-all: $(STAMP) aot
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
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .ruff_cache .mypy_cache
