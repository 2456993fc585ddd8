# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Every package of the venv, pinned with its hashes: pyproject.toml's dependencies, the dev extra
# and the build backend, resolved for CPython 3.11 on Linux x86_64. `make lock` regenerates it.
LOCK := requirements.lock
# The container image's packages only (no dev extra), pinned with hashes, resolved the same way.
IMAGE_LOCK := requirements-image.lock
VLLM_VENV := .venv-vllm
FOCUS_VENV := .venv-focus

.PHONY: demo test lint typecheck unit lock vllm-venv focus-venv system-deps clean

# The lock holds the build backend too, so the project itself installs with no unhashed download.
$(STAMP): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

## lock: resolve pyproject.toml (dependencies, dev extra, build backend) into $(LOCK) with hashes,
## and its dependencies alone into $(IMAGE_LOCK) for the image, from the same pins;
## existing pins are kept unless LOCK_ARGS=--upgrade (or --upgrade-package NAME)
lock: $(STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe \
		--strip-extras --extra dev --build-deps-for editable --no-emit-index-url --no-emit-find-links \
		$(LOCK_ARGS) --output-file $(LOCK) pyproject.toml
	cp $(LOCK) $(IMAGE_LOCK)
	CUSTOM_COMPILE_COMMAND="make lock" $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe \
		--strip-extras --build-deps-for wheel --no-emit-index-url --no-emit-find-links \
		--output-file $(IMAGE_LOCK) pyproject.toml

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

## system-deps: Debian packages the tests use for real (promtool, Prometheus, chromium, redis-server)
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
