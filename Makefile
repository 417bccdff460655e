# torchbay: `make demo` sets up and runs the main job, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# every plugin distribution in the tree (each has its own setup.cfg)
PLUGIN_DIRS := $(patsubst %/setup.cfg,%,$(wildcard plugins/*/setup.cfg plugins/*/*/setup.cfg))
NPROC ?= 2
# the venv of the Hugging Face libraries (make compat-hf, make compat-suite)
HF_VENV ?= .venv-hf
HF_PY := $(HF_VENV)/bin/python

.PHONY: setup demo test test-slow lint docs compat compat-suite compat-hf bench release-check clean

$(VENV)/.installed: setup.cfg setup.py core/torchbay_as_accelerate.pth pyproject.toml constraints.txt requirements-dev.txt $(wildcard plugins/*/setup.cfg plugins/*/*/setup.cfg)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=64" wheel
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -r requirements-dev.txt
	$(PIP) install -q -c constraints.txt --no-build-isolation -e . $(addprefix -e ,$(PLUGIN_DIRS))
	touch $@

setup: $(VENV)/.installed

# train 3 epochs and save; then a new launch resumes from the saved state for a fourth epoch. Both log
# training and eval loss (built-in jsonl tracker, TensorBoard when installed) under runs/char_gpt/logs;
# torchbay plot draws them to runs/char_gpt/metrics.png
demo: setup
	rm -rf runs/char_gpt
	$(VENV)/bin/torchbay launch --num-processes $(NPROC) examples/char_gpt.py --output-dir runs/char_gpt --epochs 3
	$(VENV)/bin/torchbay launch --num-processes $(NPROC) examples/char_gpt.py --output-dir runs/char_gpt --epochs 4 --resume
	$(VENV)/bin/torchbay plot runs/char_gpt --title "char_gpt: 2 processes, 3 epochs, then 1 more after resume"
	@echo "logs: runs/char_gpt/logs/jsonl/char_gpt/metrics.jsonl (built-in tracker), runs/char_gpt/logs/tensorboard"
	@echo "      (look: $(VENV)/bin/tensorboard --logdir runs/char_gpt/logs/tensorboard); picture: runs/char_gpt/metrics.png"

# ruff (rules and line length in pyproject.toml) over every Python file of the repository
lint: setup
	$(VENV)/bin/ruff check core plugins tests benchmarks examples docs scripts

# the docs site (mkdocs.yml) into build/site, warnings as errors: docs/*.md as guides, README.md as the home page,
# reference pages from the public modules' docstrings and types (mkdocstrings); its tools pinned in docs/requirements.txt
$(VENV)/.docs-installed: $(VENV)/.installed docs/requirements.txt constraints.txt
	$(PIP) install -q -c constraints.txt -r docs/requirements.txt
	touch $@

docs: $(VENV)/.docs-installed
	$(VENV)/bin/mkdocs build --strict

# pytest-xdist: TEST_WORKERS processes, each test file on one of them (module fixtures run once); the cases marked
# slow (the longest multi-process runs) are left to test-slow, which .ci/run runs as well
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests plugins

test-slow: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow tests plugins

# every distribution's wheel and sdist built, then torchbay torchbay-fsdp torchbay-tensorboard installed from those
# wheels alone in a fresh venv outside the checkout, pip check, package data, a 2-process FSDP run (issue 29)
release-check: setup
	PY=$(abspath $(PY)) NPROC=$(NPROC) bash scripts/check_release.sh

# Accelerate 1.15's own test scripts, imports redirected to torchbay, 1 and 2 processes (docs/accelerate-compat.md);
# then Accelerate 1.15's own test suite (its sdist's tests/, fetched by pip) on Accelerate and under the switch, side
# by side, in .venv-hf (some of its tests need transformers): docs/accelerate-suite.md
compat: setup compat-suite
	$(PY) tests/compat/run.py

compat-suite: $(HF_VENV)/.installed
	$(HF_PY) tests/compat_suite/run.py

# transformers' Trainer, peft, trl and diffusers on Accelerate and on torchbay (the switch alone), side by side,
# in their own venv so that the main one stays free of them (docs/accelerate-compat.md, "The Hugging Face libraries")
$(HF_VENV)/.installed: setup.cfg setup.py constraints.txt tests/compat_hf/constraints-hf.txt tests/compat_hf/requirements-hf.txt $(wildcard plugins/*/setup.cfg plugins/*/*/setup.cfg)
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_PY) -m pip install -q --upgrade pip "setuptools>=64" wheel
	$(HF_PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(HF_PY) -m pip install -q -c constraints.txt -c tests/compat_hf/constraints-hf.txt -r tests/compat_hf/requirements-hf.txt
	$(HF_PY) -m pip install -q -c constraints.txt --no-build-isolation -e . $(addprefix -e ,$(PLUGIN_DIRS))
	touch $@

# the parallelism tests that train transformers models (Ulysses attention, MoE experts, a Llama in a pipeline): they
# skip in the main venv, which has no transformers, and run here
HF_MODEL_TESTS = plugins/fsdp/tests/test_ulysses.py plugins/fsdp/tests/test_experts.py plugins/fsdp/tests/test_pipeline.py

compat-hf: $(HF_VENV)/.installed
	$(HF_PY) tests/compat_hf/run.py
	$(HF_PY) -m pytest -q -p no:cacheprovider tests/big_modeling/test_big_model_hf.py
	$(HF_PY) -m pytest -q -p no:cacheprovider $(HF_MODEL_TESTS)

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(HF_VENV) runs
