# Everything a fresh clone needs: `make run` serves, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
TEST_WORKERS ?= auto
TESTS ?=
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install run test lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

run: install
	LOG_FORMAT=$${LOG_FORMAT:-text} $(BIN)/agent-runner serve --port $(PORT)

# One test process per CPU: most of the suite waits on the servers it starts.
test: install
	$(BIN)/pytest --numprocesses $(TEST_WORKERS) --dist worksteal $(TESTS)

lint: install
	$(BIN)/ruff check app tests migrations
	$(BIN)/ruff format --check app tests migrations
	$(BIN)/mypy app tests
	$(BIN)/hadolint Dockerfile

format: install
	$(BIN)/ruff format app tests migrations
	$(BIN)/ruff check --fix app tests migrations

clean:
	rm -rf $(VENV) .venv-newer .mypy_cache .ruff_cache .pytest_cache *.egg-info
