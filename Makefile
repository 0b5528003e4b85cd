# slogate — two commands on a fresh machine:
#   make demo    run the gateway in front of the built-in engine simulator, drive a short load
#   make test    install what the tests need and run them
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DURATION ?=
STAMP := $(VENV)/.slogate-installed
DEMO_STAMP := $(VENV)/.slogate-demo-installed

.PHONY: demo lint test test-fast bench bench-slow bench-goodput bench-faults bench-workers deploy-generate soak soak-hostile serve sim system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# The demo needs the runtime and the openai SDK only (not the test and bench extras).
$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make demo: installing slogate and the openai SDK into $(VENV) (once; ~30 s)"
	@start=$$(date +%s); $(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q --progress-bar off -e '.[demo]' && \
		echo "make demo: installed in $$(( $$(date +%s) - start )) s"
	@touch $@

demo: $(DEMO_STAMP)
	$(PY) -m gateway demo $(if $(DURATION),--duration $(DURATION))

# Debian packages the tests drive for real (prometheus, nginx, redis-server, docker-compose,
# build tools for llama.cpp, node/npm for the dashboard schema check).
system-deps:
	bash scripts/install-system-deps.sh

# Grafana's own TypeScript schema, to type-check the dashboard (npm registry, pinned lockfile).
dashboards/schema-check/node_modules: dashboards/schema-check/package-lock.json
	cd dashboards/schema-check && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Static checks: ruff (style, imports, likely bugs) and mypy (strict, over the files that
# pyproject.toml lists: everything shipped or run).
lint: $(STAMP)
	$(VENV)/bin/ruff check gateway backends tests benchmarks deploy dashboards
	$(VENV)/bin/mypy

# The suite on TEST_WORKERS processes (pytest-xdist; the heaviest load tests share one group, so
# they never overlap): ~4.5 min on 2 cores, ~8 in one (TEST_WORKERS=0).
TEST_WORKERS ?= 2

test: lint $(STAMP) system-deps dashboards/schema-check/node_modules
	bash scripts/install-llamacpp.sh $(PY)
	bash scripts/install-kustomize.sh $(PY)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# Unit and integration tests only: no Debian services, no lint (tests/system/ needs them), on
# two processes (pytest-xdist: ~60 s on 2 cores, ~100 s in one).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit tests/integration

# Streaming overhead, gateway and nginx vs direct (BENCH_ARGS=--quick for a smoke run;
# BENCH_ARGS="--baseline main --reps 3" adds main's gateway, interleaved), then the paced-stream
# lane (bench-results/paced.md; BENCH_ARGS=--paced for the lane alone, --no-paced without it).
bench: $(STAMP)
	$(PY) -m benchmarks.overhead --out bench-results/overhead.json --markdown bench-results/overhead.md $(BENCH_ARGS)

# Long-lived slow streams (1,000 and 5,000 at one token per second): CPU and RSS per stream.
bench-slow: $(STAMP)
	$(PY) -m benchmarks.overhead --slow 1000,5000 --out bench-results/slow.json --markdown bench-results/slow.md $(BENCH_ARGS)

# Throughput with --workers 1 and 2 at 64 and 256 streams (gateway CPU per token, share per worker).
bench-workers: $(STAMP)
	$(PY) -m benchmarks.workers --out bench-results/workers.json --markdown bench-results/workers.md

# Kubernetes: regenerate deploy/'s monitoring files from dashboards/ (one source).
deploy-generate: $(STAMP)
	$(PY) deploy/generate.py

# Goodput with SLO-aware admission vs pass-through under overload (QUICK=1 for a smoke run).
bench-goodput: $(STAMP)
	$(PY) -m benchmarks.goodput $(if $(QUICK),--quick)

# P99 TTFT, goodput and extra tokens with one replica stalling 5 % of first tokens, with and
# without the first-token race (FAULTS_ARGS="--seconds 60" for a longer run).
bench-faults: $(STAMP)
	$(PY) -m benchmarks.faults --out bench-results $(FAULTS_ARGS)

# Soak with fault injection at ~70 % of the simulator's capacity; fails on leaks
# (SOAK_S=seconds, default 600).
soak: $(STAMP)
	SOAK_S=$${SOAK_S:-600} $(PY) -m benchmarks.soak --out bench-results

# Hostile soak: the gateway in front of the simulator and a hostile upstream, 20 good streams
# (byte-exact) and hostile clients at once; fails on a stream not byte-exact, RSS growth after
# warm-up, RSS not back or descriptors not back (SOAK_S=seconds, default 300).
soak-hostile: $(STAMP)
	$(PY) -m benchmarks.soak_hostile --seconds $${SOAK_S:-300} --out bench-results

serve: $(STAMP)
	$(VENV)/bin/slogate serve --config gateway/examples/sim.toml

sim: $(STAMP)
	$(VENV)/bin/slogate sim --served-model-name sim-llama-8b

# Everything the targets above create in the tree (caches outside it, such as the llama.cpp
# wheel in ~/.cache/slogate, are kept: they make the next `make test` fast).
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis bench-results build dist *.egg-info \
		dashboards/schema-check/node_modules
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
