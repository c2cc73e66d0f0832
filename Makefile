# All set-up lives here: `make distill` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the local CPU wheel; GPU machines may override, e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv distill eval test bench compare gpu-check gpu-wheels clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The framework CLI under torchrun (nemo_automodel_ext.launch): `automodel <yaml>` alone asks CUDA for a
# device count and fails on CPU-only machines (nemo_automodel 0.7.0), so launch one local worker explicitly.
# A refusal (bad key, bad data, non-finite loss) is printed as the last line: `error: ...`.
DISTILL_YAML ?= recipes/deepseek_v41/dspark_tiny_cpu.yaml
DISTILL_RUN ?= outputs/dspark_tiny_cpu
distill: $(STAMP)
	$(PY) -m nemo_automodel_ext.launch $(DISTILL_YAML) $(ARGS)
	@$(MAKE) --no-print-directory eval

# Exact greedy acceptance of the latest checkpoint beside the draft at initialisation, and sampling
# verification at temperature 1 (EVAL_ARGS= for greedy only); writes eval.json.
EVAL_ARGS ?= --temperature 1.0
eval: $(STAMP)
	$(PY) -m nemo_automodel_ext.evaluation $(DISTILL_RUN) $(EVAL_ARGS)

# Two pytest-xdist workers (the CI machine's 2 cores), one thread each and in every run they start (at two
# threads a worker, their threads outnumbered the cores and the suite ran slower than one process). Tests sharing
# an expensive fixture, and the Flash-width measurements (up to 13 GB each), keep to one worker by xdist_group;
# the groups go out in collection order, the longest first (tests/conftest.py FIRST_GROUPS).
PYTEST_ARGS ?= -n 2 --dist loadgroup --no-loadscope-reorder
PYTEST_THREADS ?= 1
test: $(STAMP)
	OMP_NUM_THREADS=$(PYTEST_THREADS) MKL_NUM_THREADS=$(PYTEST_THREADS) $(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/dspark_target.py
	$(PY) benchmarks/draft_scaling.py
	$(PY) benchmarks/cp_draft.py
	$(PY) benchmarks/training_step.py
	$(PY) benchmarks/memory_model.py
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/capture_docs.py

# Packed against three unpacked batchings at the same token budget and training time, each tuned on dev, over
# training seeds: greedy tau on test against training seconds (docs/images/packed_vs_unpacked.png), the goals at
# mean - sd (benchmarks/packing_value.py; docs/packing.md).
compare: $(STAMP)
	$(PY) benchmarks/packing_value.py $(COMPARE_ARGS)

# The device kit (docs/testing.md). Here: `make gpu-wheels` builds .whl/ (the wheels the lent H200's image lacks).
# There, from the repository root: `make gpu-check GPU_CHECK_ARGS="--output DIR"` with the image's python3.
gpu-wheels: $(STAMP)
	$(PY) benchmarks/gpu_wheels.py

GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/site
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) outputs
