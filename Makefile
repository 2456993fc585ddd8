# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
VLLM_VENV := .venv-vllm
FOCUS_VENV := .venv-focus

.PHONY: demo test lint typecheck unit vllm-venv focus-venv system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

## demo: install, then run the platform on its embedded defaults (simulated fleet + traffic)
demo: $(STAMP)
	$(BIN)/infermeter demo

## test: install everything the tests need, then lint, type-check and run every test
test: $(STAMP) system-deps vllm-venv focus-venv lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy .

unit: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

## system-deps: Debian packages the tests use for real (promtool, Prometheus)
system-deps:
	bash scripts/system-deps.sh

## vllm-venv: real vLLM (CPU build) in its own venv, for the conformance tests
vllm-venv:
	bash scripts/vllm-venv.sh $(VLLM_VENV)

## focus-venv: the FinOps FOCUS reference validator in its own venv, for the export tests
focus-venv:
	bash scripts/focus-venv.sh $(FOCUS_VENV)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FOCUS_VENV) .cache .mypy_cache .ruff_cache .pytest_cache
