#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, then run it on both supported torch releases:
#   1. the whole suite on CPU torch 2.13.0 (this python): CPU torch first (a bare `torch`
#      requirement would pull several GB of CUDA wheels), the project with its test extra, and
#      Debian's redis-server if it is missing (the tests start their own redis-server processes
#      on 127.0.0.1);
#   2. the tests marked torch or multirank (the ones that run torch's internals) again on
#      torch 2.14.1, in a second environment ($RECIPECACHE_TEST_VENV, default
#      ~/.cache/recipecache/venv-torch2.14): created on the first run and reused by later runs
#      and fresh clones on the same machine (its ~5.5 GB install takes minutes), with this
#      checkout installed into it (editable) each time.
# Both runs must pass: any pytest failure, including exit 5 (nothing collected), fails the
# command. Arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
second_torch=2.14.1
venv=${RECIPECACHE_TEST_VENV:-$HOME/.cache/recipecache/venv-torch2.14}

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
if ! command -v redis-server >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q redis-server
fi
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q "torch==$second_torch"
"$venv/bin/python" -m pip install -q -e '.[test]'

first=0
python3 -m pytest "$@" || first=$?
echo "== torch $second_torch ($venv): the tests marked torch or multirank"
second=0
"$venv/bin/python" -m pytest -m "torch or multirank" "$@" || second=$?
echo "== pytest exit status: torch 2.13.0 (all tests) $first, torch $second_torch (torch or multirank) $second"
if [ "$first" -ne 0 ] || [ "$second" -ne 0 ]; then
  exit 1
fi
