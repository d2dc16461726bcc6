# Two commands are the whole set-up on a fresh machine:
#   make demo   -- runs a local three-node swarm on the embedded default model
#   make test   -- lint + the full test suite
# Both create .venv and install the project (with llama-cpp-python built from source,
# ~4 min on 2 cores the first time; pip caches the wheel) when needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.prefixmesh-installed

.PHONY: all install demo test lint model bench-core clean

all: test

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -e '.[dev,bench]'
	@touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/prefixmesh model fetch

demo: $(STAMP)
	$(BIN)/prefixmesh demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -ra

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
