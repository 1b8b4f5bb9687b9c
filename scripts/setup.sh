#!/usr/bin/env bash
# Create .venv and install shardpack with its test, interop and ray extras. torch==2.13.0 first: on these
# machines that pin is a CPU build on local disk; any other pin downloads gigabytes. Everything goes into
# .venv: no system package is installed (the FUSE tests skip, naming fuse3, without libfuse 3; .ci/run
# installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "setup: installing into .venv (about 1.9 GB, nothing outside it): torch 2.13.0, then shardpack with its" \
     "test, interop and ray extras (pytest, webdataset, simplejpeg, Hugging Face datasets, Ray 2.60 for" \
     "--engine ray and its tests, ...); no system packages"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q torch==2.13.0
# test: pytest and what the tests use (torch, webdataset, simplejpeg, mfusepy, matplotlib, lightning);
# interop: webdataset and Hugging Face datasets, for the snippets of docs/interop.md;
# ray: --engine ray and its 2-node tests (tests/test_ray.py)
.venv/bin/pip install -q -e '.[test,interop,ray]'
