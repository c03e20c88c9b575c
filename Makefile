# One-command set-up and checks. Everything runs inside .venv (created by `make install`).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
TINY    := models/tiny
ENGINE  := engines/tiny

.PHONY: install test lint demo bench soak tiny-model deep-model gpu-check clean

$(STAMP): requirements.lock pyproject.toml
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	# torch==2.13.0 (CPU build) comes from local disk on the dev/CI machines; everything else is pinned.
	$(PIP) install --quiet -r requirements.lock
	$(PIP) install --quiet --no-deps tensorrt-stubs==10.13.0.35.1
	# --no-deps: the extras' packages are pinned in requirements.lock above; this only registers them.
	$(PIP) install --quiet --no-deps -e ".[serve,bench,test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	.venv/bin/ruff check builder plugins runtime models tests
	$(PY) .ci/patch_trt_stubs.py build/trt-stubs
	MYPYPATH=build/trt-stubs .venv/bin/mypy builder plugins runtime models

demo: $(STAMP)
	$(PY) -m runtime.demo --checkpoint $(TINY) --engine $(ENGINE)

bench: $(STAMP)
	$(PY) -m runtime.bench --checkpoint $(TINY) --engine $(ENGINE)

# The full soak through the real server (docs/SERVING.md, "Soak"); CI runs the same test with 200 requests.
soak: $(STAMP)
	MTP_SOAK_REQUESTS=2000 OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/runtime/test_serve_soak.py

tiny-model: $(STAMP)
	$(PY) -m models.training.train --model tiny --output $(TINY)

deep-model: $(STAMP)  # ~35 min on one core; docs/DEEP_MODEL.md
	$(PY) -m models.training.train --model deep --output models/deep

gpu-check: $(STAMP)
	$(PY) -m plugins.gpu_check
	$(PY) -m runtime.gpu_check

clean:
	rm -rf .venv engines build
