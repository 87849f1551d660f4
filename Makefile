# Orrery — `make demo` serves the portal on the embedded default; `make test` runs the whole
# suite on PostgreSQL and Redis (started or installed by scripts/test-services.sh when absent).

VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh $(VENV)
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python manage.py demo $(if $(PORT),--port $(PORT),)

test: $(STAMP)
	scripts/test.sh $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
