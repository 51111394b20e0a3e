# Two commands: `make demo` and `make test`. Each sets up .venv first, once: the set-up is redone only when
# requirements.txt changes, so a second run starts at once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.installed

.PHONY: demo test

demo: $(READY)
	$(BIN)/torchrun --standalone --nproc_per_node=2 solutions/01_ddp_basic.py --dataset digits

test: $(READY)
	$(BIN)/python -m pytest

$(READY): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install --no-deps d2l==1.0.3
	$(BIN)/python -m pip install --no-deps -e .
	touch $@
