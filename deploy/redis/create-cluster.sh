#!/bin/sh
# Joins the Redis nodes given as host:port into a Redis Cluster for recipecache, once:
#
#   create-cluster.sh host:port host:port ...     (at least 3 primaries' worth of nodes)
#
# Waits up to $REDIS_CLUSTER_WAIT_S seconds (default 300) for every node to answer, resolves
# names to addresses (redis-cli --cluster create wants addresses), then creates the cluster with
# $REDIS_CLUSTER_REPLICAS replicas per primary (default 1) as the admin user (password from
# $REDIS_ADMIN_PASSWORD_FILE, passed in the environment, never on the command line). Nodes that
# already form a cluster are left alone (exit 0), so the Kubernetes Job and the compose service
# may run again. TLS when REDIS_TLS=1 (CA from $REDIS_TLS_CA, default /tls/ca.crt).
set -eu

[ "$#" -ge 3 ] || { echo "usage: create-cluster.sh host:port host:port host:port ..." >&2; exit 2; }
REDISCLI_AUTH=$(cat "${REDIS_ADMIN_PASSWORD_FILE:?set REDIS_ADMIN_PASSWORD_FILE}")
export REDISCLI_AUTH
tls=""
if [ "${REDIS_TLS:-0}" = 1 ]; then
    tls="--tls --cacert ${REDIS_TLS_CA:-/tls/ca.crt}"
fi
wait=${REDIS_CLUSTER_WAIT_S:-300}

addresses=""
for node in "$@"; do
    host=${node%:*}
    port=${node##*:}
    tries=0
    while :; do
        address=$(getent hosts "$host" | awk '{ print $1; exit }') || address=""
        # shellcheck disable=SC2086
        if [ -n "$address" ] && redis-cli $tls --user admin -h "$address" -p "$port" ping >/dev/null 2>&1; then
            break
        fi
        tries=$((tries + 1))
        [ "$tries" -lt "$wait" ] || { echo "create-cluster: $node did not answer in $wait s" >&2; exit 1; }
        sleep 1
    done
    addresses="$addresses $address:$port"
done

first=${addresses# }
first=${first%% *}
# shellcheck disable=SC2086
known=$(redis-cli $tls --user admin -h "${first%:*}" -p "${first##*:}" cluster info | tr -d '\r' |
    sed -n 's/^cluster_known_nodes://p')
if [ "${known:-1}" -gt 1 ]; then
    echo "create-cluster: the nodes already form a cluster"
    exit 0
fi
# shellcheck disable=SC2086
exec redis-cli $tls --user admin --cluster create $addresses --cluster-replicas "${REDIS_CLUSTER_REPLICAS:-1}" \
    --cluster-yes
