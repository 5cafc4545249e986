# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# Python 3.12 (MaxText 0.2.5's stack, installed with its pins as constraints) when the machine has it: pyenv's
# 3.12.1, else python3.12 on PATH, else python3. `make test PYTHON=python3.11` builds the Python 3.11 stack
# (jax 0.10.2). Each Python version gets its own virtual environment, .venv-py<major.minor>.
PYENV_PY312 := $(shell pyenv root 2>/dev/null)/versions/3.12.1/bin/python
PYTHON ?= $(shell if [ -x "$(PYENV_PY312)" ]; then echo "$(PYENV_PY312)"; \
	elif command -v python3.12 >/dev/null 2>&1; then echo python3.12; else echo python3; fi)
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VENV ?= .venv-py$(PYVER)
BIN := $(VENV)/bin
PINS := constraints/maxtext-0.2.5.txt
# MaxText's pins are for Python 3.12; other versions resolve setup.cfg's ranges alone.
CONSTRAINTS := $(if $(filter 3.12,$(PYVER)),-c $(PINS),)

# Pipelines in recipes fail when the inspect_checkpoint command in them fails.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
.DEFAULT_GOAL := help
IC := $(BIN)/python -m inspect_tool
M671 := model_name=deepseek3-671b mtp_num_layers=1

.PHONY: help demo test test-stress test-fast test-tpu durations bench clean stack

$(BIN)/.installed: setup.cfg pyproject.toml $(PINS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e '.[test,tpu]'
	touch $@

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 18
	@echo "  (PYTHON=python3.11 builds and uses the Python 3.11 stack in .venv-py3.11)"

stack: $(BIN)/.installed ## create the virtual environment if needed and print the stack it holds
	@$(BIN)/python -c "import sys, importlib.metadata as m; \
	print('stack: Python', sys.version.split()[0], *(p + ' ' + m.version(p) for p in \
	('jax', 'flax', 'qwix', 'orbax-checkpoint', 'numpy')), '($(VENV))')"

demo: stack ## DeepSeek-V3 671B: parameters by group, FP8 rule coverage and its speed on v5p, fit on a v5p-512 slice
	@echo; echo '$$ inspect_checkpoint maxtext $(M671) --summary   # (the 58-line listing left out)'
	@$(IC) maxtext $(M671) --summary | sed -n '/^Total Parameters/,$$p'
	@echo; echo '$$ inspect_checkpoint rules $(M671) quantization=fp8_full quantize_mtp=true --topology v5p-512   # (the verdict)'
	@$(IC) rules $(M671) quantization=fp8_full quantize_mtp=true --topology v5p-512 \
	  | sed -n '/^At a glance/,/^$$/p'
	@echo; echo '$$ inspect_checkpoint maxtext $(M671) ici_fsdp_parallelism=32 ici_expert_parallelism=8 \'
	@echo '    per_device_batch_size=1 --topology v5p-512 --summary --train adamw   # (per-device totals)'
	@$(IC) maxtext $(M671) ici_fsdp_parallelism=32 ici_expert_parallelism=8 per_device_batch_size=1 \
	  --topology v5p-512 --summary --train adamw | sed -n '/^Per-device memory/,$$p' \
	  | grep -E '^(Per-device|  group|  total|Largest|Plus|Against|v5p)'

test: stack ## the test suite: every test but the stress ones (installs Chromium for the browser tests when missing)
	bash scripts/install_chromium.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow"

test-stress: stack ## the stress tests (`slow`: memory cgroups, kills, signals, multi-process jobs, bench scripts; root)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m slow

test-fast: stack ## the inner loop (under 3 min): every test but the slow and the heavy ones (tests/durations.json)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow and not heavy"

test-tpu: stack ## on a TPU host: the chip's tests (`tpu`) and the golden, export and gmm tests (no -n: one holds the chip)
	$(BIN)/python -m pytest -q -p no:cacheprovider -p no:xdist tests/test_tpu_commands.py
	$(BIN)/python -m pytest -q -p no:cacheprovider -p no:xdist $$(cat tests/tpu_lane.txt)

durations: stack ## measure the whole suite again and rewrite tests/durations.json (what test-fast leaves out)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --junitxml=build/durations.xml
	$(BIN)/python scripts/test_durations.py build/durations.xml > tests/durations.json

bench: stack ## CLI wall time and peak RSS (bench/bench_cli.py); each bench/*.py also has --tiny
	$(BIN)/python bench/bench_cli.py

clean: ## remove the virtual environments and build output
	rm -rf .venv-py* build *.egg-info
