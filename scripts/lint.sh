#!/usr/bin/env bash
# Lint, format check and type check of the package and the launcher, with the configuration in
# pyproject.toml ([tool.ruff], [tool.mypy]); ruff and mypy come with the test extra (pip install -e '.[test]')
# into the python named by $PYTHON (default python3), which runs them (a fresh install's console scripts may
# not be on PATH yet).
# Any finding fails the command; every check runs, so one run lists them all.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
status=0
"$python" -m ruff check recipecache launcher || status=1
"$python" -m ruff format --check recipecache launcher || status=1
"$python" -m mypy recipecache launcher || status=1
exit "$status"
