# Two commands do all the set-up on a fresh machine:
#   make demo   offload real tensors through the real engine and report speed
#   make test   the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel for tests and CI; the package itself accepts torch>=2.1.
TORCH  ?= torch==2.13.0
DIR    ?= .scratch
# Test processes; each module runs whole on one of them.
TEST_WORKERS ?= 2

.PHONY: demo test bench build system-deps clean

demo: $(STAMP)
	@mkdir -p $(DIR)
	$(PY) examples/demo.py $(DIR)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	@mkdir -p $(DIR)
	$(PY) -m offload bench $(DIR)

# Rebuild the extension in place after editing csrc/.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# liburing-dev for the io_uring engine, fio for the benchmark's device limit.
system-deps:
	@if pkg-config --exists liburing 2>/dev/null && command -v fio >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing liburing-dev pkg-config fio with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev pkg-config fio >/dev/null; \
	else \
	  echo "note: liburing-dev or fio is missing and apt-get needs root: io_uring or the fio reference will be unavailable"; \
	fi

$(STAMP): setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" "pybind11>=2.10" "setuptools>=64" wheel
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	@touch $(STAMP)

clean:
	rm -rf build $(VENV) offload/*.so *.egg-info $(DIR)
