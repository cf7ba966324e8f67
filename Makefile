# odl developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.odl-installed
PROTO_SRC := $(wildcard protos/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,odl/protos/%_pb2.py,$(PROTO_SRC))

.PHONY: venv protos browser test demo demo-cloud demo-filestream lint bench clean gpu-check

venv: $(STAMP)

# Everything pinned in requirements.txt; torchrec with --no-deps (its metadata pulls the
# CUDA fbgemm-gpu build). On a CUDA machine install fbgemm-gpu matching torch instead of
# fbgemm-gpu-cpu (see docs/training.md#gpu).
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps torchrec==1.8.0
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Python code generated from protos/*.proto (not committed, never edited by hand).
protos: $(PROTO_OUT)

odl/protos/%_pb2.py: protos/%.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=odl/protos --pyi_out=odl/protos $<

# The dashboards' browser test (tests/test_dashboards.py) drives Debian's chromium with its
# chromedriver: installed here when missing and this is root on Debian; elsewhere that test
# is skipped and says so (install chromium and chromium-driver to run it).
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium + chromium-driver for the dashboards' browser test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    --no-install-recommends chromium chromium-driver >/dev/null; } || \
	  echo "could not install chromium: the dashboards' browser test will be skipped"; \
	else echo "no chromium/chromedriver (and not root on Debian): the dashboards' browser" \
	  "test will be skipped; apt-get install chromium chromium-driver to run it"; fi

# Three workers, whole files each (module fixtures set up once); tests/conftest.py starts
# the longest files first (its FILE_SECONDS table of measured times). Three on two cores:
# a third of a worker's time is spent waiting (process starts, brokers, polls), which a
# third worker fills. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3
test: venv protos browser
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# On a GPU machine whose python3 holds a CUDA torch: installs fbgemm-gpu / torchrec paired
# with it and the other pins (bench/gpu_install.sh), then runs every check that needs the GPU
# and prints one JSON (bench/gpu_check.py; docs/benchmarks.md#gpu-check).
gpu-check:
	bench/gpu_install.sh
	$(PYTHON) bench/gpu_check.py --json gpu_check.json

demo: venv protos
	$(BIN)/python -m odl.demos.kafka_demo

# The same loop on DataHub and OSS, played by local test doubles (no cloud account needed).
demo-cloud: venv protos
	$(BIN)/python -m odl.demos.cloud_demo

# PaddleRec-style file stream: day/pass splits, day/pass saves, serving from base + deltas.
demo-filestream: venv protos
	$(BIN)/python -m odl.demos.filestream_demo

lint: venv
	$(BIN)/ruff check .

bench: venv protos
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf .odl odl/protos/*_pb2.py odl/protos/*_pb2.pyi
