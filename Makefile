# FaceFlow: every install step lives here, so CI on a clean clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.faceflow-installed

.PHONY: setup bench-setup run demo test test-slow test-all lint typecheck pytest pytest-slow bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first (exact pin: a CPU wheel lies on disk; a looser pin pulls a CUDA build),
# then the project, then the packages we only take files from, without their deps:
#  - facenet-pytorch carries the MTCNN weights (never imported: it needs torchvision);
#  - insightface carries the t1.jpg sample photo and documents the optional model packs;
#    its own dependency on opencv-python would install a second cv2 next to our
#    opencv-python-headless;
#  - nudenet carries the moderation detector 320n.onnx (AGPL-3.0, see tasks/registry.py);
#    what it requires (numpy, onnxruntime, opencv-python-headless) we pin ourselves;
#  - invisible-watermark carries the DWT-DCT watermark (tasks/watermark.py): it requires
#    opencv-python (a second cv2) and torch; we pin PyWavelets ourselves.
# The bench extra (Celery, kombu, billiard...: ~22 MB, nothing the service imports) comes
# along so that tests/test_celery_bench.py runs in CI instead of skipping; `make test`
# does not need it (that test skips without celery). kombu 5.7's redis extra pins
# packaging==26.3, one patch release below what pip picks otherwise.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/pip install -q --no-deps facenet-pytorch==2.6.0 insightface==2.1 nudenet==3.4.2 \
		invisible-watermark==0.2.0
	touch $(STAMP)

setup: $(STAMP)

# the bench-only extra into an existing .venv (bench/celery_queue.py)
bench-setup: setup
	$(BIN)/pip install -q -e '.[bench]'

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# `make test` stays under 20 minutes on a 2-core machine: it leaves out the suites marked
# `slow` (the whole stack end to end, the fault matrix, the batching and warm-worker races),
# which `make test-slow` runs and CI (.ci/run) runs after it.
pytest: setup
	$(BIN)/pytest -m 'not slow'

pytest-slow: setup
	$(BIN)/pytest -m slow

test: lint typecheck pytest

test-slow: pytest-slow

test-all: test test-slow

run: setup
	$(BIN)/faceflow up --demo

demo: setup
	$(BIN)/faceflow demo

bench: setup
	$(BIN)/python bench/pipeline.py

clean:
	rm -rf $(VENV) .faceflow .pytest_cache .mypy_cache .ruff_cache
