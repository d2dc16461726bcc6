# Two commands are the whole set-up on a fresh machine:
#   make demo   -- runs a local three-node swarm on the embedded default model
#   make test   -- lint + the full test suite
# Both create .venv and install the project (with llama-cpp-python built from source,
# ~4 min on 2 cores the first time; pip caches the wheel) when needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.prefixmesh-installed

.PHONY: all install demo test lint model bench-core clean browser natlab llama-gpu llama-server

all: test

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e '.[dev,bench]'
	@# an editable install compiles nothing (pip compiles a regular install's files); where
	@# PYTHONDONTWRITEBYTECODE is set, every node start would compile our sources again
	@# (0.25 s of its 1.2 s start, docs/bench/engine.md)
	$(BIN)/python -m compileall -q prefixmesh node overlay inference bench > /dev/null
	@touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/prefixmesh model fetch

demo: $(STAMP)
	$(BIN)/prefixmesh demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) browser natlab
	$(BIN)/ruff check .
	@# two workers: most of the suite waits on node processes, gossip and polls; the few
	@# tests whose verdict rests on measured speeds run afterwards with the machine to themselves.
	@# Whole files per worker: a module fixture (a swarm, a NAT lab) is built once, and
	@# scenarios that build on each other run in order on it
	$(BIN)/python -m pytest -ra --durations=25 -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -ra --durations=5 -m serial

# headless Chromium for the dashboard's browser test (Debian package; sudo when not root);
# where it cannot be installed the test is skipped and says why
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ command -v apt-get >/dev/null 2>&1 && S=$$([ "$$(id -u)" = 0 ] || echo sudo) && \
	  $$S apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq \
	  --no-install-recommends chromium; } || \
	echo "warning: could not install chromium: the dashboard browser test will be skipped"

# nft (Debian package nftables) for the NAT lab's routers (bench/natlab.py); without it
# (or without root) the lab's tests are skipped and say why
natlab:
	@command -v nft >/dev/null 2>&1 || \
	{ command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends nftables iproute2; } || \
	echo "warning: could not install nftables: the NAT lab tests will be skipped"

# Rebuild llama-cpp-python (same version) with a GPU backend: make llama-gpu GPU=cuda
# (or metal, vulkan; README "GPU"). Needs that backend's SDK (CUDA toolkit's nvcc, Xcode,
# Vulkan SDK); then checks that llama.cpp reports GPU offload.
GPU ?= cuda
llama-gpu: $(STAMP)
	@case "$(GPU)" in \
	  cuda) args="-DGGML_CUDA=on" ;; metal) args="-DGGML_METAL=on" ;; \
	  vulkan) args="-DGGML_VULKAN=on" ;; \
	  *) echo "GPU must be cuda, metal or vulkan (got '$(GPU)')"; exit 2 ;; \
	esac; \
	version=$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))'); \
	echo "building llama-cpp-python $$version with CMAKE_ARGS=$$args (several minutes)"; \
	CMAKE_ARGS="$$args" FORCE_CMAKE=1 $(BIN)/python -m pip install --force-reinstall \
	  --no-deps --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$$version"
	$(BIN)/python -c "import llama_cpp, sys; ok = llama_cpp.llama_supports_gpu_offload(); \
	print('llama.cpp GPU offload:', 'available' if ok else 'NOT available'); sys.exit(0 if ok else 1)"

# llama-server for `prefixmesh bench engine --against-llama-server` (docs/bench/engine.md; not
# part of CI): built from the llama.cpp source vendored in the llama-cpp-python sdist of the
# version we run, native CPU flags, no curl/OpenSSL/web UI; only the llama-server target,
# niced (~13 min on 2 cores). Output: .build/llama-server/build/bin/llama-server
LLAMA_SERVER_VERSION ?= 0.3.36
LLAMA_SERVER_DIR     := .build/llama-server
LLAMA_SERVER_JOBS    ?= 2
LLAMA_SERVER_BIN     := $(LLAMA_SERVER_DIR)/build/bin/llama-server
llama-server: $(LLAMA_SERVER_BIN)
	@echo "llama-server: $(LLAMA_SERVER_BIN)"

$(LLAMA_SERVER_BIN):
	@command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends cmake build-essential; } || \
	{ echo "llama-server needs cmake and a C++ compiler (apt-get install cmake build-essential)"; \
	  exit 1; }
	mkdir -p $(LLAMA_SERVER_DIR)
	@sdist=$(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_SERVER_VERSION).tar.gz; \
	test -f $$sdist || { py=$$([ -x $(BIN)/python ] && echo $(BIN)/python || echo $(PYTHON)); \
	  $$py -m pip download --no-binary :all: --no-deps \
	    "llama-cpp-python==$(LLAMA_SERVER_VERSION)" -d $(LLAMA_SERVER_DIR); }; \
	rm -rf $(LLAMA_SERVER_DIR)/src && mkdir -p $(LLAMA_SERVER_DIR)/src && \
	tar -xzf $$sdist -C $(LLAMA_SERVER_DIR)/src --strip-components=1
	nice -n 19 cmake -S $(LLAMA_SERVER_DIR)/src/vendor/llama.cpp -B $(LLAMA_SERVER_DIR)/build \
	  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF
	nice -n 19 cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server \
	  -j$(LLAMA_SERVER_JOBS)
	$(LLAMA_SERVER_BIN) --version

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
