#!/usr/bin/env bash
# Fetch, on this (CPU) machine, the wheels the lent GPU machine lacks (it has torch, accelerate,
# transformers, peft and safetensors for Python 3.12), into .whl/ (git-ignored).
# On the GPU machine, install them with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$@"; }
# antlr4 4.9.3 (what omegaconf 2.3 needs) is published as an sdist only: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
get diffusers==0.42.1 hydra-core==1.3.8 omegaconf==2.3.1 bitsandbytes==0.50.2 \
    pytest==9.0.3 pluggy iniconfig pillow==13.0.0 importlib_metadata zipp
ls -la .whl
