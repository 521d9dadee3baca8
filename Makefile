# Set-up and entry points. The first target that needs Python creates .venv and installs
# the package (torch pinned first, then the editable package with its test extra, then
# torchtitan without its trainer's requirements); the stamp file keeps later runs from
# reinstalling until pyproject.toml or the torchtitan list changes.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: demo demo-collectives test lint bench bench-publish bench-copy bench-compiled-copy gpu-check install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml tests/torchtitan-requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_PIN)
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps -r tests/torchtitan-requirements.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fsdp_traceable train

# A real run of the collectives alone: all-gather and reduce a bucket on 2 gloo ranks.
demo-collectives: $(STAMP)
	$(PY) -m fsdp_traceable demo

# Every training mode next to torch FSDP2 on two workloads. `make bench` writes
# benchmarks/out/bench.* and benchmarks/out/narrow_wide_vocab/bench.* (ignored by git);
# `make bench-publish` runs the same into benchmarks/results/ (tracked, the figures
# docs/benchmarks.md cites), each bench.json recording the commit it measured.
BENCH_OUT := benchmarks/out
bench: $(STAMP)
	$(PIP) install -q -e '.[bench]'
	$(PY) -m fsdp_traceable bench --inductor-options --dim 256 --layers 4 --batch-size 8 --seq-len 64 \
		--out $(BENCH_OUT)
	$(PY) -m fsdp_traceable bench --inductor-options --dim 128 --layers 8 --vocab-size 4096 --batch-size 8 \
		--seq-len 64 --optimizer sgd --lr 0.05 --out $(BENCH_OUT)/narrow_wide_vocab

bench-publish:
	$(MAKE) bench BENCH_OUT=benchmarks/results

# Two parts: every test but the timing-sensitive ones on two workers (a test file stays
# on one worker, so its module fixtures run once), then the `serial` ones alone. The
# compile tests, the longest files, are handed out first, so the short ones fill the
# workers' ends instead of one long file running alone at the end.
# pytest exits 5 when it collects no test; an empty part is not a failure here.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
TEST_WORKERS ?= 2
test: $(STAMP)
	@status=0; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=30 compile_tests tests \
		|| status=$$?; [ $$status -eq 5 ] && status=0; \
	serial=0; $(PYTEST) -m serial --durations=5 tests compile_tests || serial=$$?; \
	[ $$serial -eq 5 ] && serial=0; [ $$status -ne 0 ] && exit $$status; exit $$serial

# Lint and import order (configuration in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The copy benchmarks write benchmarks/out/*.json; `BENCH_FLAGS=--publish` writes
# benchmarks/results/ instead.
bench-copy: $(STAMP)
	$(PY) benchmarks/copy_bench.py $(BENCH_FLAGS)

bench-compiled-copy: $(STAMP)
	$(PY) benchmarks/compiled_copy_bench.py $(BENCH_FLAGS)

# Everything that needs a GPU (kernels, bench on CUDA, CUDA tests), with the machine's own
# python3 and torch: no venv, no install (writes benchmarks/out/gpu/, ignored by git).
gpu-check:
	bash benchmarks/gpu_check.sh

clean-venv:
	rm -rf $(VENV)
