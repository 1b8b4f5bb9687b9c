#!/usr/bin/env bash
# Set up .venv, then run the main job end to end on a generated sample tree.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/shardpack demo
