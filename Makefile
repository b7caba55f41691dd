# One entry point per job. `make demo` and `make test` do all the set-up themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU users install their CUDA build of torch before `make setup`.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint bench bench-data data cram-1gpu clean plan bench-plan

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/cram.py \
		--preset tiny --budget 3m --output-dir runs/demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check cram recipes tests

bench: setup
	$(BIN)/python -m cram.bench.train_step

data: setup
	$(BIN)/python recipes/prepare_data.py embedded --output-dir runs/data

bench-data: setup
	$(BIN)/python -m cram.bench.data

cram-1gpu: setup
	$(BIN)/accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/cram.py --budget 24h

clean:
	rm -rf runs .pytest_cache

# The planner: which configuration trains MODEL fastest on the hardware ACCEL_CONFIG describes, and what the run costs.
MODEL ?= pythia-1b
ACCEL_CONFIG ?= accel_configs/1gpu.yaml
plan: setup
	$(BIN)/accelerate launch -q --config_file $(ACCEL_CONFIG) recipes/plan.py --model $(MODEL) \
		--output-dir runs/plan/$(MODEL) --verify

bench-plan: setup
	$(BIN)/python -m cram.bench.plan
