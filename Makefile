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

# Recording venv (torch + transformers) for tests/fixtures/references/record.py; the tests only
# read what it wrote. LLAMA_CPP_SRC / LLAMA_CPP_BIN point it at llama.cpp's converter / tools.
REF_VENV := .venv-ref

.PHONY: install aot demo test test-slow test-all lint format bench clean references

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

references: $(STAMP)
	test -x $(REF_VENV)/bin/python || python3 -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install -q -e '.[references]'
	$(REF_VENV)/bin/python tests/fixtures/references/record.py

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .ruff_cache .mypy_cache
