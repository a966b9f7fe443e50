# Two entry points (README): `make demo` and `make test`. Both create .venv and install the package.
# Without an NVIDIA GPU the CPU build of torch is installed first (pip would otherwise pull a CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test gpu-test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA GPU found: installing the default torch build"; \
	else \
		echo "no CUDA GPU: installing the CPU torch==2.13.0"; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m glm53_flash demo

# -n auto: one pytest worker per core (pytest-xdist). The suite is the interpreter running the real kernels at tiny
# shapes, CPU-bound and single-threaded per test: 838-1310 s on a 2-core machine (clean clones, 2026-12-03) where
# the serial suite took 1700-4555 s in CI.
test: $(STAMP)
	$(PY) -m pytest -q -n auto

# On the GPU machine (nothing installable there): run from the tree with the image's packages.
gpu-test:
	REQUIRE_CUDA=1 PYTHONPATH=. $(PYTHON) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
