# Two commands for a new user: `make demo` and `make test`. Both create .venv on first use.
# `make demo` runs `memfit demo`, the command line pip installs with the package. `make test`
# runs the linters (`make lint`: ruff check, ruff format --check, mypy on src/) and then the suite,
# which includes the examples inside HF Trainer, peft, accelerate and Lightning (the
# `integrations` extra, installed with the venv).
#
# torch is installed first and explicitly: on a machine without a GPU, an unpinned `torch`
# requirement would pull several GB of CUDA wheels. TORCH_SPEC picks the build; the default is
# the CPU wheel this project is developed against. On a CUDA machine that already has torch,
# `make test TORCH_SPEC=` skips the step and uses the installed one (with --system-site-packages).
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
VENV_FLAGS := $(if $(TORCH_SPEC),,--system-site-packages)

.PHONY: demo test test-fast lint format venv clean
LINTED := src tests benchmarks examples

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[test,integrations]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/memfit demo

lint: venv
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# The suite runs in two worker processes (pytest-xdist; tests/conftest.py gives each its share of
# the cores): most tests spend their time in Python (capture, tracing, planning), one core each.
# The DDP/FSDP2 tests run alone afterwards: two ranks planning and communicating on two cores
# are sensitive to timing, which a second worker beside them makes worse.
SERIAL_TESTS := tests/test_ddp.py
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --durations=15 tests $(addprefix --ignore=,$(SERIAL_TESTS))
	$(PY) -m pytest -q -p no:cacheprovider $(SERIAL_TESTS)

# The fast tier, to run after every change (under 2 minutes on 2 cores): the tests not marked
# slow (tests/conftest.py: subprocesses and ranks, Inductor, every zoo model but a core trio, the
# frameworks). No linters: `make lint` runs them.
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests $(addprefix --ignore=,$(SERIAL_TESTS))

clean:
	rm -rf $(VENV) build dist src/*.egg-info
