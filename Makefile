# All set-up lives here: `make distill` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the local CPU wheel; GPU machines may override, e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv distill test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

distill: $(STAMP)
	$(PY) -m nemo_automodel_ext.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/packing.py

clean:
	rm -rf $(VENV)
