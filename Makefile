# One-command setup on a fresh machine. torch==$(TORCH_VERSION) is installed first, so
# that no dependency resolves an unpinned torch, and from PyTorch's own index for the
# build TORCH_BUILD names:
#   TORCH_BUILD=cpu     (the default) the CPU build, about 200 MB
#   TORCH_BUILD=cu128   a CUDA build (cu126, cu128, ...): several GB of NVIDIA libraries
#   TORCH_BUILD=pypi    the package index's torch: on Linux x86-64 that is a CUDA build
# Where PyTorch's index cannot be reached (a machine that reaches only the package
# index, as CI's), the package index's torch, with a note saying so.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_BUILD ?= cpu
TORCH_INDEX := https://download.pytorch.org/whl/$(TORCH_BUILD)

# $(call install_torch,<python>): torch as TORCH_BUILD says, into that python's env.
define install_torch
	@if [ "$(TORCH_BUILD)" = pypi ]; then \
		echo "installing torch $(TORCH_VERSION) from the package index"; \
		$(1) -m pip install -q torch==$(TORCH_VERSION); \
	else \
		echo "installing torch $(TORCH_VERSION), the $(TORCH_BUILD) build, from $(TORCH_INDEX)"; \
		$(1) -m pip install -q --retries 1 --timeout 30 --index-url $(TORCH_INDEX) \
			torch==$(TORCH_VERSION) || \
		{ echo "note: $(TORCH_INDEX) did not serve torch $(TORCH_VERSION): installing the package index's (on Linux x86-64, a CUDA build of several GB)"; \
		$(1) -m pip install -q torch==$(TORCH_VERSION); }; \
	fi
endef

.PHONY: install install-demo demo test test-full opinfo-full bench bench-quick lint fuzz docs site-check dist wheel-check newest-torch figures graphviz

# What the demo needs: torch, dynajax (jax with it) and transformers.
$(VENV)/.installed-demo:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(call install_torch,$(PY))
	$(PIP) install -q -e ".[hf]"
	touch $@

# Everything the tests, linters, docs and benchmarks use.
$(VENV)/.installed: pyproject.toml $(VENV)/.installed-demo
	$(PIP) install -q -e ".[test,viz,bench,lint,docs,hf,release]"
	touch $@

install: $(VENV)/.installed

install-demo: $(VENV)/.installed-demo

# Graphviz's `dot` renders Report.save_svg(): installed with apt-get where it can be (CI
# runs this; `make test` does not change the system), best effort; the test that renders
# an SVG says why it is skipped when `dot` is missing.
graphviz:
	@command -v dot >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -q graphviz || (apt-get update -q && apt-get install -y -q graphviz)) \
		>/dev/null 2>&1) || \
		echo "note: graphviz not installed; Report.save_svg() needs its 'dot' program"

demo: install-demo
	$(PY) examples/demo.py

# The suite in TEST_WORKERS processes (pytest-xdist; 2 by default, the cores CI has),
# printing its 30 slowest tests (CI has 90 minutes for all of .ci/run).
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=30 tests

# Every OpInfo sample (long; not run in CI).
opinfo-full: install
	$(PY) -m tests.opinfo_full

bench: install
	$(PY) -m benchmarks.run

bench-quick: install
	$(PY) -m benchmarks.run --quick

# Differential fuzzing against eager (long; CI runs 100 programs in tests/test_fuzz.py).
# Reproducers of new failures go to fuzz_failures/.
fuzz: install
	$(PY) -m fuzz --seed 0 --minutes 30

# Style (ruff) and types (mypy over dynajax/, which ships py.typed); CI runs it.
lint: install
	$(PY) -m ruff check dynajax tests benchmarks examples fuzz
	$(PY) -m ruff format --check dynajax tests benchmarks examples fuzz
	$(PY) -m mypy

# The user guide (docs/, mkdocs.yml) into site/; --strict: a warning or a broken link fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The built guide in headless Chromium, every page at 1280 px and 390 px: a table, figure
# or code block that does not fit fails (tests/site_check.py; SHOTS=dir saves screenshots).
# Installs Debian's chromium and chromium-driver where they are missing (as root; it says so).
site-check: docs
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
		echo "site-check: installing Debian's chromium and chromium-driver (apt-get)"; \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null); }
	$(PY) tests/site_check.py site $(if $(SHOTS),--shots $(SHOTS))

# The wheel and sdist, built as a release would be (python -m build) and checked
# (twine check --strict: metadata, README rendering).
dist: install
	rm -rf dist
	$(PY) -m build --sdist --wheel --outdir dist .
	$(PY) -m twine check --strict dist/*

# The wheel as a user's `pip install` gets it: a fresh venv (torch first, as above),
# not editable, then the demo and a smoke test run from outside the checkout.
WHEEL_VENV ?= /tmp/dynajax-wheel-venv
wheel-check: dist
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(call install_torch,$(WHEEL_VENV)/bin/python)
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls dist/dynajax-*.whl)[hf,checkpoint]"
	cd /tmp && $(WHEEL_VENV)/bin/python $(CURDIR)/tests/smoke_installed.py
	cd /tmp && $(WHEEL_VENV)/bin/python $(CURDIR)/examples/demo.py

# The newest torch and jax the registry serves (not the pinned build above), in a fresh
# venv, with a smoke subset of the suite: the README's code, train_step, and
# jax_function under jax.grad. PIP_CONFIG_FILE=/dev/null: no pip configuration caps
# the release (on this project's machines one caps torch at what lies on disk). A
# user on the newest torch must not be the first to find a break; CI runs it.
NEWEST_VENV ?= /tmp/dynajax-newest-venv
NEWEST_PIP := PIP_CONFIG_FILE=/dev/null $(NEWEST_VENV)/bin/python -m pip
NEWEST_TESTS ?= "tests/test_docs.py::test_code_blocks_run[README.md]" \
	tests/training/test_train_step.py::test_twenty_steps_are_eagers \
	"tests/training/test_train_step.py::test_transformers_models_train_as_in_eager[gpt2-adam]" \
	tests/interop/test_jax_function.py::test_model_outputs_and_gradients_match_eager
newest-torch:
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) install -q --upgrade pip
	$(NEWEST_PIP) install -q --upgrade torch jax
	$(NEWEST_PIP) install -q -e ".[test]"
	$(NEWEST_VENV)/bin/python -c "import torch, jax; print('newest: torch', torch.__version__, 'jax', jax.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $(NEWEST_TESTS)

# The guide's measured tables and plots, redrawn from their JSON (benchmarks/figures.py);
# tests/test_figures.py fails where they differ.
figures: install
	$(PY) -m benchmarks.figures
