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

.PHONY: demo test bench clean stack

$(BIN)/.installed: setup.cfg pyproject.toml $(PINS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e '.[test]'
	touch $@

stack: $(BIN)/.installed
	@$(BIN)/python -c "import sys, importlib.metadata as m; \
	print('stack: Python', sys.version.split()[0], *(p + ' ' + m.version(p) for p in \
	('jax', 'flax', 'qwix', 'orbax-checkpoint', 'numpy')), '($(VENV))')"

demo: stack
	$(BIN)/inspect_checkpoint maxtext model_name=deepseek3-671b mtp_num_layers=1

test: stack
	bash scripts/install_chromium.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: stack
	$(BIN)/python bench/bench_cli.py

clean:
	rm -rf .venv-py* build *.egg-info
