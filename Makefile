# atroposlib — developer entry points.
#   make demo   install, then run the whole RL loop on the embedded tiny model (CPU)
#   make test   install, then run the test suite
#   make lint   ruff over the code
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install test demo lint format config-docs bench browser clean

install: $(STAMP)

# torch is pinned first: the CPU build lies on local disk; an unpinned torch would pull a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[all]"
	@touch $(STAMP)

# The browser check of the Gradio viewer needs Debian's chromium; install it when we can (root).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	      || echo "chromium could not be installed; the browser test will be skipped"; \
	  else echo "chromium not found; the browser test will be skipped"; fi; }

test: install browser
	WANDB_MODE=disabled $(PY) -m pytest -q

demo: install
	WANDB_MODE=offline $(VENV)/bin/atropos-grpo-run --config example_trainer/configs/demo_cpu.yaml

lint: install
	$(PY) -m ruff check atroposlib example_trainer environments tests benchmarks scripts
	$(PY) -m ruff format --check atroposlib example_trainer environments tests benchmarks scripts

format: install
	$(PY) -m ruff check --fix atroposlib example_trainer environments tests benchmarks scripts
	$(PY) -m ruff format atroposlib example_trainer environments tests benchmarks scripts

config-docs: install
	$(PY) scripts/gen_config_md.py > CONFIG.md

bench: install
	$(PY) benchmarks/api_bench.py
	$(PY) benchmarks/servers_bench.py
	$(PY) benchmarks/serve_model_bench.py
	$(PY) benchmarks/env_bench.py
	$(PY) benchmarks/trainer_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
