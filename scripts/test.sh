#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, lint and type-check the package and the
# launcher (scripts/lint.sh: ruff and mypy, configured in pyproject.toml), then run the tests on the
# three supported torch releases, the newest (the one users move to) first:
#   1. the whole suite on torch 2.15.0, in an environment of its own ($RECIPECACHE_TEST_VENV_2_15,
#      default ~/.cache/recipecache/venv-torch2.15; a CUDA build of ~5.3 GB, which runs on CPU), with the
#      frameworks the corpus of others' programs uses (the `corpus` extra: Lightning, Accelerate,
#      Transformers, diffusers, torch_geometric, torchvision; tests/corpus). Its
#      one pip call (torch and this checkout together) reads no pip configuration
#      (PIP_CONFIG_FILE=/dev/null): a machine's configuration may cap torch below 2.15 (these
#      machines cap it at 2.14.1, the releases kept as local files), and a later call under the cap
#      would replace torch;
#   2. the tests marked `internals` (each of recipecache's hooks into torch's internals exercised
#      once, in one process or the smallest job: what differs between releases) on torch 2.14.1, in
#      a second environment ($RECIPECACHE_TEST_VENV_2_14, default ~/.cache/recipecache/venv-torch2.14);
#   3. the same on CPU torch 2.13.0, this python: CPU torch first (a bare `torch` requirement would
#      pull several GB of CUDA wheels); 2 and 3 run side by side.
# Each environment is created on the first run and reused by later runs and fresh clones on the
# same machine (each install takes minutes), with this checkout installed into it (editable) each
# time; Debian's redis-server is installed if missing (the tests start their own redis-server
# processes on 127.0.0.1). All runs must pass: any pytest failure, including exit 5 (nothing
# collected), fails the command, as does any lint or type finding. Arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv_2_15=${RECIPECACHE_TEST_VENV_2_15:-$HOME/.cache/recipecache/venv-torch2.15}
venv_2_14=${RECIPECACHE_TEST_VENV_2_14:-$HOME/.cache/recipecache/venv-torch2.14}

make_venv() {
  if [ ! -x "$1/bin/python" ]; then
    mkdir -p "$(dirname "$1")"
    python3 -m venv "$1"
  fi
}

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
if ! command -v redis-server >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q redis-server
fi
make_venv "$venv_2_15"
PIP_CONFIG_FILE=/dev/null "$venv_2_15/bin/python" -m pip install -q torch==2.15.0 -e '.[test,corpus]'
make_venv "$venv_2_14"
"$venv_2_14/bin/python" -m pip install -q torch==2.14.1 -e '.[test]'

status_lint=0
echo "== lint and types (ruff, mypy)"
PYTHON=python3 bash scripts/lint.sh || status_lint=$?

# each run's output is also kept in a log, so that the end of this command's output can name every failed test:
# a CI that shows only the last lines of a long run otherwise shows which release failed but not which test
failed_tests() {  # $1 the run's torch release, $2 its log: the short test summary's FAILED and ERROR lines
  grep -h -E '^(FAILED|ERROR) ' "$2" | sed "s/^/torch $1: /" || true
}

# each venv's bin first on PATH, as if activated: a test that starts an installed console script gets that venv's
status_2_15=0
log_2_15=$(mktemp)
echo "== torch 2.15.0 ($venv_2_15): all tests"
PATH="$venv_2_15/bin:$PATH" "$venv_2_15/bin/python" -m pytest "$@" 2>&1 | tee "$log_2_15" || status_2_15=$?
# the two internals runs side by side (each mostly one process compiling at a time; together about the time of
# one), each under its own pytest temporary root; torch 2.14.1's output is printed whole once both ended
status_2_14=0
status_2_13=0
log_2_14=$(mktemp)
log_2_13=$(mktemp)
temp_2_14=$(mktemp -d)
temp_2_13=$(mktemp -d)
echo  # a line of its own: what the last run wrote may not have ended one (a library's leak report at exit)
echo "== torch 2.14.1 ($venv_2_14) and torch 2.13.0 (python3), side by side: the tests marked internals"
PYTEST_DEBUG_TEMPROOT="$temp_2_14" PATH="$venv_2_14/bin:$PATH" "$venv_2_14/bin/python" -m pytest -m internals "$@" \
  >"$log_2_14" 2>&1 &
pid_2_14=$!
echo "== torch 2.13.0 (python3): the tests marked internals"
PYTEST_DEBUG_TEMPROOT="$temp_2_13" python3 -m pytest -m internals "$@" 2>&1 | tee "$log_2_13" || status_2_13=$?
wait "$pid_2_14" || status_2_14=$?
echo "== torch 2.14.1 ($venv_2_14): the tests marked internals"
cat "$log_2_14"
echo "== failed tests (the short test summaries' FAILED and ERROR lines; none when every run passed)"
failed_tests 2.15.0 "$log_2_15"
failed_tests 2.14.1 "$log_2_14"
failed_tests 2.13.0 "$log_2_13"
rm -rf "$log_2_15" "$log_2_14" "$log_2_13" "$temp_2_14" "$temp_2_13"
echo "== exit status: lint and types $status_lint; pytest: torch 2.15.0 (all tests) $status_2_15," \
     "torch 2.14.1 (internals) $status_2_14, torch 2.13.0 (internals) $status_2_13"
if [ "$status_lint" -ne 0 ] || [ "$status_2_15" -ne 0 ] || [ "$status_2_14" -ne 0 ] || [ "$status_2_13" -ne 0 ]; then
  exit 1
fi
