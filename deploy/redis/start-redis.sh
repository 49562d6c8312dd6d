#!/bin/sh
# Container entrypoint for recipecache's Redis (compose and Kubernetes): render the ACL file from
# the password files, then exec redis-server with redis.conf, plus tls.conf when REDIS_TLS=1.
# Extra arguments go to redis-server (they override redis.conf).
set -eu

here=$(dirname "$0")
sh "$here/render-acl.sh"
if [ "${REDIS_TLS:-0}" = 1 ]; then
    set -- --include "$here/tls.conf" "$@"
fi
exec redis-server "$here/redis.conf" "$@"
