#!/usr/bin/env bash
# Lint, format check and type check of the package and the launcher, with the configuration in
# pyproject.toml ([tool.ruff], [tool.mypy]); ruff and mypy come with the test extra (pip install -e '.[test]').
# Any finding fails the command; every check runs, so one run lists them all.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
ruff check recipecache launcher || status=1
ruff format --check recipecache launcher || status=1
mypy recipecache launcher || status=1
exit "$status"
