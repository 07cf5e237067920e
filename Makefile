# Two commands do all set-up on a fresh machine: `make demo` (main job) and `make test` (tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export MASTER_ADDR ?= 127.0.0.1
export PYTHONWARNINGS ?= ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning

.PHONY: setup demo test test-fast mpirun-tool slurm-tool clean

setup: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m megahybrid train --config demo-hybrid

# Open MPI's mpirun for the launcher test; where apt is not usable that test skips with the reason printed.
mpirun-tool:
	@command -v mpirun >/dev/null || { apt-get update -qq && apt-get install -y -qq openmpi-bin; } >/dev/null 2>&1 \
		|| echo "note: could not install openmpi-bin; the mpirun test will be skipped"

# Slurm and munge for tests/test_slurm.py, which brings up a private two-node cluster on 127.0.0.1 (root only).
slurm-tool:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >/dev/null 2>&1 \
		|| echo "note: could not install slurm-wlm/munge; the Slurm tests will be skipped"

test: $(STAMP) mpirun-tool slurm-tool
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not dist and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache
