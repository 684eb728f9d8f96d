# plexserve: `make serve` runs the main job, `make test` runs the test suite. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.plexserve-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install serve test

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	@echo "plexserve: starting a local Ray and serving configs/local.yaml"
	@echo "  embed:     curl -X POST http://127.0.0.1:8000/v1/models/minilm/embed -d '{\"texts\": [\"hello world\"]}'"
	@echo "  models:    curl http://127.0.0.1:8000/v1/models"
	@echo "  dashboard: http://127.0.0.1:8265"
	@echo "  ingress:   Serve's HAProxy ingress (rayserve_apps/fast_ingress.py)"
	$(PY) -m rayserve_apps.fast_ingress configs/local.yaml

# ruff first (configuration in pyproject.toml): a lint error fails in seconds, before the slow tests.
test: install
	$(VENV)/bin/ruff check .
	RAY_AUTH_MODE=disabled $(VENV)/bin/pytest -q
