#!/usr/bin/env bash
# Reports, changes nothing: format, lint, and types of the pippy package.
set -euo pipefail
cd "$(dirname "$0")"
ruff format --check .
ruff check .
mypy
