# clonemap: the two commands of the quick start, plus helpers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run demo test test-unit bench clean venv bytecode

venv: $(STAMP)

$(STAMP): pyproject.toml shards/common/_zframes.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# PYTHONWARNINGS: setuptools' notes on its own build (the experimental ext-modules
	@# table, editable installs) are not the user's to act on; errors still show
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# Every server, supervisor and client command is a Python process that imports the
# project's modules. Where PYTHONDONTWRITEBYTECODE is set (this project's development
# hosts set it, and likely CI) none of them caches its bytecode, so each compiled the
# modules again at its start: 50-65 ms of CPU of a server's ~0.2 s, and the suite starts
# thousands. Python still reads bytecode that is there; this writes it (only what changed
# since the last time: a fraction of a second).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 clonemap shards client supervisor bench > /dev/null

run: $(STAMP) bytecode
	$(BIN)/python -m clonemap.supervisor start configs/4shard.yaml --demo-load

demo: $(STAMP) bytecode
	$(BIN)/python -m clonemap.client.demo

# the suite waits on real processes far more than it computes: three workers on 2 cores
# (a census of one run: 1,138 s of CPU in its processes over 2,100 s of test time), each
# test module whole in one of them (its module fixtures, a cluster or an etcd, made once),
# handed out in the order tests/conftest.py collects them, the longest first (pytest-xdist
# would otherwise hand out the modules with the most tests first, and a long module ran
# on alone at the end). The modules whose pairs span hosts, 2 s leases in etcd, run one
# after another in one worker (conftest's ONE_AT_A_TIME): two of them at once starved
# each other's renewals. Four workers were 5-10% faster on 2026-12-01 (628-767 s of
# pytest against 771 s), but the CPU is then all taken (1.9 of 2 cores) and a growth
# across hosts did not reach its copy's end within its test's 60 s once in five clones
TEST_WORKERS ?= 3

# pytest rewrites the test modules' asserts at import, and caches the result as bytecode
# only where bytecode may be written: under PYTHONDONTWRITEBYTECODE each worker rewrote
# and compiled every module itself, ~9 s of CPU per worker here. One collection first
# writes that cache (the workers read it whatever the setting): 2.5 s a worker after it.
test: $(STAMP) bytecode
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-unit: $(STAMP) bytecode
	$(BIN)/python -m pytest -q -m unit

bench: $(STAMP) bytecode
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache shards/common/_zframes*.so
	find clonemap shards client supervisor bench tests -name __pycache__ -type d -prune -exec rm -rf {} +
