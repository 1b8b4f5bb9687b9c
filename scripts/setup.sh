#!/usr/bin/env bash
# Create .venv and install shardpack with its test dependencies. torch==2.13.0 first: on these
# machines that pin is a CPU build on local disk; any other pin downloads gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
