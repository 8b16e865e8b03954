#!/usr/bin/env bash
# Rewrites: ruff's safe lint fixes (import order among them), then its formatter.
# What it cannot fix it lists; ./check.sh reports without changing anything.
set -euo pipefail
cd "$(dirname "$0")"
ruff check --fix --exit-zero --quiet .
ruff format .
