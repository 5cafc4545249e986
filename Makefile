# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/inspect_checkpoint maxtext model_name=deepseek3-671b mtp_num_layers=1

test: $(BIN)/.installed
	bash scripts/install_chromium.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(BIN)/.installed
	$(BIN)/python bench/bench_cli.py

clean:
	rm -rf $(VENV) build *.egg-info
