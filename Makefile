# tflms: Large Model Support for TensorFlow 2.x.  `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TF_VERSION ?= 2.21.0
CXX ?= g++
NVCC ?= nvcc
BUILD := build
CORE_SRCS := $(filter-out core/src/cuda_%,$(wildcard core/src/*.cc))
CORE_HDRS := $(wildcard core/include/tflms/*.h core/src/*.h)
TEST_HDRS := $(wildcard core/tests/*.h)
CXXFLAGS_CORE := -std=c++17 -Wall -Wextra -Werror -Icore/include -Icore/src -pthread

.PHONY: help install test test-binaries test-fast lint cpp-test sanitize sanitize-asan sanitize-tsan cuda-test patches verify verify-all \
        verify-nightly bench bench-prefetch bench-cuda compare-engines copy-order demo results transformers steadiness lookahead soak wheel clean addon-check addon-check-all

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

$(VENV)/.installed: pyproject.toml setup.py $(CORE_SRCS) $(CORE_HDRS) tflms/_native/binding.cc
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q setuptools wheel "pybind11>=2.12"
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,models]'
	$(PY) -m pip install -q --no-deps 'keras-hub==0.32.0'  # see pyproject.toml: models
	touch $@

install: $(VENV)/.installed ## Create .venv, build the engine extension, install tflms + TensorFlow (CPU)

HAVE_NVCC := $(shell command -v $(NVCC) 2>/dev/null)
# Parallel compiles and pytest workers (pytest-xdist) in `make test`. Each TensorFlow test
# runs its own process of a GB or two; 2 suits the 2-core, 24 GiB CI machine. JOBS=1 runs
# everything one at a time.
JOBS ?= 2
# The plain build (`make cpp-test`) runs the same tests as the ASan+UBSan one, which
# `make test` runs instead: compiling and running both cost CI time for no other check.
TEST_BINARIES := $(BUILD)/engine_test_asan $(BUILD)/engine_test_tsan \
                 $(if $(HAVE_NVCC),$(BUILD)/cuda_engine_test $(BUILD)/cuda_steps $(BUILD)/cuda_copy_lanes)
test-binaries: $(TEST_BINARIES)

# The binaries are compiled first, an object file at a time, JOBS at once; then they run
# JOBS at once too, each one's output printed whole when it ends (--output-sync), so it stays
# readable. The ThreadSanitizer run alone takes about two minutes on 2 cores.
test: install ## Every test: C++ engine (ASan+UBSan, TSan), CUDA build, ruff, pytest, patch verification, the add-on for the newest TensorFlow
	$(MAKE) -j$(JOBS) test-binaries
	$(MAKE) -j$(JOBS) --output-sync=target sanitize-tsan sanitize-asan $(if $(HAVE_NVCC),cuda-test) lint
	$(PY) -c "import tflms.tfcpu as t; t.library()"  # built once here, not by each worker
	$(PY) -m pytest -q -m "not slow" --durations=20 $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist worksteal) tests
	$(MAKE) verify
	$(MAKE) addon-check

test-fast: install ## Python tests without TensorFlow
	$(PY) -m pytest -q -m "not slow and not tf" tests

lint: install ## ruff on the Python sources
	$(VENV)/bin/ruff check tflms tensorflow_large_model_support tests examples bench scripts
	$(VENV)/bin/ruff format --check tflms tensorflow_large_model_support tests examples bench scripts

# Object files per build flavour, so that make spreads one binary's sources over JOBS
# and a change recompiles only what it touches. `cuda` is the host code of the nvcc
# binaries, compiled once for all of them.
FLAGS_plain := -O1 -g
FLAGS_asan := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer
FLAGS_tsan := -O1 -g -fsanitize=thread
FLAGS_cuda := -O2
core_objs = $(patsubst core/src/%.cc,$(BUILD)/obj/$(1)/%.o,$(CORE_SRCS))

define flavour_rules
$(BUILD)/obj/$(1)/%.o: core/src/%.cc $(CORE_HDRS)
	@mkdir -p $$(@D)
	$(CXX) $(CXXFLAGS_CORE) $(FLAGS_$(1)) -c -o $$@ $$<

$(BUILD)/obj/$(1)/engine_test.o: core/tests/engine_test.cc $(CORE_HDRS) $(TEST_HDRS)
	@mkdir -p $$(@D)
	$(CXX) $(CXXFLAGS_CORE) $(FLAGS_$(1)) -c -o $$@ $$<
endef
$(foreach f,plain asan tsan cuda,$(eval $(call flavour_rules,$(f))))

$(BUILD)/engine_test: $(BUILD)/obj/plain/engine_test.o $(call core_objs,plain)
	$(CXX) $(CXXFLAGS_CORE) $(FLAGS_plain) -o $@ $^

cpp-test: $(BUILD)/engine_test ## C++ engine tests (sim backend)
	$(BUILD)/engine_test

$(BUILD)/engine_test_asan: $(BUILD)/obj/asan/engine_test.o $(call core_objs,asan)
	$(CXX) $(CXXFLAGS_CORE) $(FLAGS_asan) -o $@ $^

$(BUILD)/engine_test_tsan: $(BUILD)/obj/tsan/engine_test.o $(call core_objs,tsan)
	$(CXX) $(CXXFLAGS_CORE) $(FLAGS_tsan) -o $@ $^

sanitize: sanitize-asan sanitize-tsan ## C++ tests under AddressSanitizer+UBSan and ThreadSanitizer

sanitize-asan: $(BUILD)/engine_test_asan
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1 $(BUILD)/engine_test_asan

sanitize-tsan: $(BUILD)/engine_test_tsan
	TSAN_OPTIONS=halt_on_error=1 setarch -R $(BUILD)/engine_test_tsan

# Hopper machine code (the GPUs this was measured on) and PTX any newer GPU
# compiles at load.
NVCC_ARCH ?= -gencode arch=compute_75,code=compute_75 -gencode arch=compute_90,code=sm_90
NVCCFLAGS := -std=c++17 -O2 $(NVCC_ARCH) -Xcompiler -Wall,-Werror -Icore/include -Icore/src -Icore/tests
CUDA_OBJS := $(BUILD)/obj/cuda/cuda_device.o $(call core_objs,cuda)
CUDA_DEPS := core/tests/cuda_kernels.cuh $(CORE_HDRS) $(TEST_HDRS) $(CUDA_OBJS)
CUDA_LINK := $(CUDA_OBJS) -lpthread

$(BUILD)/obj/cuda/cuda_device.o: core/src/cuda_device.cu core/src/cuda_device.h $(CORE_HDRS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -c -o $@ core/src/cuda_device.cu

$(BUILD)/cuda_engine_test: core/tests/cuda_engine_test.cu $(CUDA_DEPS)
	$(NVCC) $(NVCCFLAGS) -o $@ core/tests/cuda_engine_test.cu $(CUDA_LINK)

$(BUILD)/cuda_bench: bench/cuda_bench.cu $(CUDA_DEPS)
	$(NVCC) $(NVCCFLAGS) -o $@ bench/cuda_bench.cu $(CUDA_LINK)

$(BUILD)/cuda_steps: bench/cuda_steps.cu $(CUDA_DEPS)
	$(NVCC) $(NVCCFLAGS) -o $@ bench/cuda_steps.cu $(CUDA_LINK)

$(BUILD)/cuda_copy_lanes: bench/cuda_copy_lanes.cu
	@mkdir -p $(BUILD)
	$(NVCC) $(NVCCFLAGS) -o $@ bench/cuda_copy_lanes.cu

cuda-test: $(BUILD)/cuda_engine_test $(BUILD)/cuda_steps $(BUILD)/cuda_copy_lanes ## Build the CUDA backend with nvcc and run it (skips without a GPU)
	$(BUILD)/cuda_engine_test
	$(BUILD)/cuda_steps --sim 55 --steps 4 --label sim

bench-cuda: $(BUILD)/cuda_bench ## On a GPU: copy bandwidth, overlap, VMM cost, training workload vs the planner (docs/results.md)
	$(BUILD)/cuda_bench $(BUILD)/cuda_bench.json

addon-check: install ## The stock-wheel add-on for the newest TensorFlow (CI): build it against the tensorflow GPU wheel (venv in ~/.cache/tflms/venvs/gpu-<version>), link check, CPU run (docs/addon.md)
	TFLMS_ADDON_TF_VERSIONS=$(TF_VERSION) $(PY) -m pytest -q -m slow --durations=5 tests/test_addon.py

addon-check-all: install ## The same for every supported TensorFlow, each against its own GPU wheel (about 5 min per version, cold)
	@test -n "$(TF_VERSIONS)" || { echo "no supported versions read from tflms.patch"; exit 1; }
	TFLMS_ADDON_TF_VERSIONS="$(TF_VERSIONS)" $(PY) -m pytest -q -m slow --durations=0 tests/test_addon.py

# Every supported tag, oldest first (tflms/patch/__init__.py: SUPPORTED_VERSIONS).
TF_VERSIONS = $(shell $(PY) -c 'from tflms.patch import SUPPORTED_VERSIONS as v; print(*v)' 2>/dev/null)

patches: install ## Regenerate patches/ from core/ and tf/, for every supported tag
	for v in $(TF_VERSIONS); do $(PY) -m tflms patch generate --tf-version $$v || exit 1; done

verify: install ## Verify the newest tag's patch against its official tensorflow-cpu wheel (CI)
	$(PY) -m tflms verify --tf-version $(TF_VERSION)

verify-all: install ## Verify every tag's patch against its own wheel (venvs in ~/.cache/tflms/venvs)
	rc=0; for v in $(TF_VERSIONS); do $(PY) -m tflms verify --tf-version $$v || rc=1; done; exit $$rc

verify-nightly: install ## Early warning: the newest tag's patch against today's tf-nightly-cpu
	$(PY) -m tflms verify --tf-version $(TF_VERSION) --nightly

bench: install ## Engine vs TensorFlow's own BFCAllocator, side by side
	$(PY) bench/run_bench.py

bench-prefetch: install ## Prefetch vs on-demand inside real TensorFlow (Keras fit, CPU harness, paced link), in time
	$(PY) bench/prefetch_fit.py
	$(PY) bench/prefetch_fit.py --device-memory 4736KiB
	$(PY) bench/prefetch_fit.py --case keras_fit_deep

BASE ?= HEAD
compare-engines: install ## An engine change judged at the results points and their neighbouring batches: the working tree vs BASE (default HEAD)
	$(PY) bench/compare_engines.py --base $(BASE)

copy-order: install ## What the order of copies costs the Ideal at the results points, link by link, and what holding copies out wins back
	$(PY) bench/copy_order.py

demo: install ## The main job: ResNet50 on the 16 GB V100 machines (PCIe 3, NVLink 2), with and without LMS
	$(PY) -m tflms demo

results: install transformers ## Regenerate every figure: docs/results.md (several models on real GPU/link machines, the TFLMS papers' rows) and docs/transformers.md
	$(PY) -m tflms results --force --json-output docs/results.json

transformers: install ## Regenerate docs/transformers.md (keras-hub GPT-2, BERT, Llama on 16 GB V100s, fp32 and mixed)
	$(PY) -m tflms transformers --force --json-output docs/transformers.json

steadiness: install ## Replay every point of docs/results.md for 30 steps: mean, fastest and slowest step (docs/steadiness.md)
	$(PY) -m tflms steadiness --force --json-output docs/steadiness.json

lookahead: install ## Replay every point of docs/steadiness.md with prefetch at lookaheads 32 to 256 besides the default (docs/lookahead.md)
	$(PY) -m tflms lookahead --force --json-output docs/lookahead.json

soak: install ## A million random engine operations against a reference model
	$(PY) -m tests.soak --ops 1000000

WHEEL_ARGS ?=
wheel: install ## Build a TensorFlow wheel with LMS (TF_VERSION=2.21.0; WHEEL_ARGS="--cpu --docker --jobs 16")
	$(VENV)/bin/tflms build-wheel --tf-version $(TF_VERSION) $(WHEEL_ARGS)

clean: ## Remove build products (keeps .venv)
	rm -rf $(BUILD) *.egg-info tflms/*.so .pytest_cache .ruff_cache
