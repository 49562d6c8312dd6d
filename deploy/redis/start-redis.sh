#!/bin/sh
# Container entrypoint for recipecache's Redis (compose and Kubernetes): render the ACL file from
# the password files, then exec redis-server with redis.conf, plus tls.conf when REDIS_TLS=1 and
# cluster.conf when REDIS_CLUSTER=1. Extra arguments go to redis-server (they override redis.conf).
#
# A cluster node's replica authenticates to its primary as the admin user: the password goes into
# $REDIS_CLUSTER_AUTH_FILE (default /data/cluster-auth.conf, mode 600), never onto the command
# line. REDIS_CLUSTER_ANNOUNCE_HOSTNAME (Kubernetes: the pod's DNS name) makes clients reach the
# node by name, which survives the pod's restart on another address.
set -eu

here=$(dirname "$0")
sh "$here/render-acl.sh"
if [ "${REDIS_TLS:-0}" = 1 ]; then
    set -- --include "$here/tls.conf" "$@"
fi
if [ "${REDIS_CLUSTER:-0}" = 1 ]; then
    auth=${REDIS_CLUSTER_AUTH_FILE:-/data/cluster-auth.conf}
    (
        umask 077
        printf 'masteruser admin\nmasterauth %s\n' "$(cat "${REDIS_ADMIN_PASSWORD_FILE:?set REDIS_ADMIN_PASSWORD_FILE}")" \
            >"$auth.tmp"
        mv "$auth.tmp" "$auth"
    )
    set -- --include "$here/cluster.conf" --include "$auth" "$@"
    if [ -n "${REDIS_CLUSTER_ANNOUNCE_HOSTNAME:-}" ]; then
        set -- "$@" --cluster-announce-hostname "$REDIS_CLUSTER_ANNOUNCE_HOSTNAME" \
            --cluster-preferred-endpoint-type hostname
    fi
fi
exec redis-server "$here/redis.conf" "$@"
