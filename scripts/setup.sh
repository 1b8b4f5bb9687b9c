#!/usr/bin/env bash
# Create .venv and install shardpack with its test and interop extras. torch==2.13.0 first: on these
# machines that pin is a CPU build on local disk; any other pin downloads gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
# libfuse 3 for the slow-filesystem tests (tests/slowfs.py); optional: they skip without it
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v fusermount3 >/dev/null; then
    (apt-get install -y -q fuse3 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
        apt-get install -y -q fuse3 >/dev/null 2>&1; }) || echo "setup: could not install fuse3; FUSE tests will skip" >&2
fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q torch==2.13.0
# test: pytest and what the tests use (torch, webdataset, simplejpeg, mfusepy, matplotlib, lightning);
# interop: webdataset and Hugging Face datasets, for the snippets of docs/interop.md;
# ray: --engine ray and its 2-node tests (tests/test_ray.py)
.venv/bin/pip install -q -e '.[test,interop,ray]'
