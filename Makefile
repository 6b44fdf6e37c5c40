# `make test` sets everything up from nothing (venv, pinned CPU torch, the package, Debian packages
# for MPI and Slurm where apt is available) and runs the whole suite, as CI does.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast test-real test-replay lint demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py requirements.txt requirements-test.txt tools/install-system-deps.sh
	bash tools/install-system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c requirements-test.txt -e '.[test]'
	# MPICH (Hydra mpiexec + libmpi) in its own prefix, so its mpirun never shadows Open MPI's
	$(PY) -m pip install -q --no-deps --prefix $(VENV)/mpich -c requirements-test.txt mpich
	# nvidia-resiliency-ext (ft_launcher) in its own folder too: its pynvml shim warns in every torch process
	$(PY) -m pip install -q --no-deps --target $(VENV)/nvrx -c requirements-test.txt nvidia-resiliency-ext defusedxml psutil
	touch $@

lint: setup
	$(PY) -m ruff check .

# Everything that runs on a CPU: unit, multi-process, MPI, Slurm and slow end-to-end tests. MILES_STRICT_SKIPS=1:
# a test that skips for a dependency `make setup` installs fails (tests/suite_policy.py lists the expected skips).
test: setup lint
	MILES_STRICT_SKIPS=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -m "not gpu and not sglang" $(PYTEST_ARGS) tests

# Every Miles v0.1.0 recorded command that passes --dry-run, replayed for 2 rollouts at tiny CPU scale
# (docs/miles-scripts.md); `make test` runs 3 of them. Also the family e2e runs `make test` leaves to this tier
# (docs/benchmarks.md, "The CPU suite", says which test covers each there): Kimi-K2 and Kimi-K2.5 in the broadcast,
# p2p and disk-delta weight-sync modes and Nemotron-H in broadcast and p2p (`make test` runs each one's `tensor`
# mode, and Nemotron-H's disk-delta), Qwen3.5's published layout colocated, the LoRA adapter sync's megatron-tensor
# case, and the recorded commands' other fixtures (DeepSeek-V3 MLA, Kimi-K2 at TP 2 x PP 2 x EP 2, GLM-4.5-Air,
# Qwen3-235B-A22B disaggregated, the Qwen3.5 MTP / self-distillation commands).
test-replay: setup
	MILES_REPLAY_ALL=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -m replay $(PYTEST_ARGS) tests/e2e/test_miles_replay.py \
		tests/e2e/test_mla_parallel_replay.py tests/e2e/test_glm45_e2e.py tests/e2e/test_qwen3_next_e2e.py \
		tests/e2e/test_kimi_k2_e2e.py tests/e2e/test_kimi_k25_e2e.py tests/e2e/test_nemotron_h_e2e.py \
		tests/e2e/test_moe_parallel_replay.py tests/e2e/test_lora_adapter_sync_e2e.py

# The quick tier while developing.
test-fast: setup
	MILES_STRICT_SKIPS=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -m "not gpu and not sglang and not slow and not slurm" $(PYTEST_ARGS) tests

# The multi-process tier with every launch under real `torchrun` instead of the fork server
# (tests/multiprocess/_zygote.py), as a user's job starts: slower (each rank imports torch again).
test-real: setup
	MILES_TEST_REAL_TORCHRUN=1 MILES_STRICT_SKIPS=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -m "multiprocess and not gpu and not sglang" $(PYTEST_ARGS) tests

# The quickstart: build a tiny model and data locally, then learn with GRPO on CPU, on the default
# backend (megatron, as in Miles; setup installs megatron-core). Append --train-backend fsdp for FSDP2:
#   bash examples/quickstart/run_grpo.sh --train-backend fsdp
demo: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash examples/quickstart/run_grpo.sh

clean:
	rm -rf $(VENV) outputs .pytest_cache
