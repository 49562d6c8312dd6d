#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, then run the whole suite.
#   CPU torch 2.13.0 first (a bare `torch` requirement would pull several GB of CUDA wheels),
#   the project with its test extra, and Debian's redis-server if it is missing
#   (the tests start their own redis-server processes on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
if ! command -v redis-server >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q redis-server
fi
exec python3 -m pytest "$@"
