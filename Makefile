# Two commands: `make demo` and `make test`. Each sets up .venv first, once: the set-up is redone only when
# requirements.txt changes, so a second run starts at once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.installed

.PHONY: demo test test-slow test-cluster gpu-check

demo: $(READY)
	$(BIN)/torchrun --standalone --nproc_per_node=2 solutions/01_ddp_basic.py --dataset digits

test: $(READY)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "not slow and not slurm" --durations=15

# The drills marked slow, which `make test` leaves out to stay under 20 minutes on 2 cores; a plain `pytest` runs
# them too, and CI (.ci/run) runs them after `make test`. `make test` prints its 15 slowest tests: the candidates.
test-slow: $(READY)
	$(BIN)/python -m pytest -m "slow and not slurm"

# Lesson 07's SLURM launch file under a real SLURM: munged, a slurmctld and a slurmd on each of 2 emulated nodes
# (scripts/slurm_cluster.py). Needs root and network namespaces; installs Debian's slurm-wlm and munge with apt-get
# where they are missing. Where it cannot run, it says why in one line and fails. CI runs it after test-slow.
test-cluster: $(READY)
	@[ "$$(id -u)" = 0 ] || { echo "make test-cluster: needs root (apt-get, network namespaces, SLURM's daemons)"; exit 1; }
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }
	$(BIN)/python scripts/slurm_cluster.py --check
	$(BIN)/python -m pytest -m slurm --durations=0 tests/test_slurm_cluster.py

# On a GPU machine: runs every solution with NCCL and the GPU benchmarks, writes $(RESULTS)/<gpu-model>/. It sets up
# nothing and installs nothing from the network: it runs with .venv's Python where .venv exists, else with python3
# (a bare GPU machine's own PyTorch), or with GPU_PYTHON=...; without a GPU it says so and fails.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
RESULTS ?= results
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --results $(RESULTS)

$(READY): requirements.txt pyproject.toml
	@echo "Setting up $(VENV): PyTorch and friends, a few minutes the first time only"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps d2l==1.0.3
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@
