# One entry point per job. `make demo` and `make test` do all the set-up themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU users install their CUDA build of torch before `make setup`.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
OPS    := $(VENV)/.ops-built

.PHONY: setup demo test test-fast lint bench bench-data data cram-1gpu clean plan bench-plan gpu-report device-check

# DeepSpeed 0.3.16's source (PyPI's sdist), fetched by `make test` alone, which the suite runs to write a checkpoint
# as GPT-NeoX v1.0 on DeeperSpeed 0.3 wrote the original Pythia's (tests/gpt_neox_v1_standin.py). pip fetches it with
# its own settings (indexes, proxy, certificates) and without build isolation, as its setup.py imports torch to say
# what it is; checked against PyPI's sha256, unpacked into VENV under a temporary name first. Order-only on the
# environment: the unpacked folder keeps the sdist's old dates, and it needs no new download when the environment
# changes.
DEEPSPEED_03 := $(VENV)/deepspeed-0.3.16
DEEPSPEED_03_SHA256 := 3fe047a0991daac8413ffe694534da2178665467c4f0b428ffffa9e5ba7e888f
$(DEEPSPEED_03): | $(STAMP)
	rm -rf "$@.partial"
	$(BIN)/python -m pip download -q --no-deps --no-build-isolation --no-binary :all: -d "$@.partial" deepspeed==0.3.16
	$(BIN)/python -c "import hashlib, sys, tarfile; path = sys.argv[1] + '/deepspeed-0.3.16.tar.gz'; \
		assert hashlib.sha256(open(path, 'rb').read()).hexdigest() == sys.argv[2], path + ': not the sha256 PyPI gives'; \
		tarfile.open(path).extractall(sys.argv[1], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))" \
		"$@.partial" "$(DEEPSPEED_03_SHA256)"
	mv "$@.partial/deepspeed-0.3.16" "$@" && rm -rf "$@.partial"

setup: $(STAMP) $(OPS)

# The package goes in under a constraint pinning the torch already there, so a CUDA build stays. EXTRAS: the optional
# paths to install (README: Install extras); the suite needs them all. PIP_INSTALL installs through uv with pip's own
# configuration (scripts/pip_install.py; pip itself where uv cannot be had), and compiles every module's bytecode as
# pip does (BYTECODE), so that a process started where PYTHONDONTWRITEBYTECODE is set does not compile its imports
# again; uv for its speed from empty caches (docs/benchmarks.md: The test suite).
# Where DeepSpeed is installed, its CPU Adam (the optimizer of every offloaded run) is built here, once, rather than by
# the first offloaded launch.
EXTRAS ?= all,dev
BYTECODE ?= --compile-bytecode
PIP_INSTALL = $(BIN)/python scripts/pip_install.py $(BYTECODE)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(VENV)/keep-torch.txt
	$(PIP_INSTALL) -c $(VENV)/keep-torch.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

$(OPS): $(STAMP)
	$(BIN)/python -m cram.train.deepspeed_ops
	touch $(OPS)

# Each demo replaces the last one's folder (a recipe refuses to start afresh over a finished model).
demo: setup
	rm -rf runs/demo
	$(BIN)/accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/cram.py \
		--preset tiny --budget 3m --output-dir runs/demo

# Two pytest workers (pytest-xdist): the suite waits on imports, launches and file writes, so one worker alone would
# leave cores idle. Each module runs whole on one worker, so its shared launches are made once, the modules with
# most launches first (tests/conftest.py); TEST_WORKERS=0 runs it in this process.
# (Not --dist loadgroup: under pytest 9.2, xdist 3.8's groups are silently ignored, as the nodeid it renames is
# no longer the one pytest reports.)
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# `make test` builds DeepSpeed's CPU Adam beside the suite instead of before it (where a new .venv needs it), at the
# lowest priority: it takes the CPU the suite leaves idle, and an offloaded launch that comes first waits for it on
# DeepSpeed's own build lock (torch.utils.cpp_extension) instead of building it again. The suite's build is its own,
# in .venv (TORCH_EXTENSIONS_DIR), made by tests/cxx-no-debug-info (CXX): the compiler without DeepSpeed's `-g`,
# which changes no generated code. Every process of the suite has both, so no launch rebuilds it under other flags,
# and the build `make setup` makes for users' runs is left as DeepSpeed makes it (docs/testing.md: Size and time).
# inductor compiles its kernels with CXX too, and picks its flags and precompiled headers by the compiler's name, so
# the script is reached through a link named after the compiler it runs: g++ (inductor's default), or the CXX given.
# Its processes write the bytecode of what they import, PYTHONDONTWRITEBYTECODE or not, so an install for the suite
# compiles none: the suite imports a fraction of what is installed.
TEST_OPS := $(VENV)/.test-ops-built
TEST_REAL_CXX := $(if $(filter environment command line,$(origin CXX)),$(CXX),g++)
TEST_CXX := $(abspath $(VENV))/test-cxx/$(notdir $(TEST_REAL_CXX))
test: BYTECODE :=
test: export PYTHONDONTWRITEBYTECODE :=
test: export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions
test: export CRAM_TEST_REAL_CXX := $(TEST_REAL_CXX)
test: export CXX := $(TEST_CXX)
test: $(STAMP) $(TEST_CXX) $(DEEPSPEED_03)
	{ { test $(TEST_OPS) -nt $(STAMP) && grep -qxF "$$CXX" $(TEST_OPS); } || \
	  { nice -n 19 $(BIN)/python -m cram.train.deepspeed_ops && echo "$$CXX" > $(TEST_OPS); }; } & \
	built=$$!; $(PYTEST); tested=$$?; wait $$built && exit $$tested

$(TEST_CXX): tests/cxx-no-debug-info
	mkdir -p $(@D) && ln -sf $(abspath $<) $@

# The inner loop: no test that starts a Python process (the `launch` mark, which tests/launching.py insists on) or
# is marked `slow` (lm-eval's task registry, in-process compilation).
test-fast: setup $(DEEPSPEED_03)
	$(PYTEST) -m "not launch and not slow"

lint: setup
	$(BIN)/ruff check cram recipes tests

bench: setup
	$(BIN)/python -m cram.bench.train_step

# The check to run first on a GPU machine (cram/bench/device_check.py): versions, the GPU, a measured matmul peak, the
# recipes' steps and their levers, the contenders, a planner probe, each row in a process of its own, both files
# written after every row: OUT/device_check.{json,md}. It runs with PYTHON as it is, nothing set up or installed
# (a GPU image's python3). MAX_MINUTES: the bound on its whole time (default 8, for a 10-minute command);
# ORIGINAL=PATH: a checkout of the original cramming code to time beside crammed BERT; ROWS: only the rows whose name
# holds one of these texts, separated by |. `make gpu-report` is the same check in the set-up .venv.
OUT ?= runs/device-check
device_check = $(1) -m cram.bench.device_check --output-dir "$(2)" $(if $(MAX_MINUTES),--max-minutes $(MAX_MINUTES)) \
	$(if $(ORIGINAL),--original "$(ORIGINAL)") $(if $(ROWS),--rows "$(ROWS)")
device-check:
	$(call device_check,$(PYTHON),$(OUT))

gpu-report: setup
	$(call device_check,$(BIN)/python,runs/gpu-report)

data: setup
	$(BIN)/python recipes/prepare_data.py embedded --output-dir runs/data

bench-data: setup
	$(BIN)/python -m cram.bench.data

# A recipe under a launch config, here with `accelerate launch`; with SLURM=1 as a Slurm job instead, written into the
# run folder and submitted (cram/slurm.py: nodes, GPUs and CPUs from the config, requeued on the time limit's notice
# until done, --resume auto; a second submission of the run waits for the first).
# TIME_LIMIT: the job's limit (e.g. 48:00:00; a longer run goes on in requeued jobs), unset the partition's;
# SBATCH: more #SBATCH options, e.g. SBATCH="--partition=gpu --account=lab"; SLURM_OPTIONS: more options of
# `python -m cram.slurm`, e.g. SLURM_OPTIONS="--memory 200G --cpus-per-process 8 --setup 'module load cuda/12.4'".
recipe_command = $(if $(SLURM),$(BIN)/python -m cram.slurm --submit --config $(1) $(if $(TIME_LIMIT),--time-limit \
	$(TIME_LIMIT)) $(foreach option,$(SBATCH),--sbatch=$(option))$(if $(SLURM_OPTIONS), $(SLURM_OPTIONS)) $(2),$(BIN)/accelerate launch -q \
	--config_file $(1) $(2))

cram-1gpu: setup
	$(call recipe_command,accel_configs/1gpu.yaml,recipes/cram.py --budget 24h --output-dir runs/cram)

# GLUE: fine-tune CKPT on every task with the paper's protocol; CKPT=runs/cram/final by default.
.PHONY: glue bench-quality
CKPT ?= runs/cram/final
glue: setup
	$(BIN)/accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/glue.py --model $(CKPT)

bench-quality: setup
	$(BIN)/python -m cram.bench.quality

clean:
	rm -rf runs .pytest_cache

# Pythia: `make pythia-<size>-<hardware> DATA=PREFIX`, e.g. `make pythia-1b-4xa100 DATA=pile/document`;
# `make pythia-4xa100` is pythia-1b on four A100s. DATA is the Megatron .bin/.idx prefix (or any source
# recipes/pythia.py reads), TOKENIZER the tokenizer that made it, MICRO the micro-batch per GPU (the global
# batch of 1024 is reached by accumulation). The exact `accelerate launch` is printed before it runs.
PYTHIA_SIZES    := 14m 31m 70m 160m 410m 1b 1.4b 2.8b 6.9b 12b
PYTHIA_HARDWARE := 1x24gb 1xa100 4xa100 8xa100 8xh100
TOKENIZER       ?= EleutherAI/gpt-neox-20b
# hardware -> launch config, default micro-batch per GPU, GPU memory (GiB) the size is checked against
PYTHIA_CONFIG_1x24gb := accel_configs/1x24gb-offload.yaml
PYTHIA_MICRO_1x24gb  := 4
PYTHIA_MEMORY_1x24gb := 24
PYTHIA_CONFIG_1xa100 := accel_configs/1xa100.yaml
PYTHIA_MICRO_1xa100  := 16
PYTHIA_MEMORY_1xa100 := 80
PYTHIA_CONFIG_4xa100 := accel_configs/4xa100.yaml
PYTHIA_MICRO_4xa100  := 16
PYTHIA_MEMORY_4xa100 := 80
PYTHIA_CONFIG_8xa100 := accel_configs/8gpu-zero1.yaml
PYTHIA_MICRO_8xa100  := 16
PYTHIA_MEMORY_8xa100 := 80
PYTHIA_CONFIG_8xh100 := accel_configs/8gpu-zero1.yaml
PYTHIA_MICRO_8xh100  := 16
PYTHIA_MEMORY_8xh100 := 80

.PHONY: pythia-data
pythia-data:
	@test -n "$(DATA)" || { echo "error: pass DATA=PATH, the Megatron .bin/.idx prefix of the training data (e.g. DATA=pile/document) or any source recipes/pythia.py reads." >&2; exit 2; }

pythia_arguments = recipes/pythia.py --size pythia-$(1) --data $(DATA) --tokenizer $(TOKENIZER) --micro-batch-size \
	$(or $(MICRO),$(PYTHIA_MICRO_$(2))) --device-memory-gib $(PYTHIA_MEMORY_$(2)) --output-dir runs/pythia-$(1)-$(2) \
	--resume auto

# The DATA check comes before `setup`, so a missing DATA costs nothing. SLURM=1 submits it as a Slurm job (above).
define pythia_target
.PHONY: pythia-$(1)-$(2)
pythia-$(1)-$(2): pythia-data setup
	@echo "$$(call recipe_command,$$(PYTHIA_CONFIG_$(2)),$$(call pythia_arguments,$(1),$(2)))"
	$$(call recipe_command,$$(PYTHIA_CONFIG_$(2)),$$(call pythia_arguments,$(1),$(2)))
endef
$(foreach size,$(PYTHIA_SIZES),$(foreach hardware,$(PYTHIA_HARDWARE),$(eval $(call pythia_target,$(size),$(hardware)))))

.PHONY: pythia-4xa100 pythia-smoke
pythia-4xa100: pythia-1b-4xa100

# pythia-14m on 64-token sequences for the first 4 steps of the full-length schedule and index (--stop-at-step), on
# the CPU with 2 processes under ZeRO-1 and then ZeRO-3, on a Megatron file and tokenizer written from the embedded
# corpus (runs/pythia-smoke/data).
pythia-smoke: setup
	$(BIN)/python -m cram.data.megatron embedded --output runs/pythia-smoke/data/document --vocab-size 1000 \
		--max-documents 400
	for stage in zero1 zero3; do \
		rm -rf runs/pythia-smoke/$$stage; \
		echo "$(BIN)/accelerate launch -q --config_file accel_configs/cpu-$$stage.yaml recipes/pythia.py --size pythia-14m --data runs/pythia-smoke/data/document --tokenizer runs/pythia-smoke/data/tokenizer --stop-at-step 4 --seq-len 64 --global-batch-size 8 --micro-batch-size 2 --log-every 1 --output-dir runs/pythia-smoke/$$stage"; \
		$(BIN)/accelerate launch -q --config_file accel_configs/cpu-$$stage.yaml recipes/pythia.py --size pythia-14m \
			--data runs/pythia-smoke/data/document --tokenizer runs/pythia-smoke/data/tokenizer --stop-at-step 4 \
			--seq-len 64 --global-batch-size 8 --micro-batch-size 2 --log-every 1 \
			--output-dir runs/pythia-smoke/$$stage || exit $$?; \
	done

# A run against the released models, step by step, with a verdict (cram/eval/replication.py): exit status 1 names
# the first step out of the band the seeds' spread gives. REFERENCE=released (the default) is the released seeds of
# the run's size (released-deduped: its deduplicated-Pile model); else one or more Hub names or folders of stepN
# revisions; HELDOUT is the held-out text every model scores (a local copy of the Pile's val.jsonl.zst); BUDGET
# (default 10m) the time the check may take, reading the references' weights included; TOKENIZER unset: the run's.
# E.g.
# `make pythia-replicate RUN=runs/pythia-160m-4xa100 DATA=pile/document HELDOUT=pile/val.jsonl.zst STEPS=0,1000,2000`.
# It needs the install, not DeepSpeed's CPU Adam: scoring trains nothing.
REFERENCE ?= released
.PHONY: pythia-replicate
pythia-replicate: pythia-data
	@test -n "$(RUN)" || { echo "error: pass RUN=OUTPUT_DIR, the --output-dir of a run of recipes/pythia.py." >&2; exit 2; }
	@test -n "$(HELDOUT)" || { echo "error: pass HELDOUT=PATH, held-out text for every model to score (a local copy of the Pile's validation split, val.jsonl.zst)." >&2; exit 2; }
	@$(MAKE) --no-print-directory $(STAMP)
	$(BIN)/python -m cram.eval.replication $(RUN) $(foreach reference,$(REFERENCE),--reference $(reference)) \
		--data $(DATA) --heldout $(HELDOUT) $(if $(filter command line environment,$(origin TOKENIZER)),--tokenizer $(TOKENIZER)) \
		$(if $(STEPS),--steps $(STEPS)) $(if $(BUDGET),--budget $(BUDGET)) $(if $(DEVICE),--device $(DEVICE))

# The replication verdict against seeds whose truth is known: simulated seeds (false fails and power, heavy tails, an
# outlying reference: runs/bench-replication/simulated.json), then pythia-14m's faithful seeds and departures from its
# recipe trained on the CPU, each seed checked against the others and each departure against the seeds; tables and
# runs/bench-replication/results.json (docs/benchmarks.md: Replication verdict: sensitivity).
.PHONY: bench-replication
bench-replication: setup
	$(BIN)/python -m cram.bench.replication_power --output runs/bench-replication/simulated.json
	$(BIN)/python -m cram.bench.replication_sensitivity --output-dir runs/bench-replication

# Where the suite's CPU goes: every Python process it starts, by kind and by test module; runs the whole suite, as
# `make test` does, and writes runs/bench-suite/costs.md (docs/benchmarks.md: The test suite).
.PHONY: bench-suite
bench-suite: setup
	mkdir -p runs/bench-suite
	$(BIN)/python -m cram.bench.suite_costs --output runs/bench-suite/costs.md

# What the tests' zygote saves: a recipe's --help, a tiny run and its 2-process launch, each fresh and forked,
# side by side; writes runs/bench-zygote/zygote.md (docs/testing.md: Zygotes).
.PHONY: bench-zygote
bench-zygote: setup
	mkdir -p runs/bench-zygote
	cd tests && ../$(BIN)/python zygote_bench.py | tee ../runs/bench-zygote/zygote.md

# The planner: which configuration trains MODEL fastest on the hardware ACCEL_CONFIG describes, and what the run costs.
MODEL ?= pythia-1b
ACCEL_CONFIG ?= accel_configs/1gpu.yaml
plan: setup
	$(BIN)/accelerate launch -q --config_file $(ACCEL_CONFIG) recipes/plan.py --model $(MODEL) \
		--output-dir runs/plan/$(MODEL) --verify

bench-plan: setup
	$(BIN)/python -m cram.bench.plan_accuracy
