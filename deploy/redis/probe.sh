#!/bin/sh
# Health probe for recipecache's Redis (Kubernetes liveness/readiness, compose healthcheck).
#
#   probe.sh live    the server answers: PONG, NOAUTH or LOADING all count. Unauthenticated on
#                    purpose: a password mid-rotation must never get a healthy server restarted.
#   probe.sh ready   the recipecache user (password from $REDIS_PASSWORD_FILE) authenticates
#                    and PING answers PONG: the server is loaded and the job credentials work.
#
# Talks TLS when REDIS_TLS=1 (CA from $REDIS_TLS_CA, default /tls/ca.crt). Port: $REDIS_PORT.
set -eu

set -- "${1:-}" -h 127.0.0.1 -p "${REDIS_PORT:-6379}"
if [ "${REDIS_TLS:-0}" = 1 ]; then
    set -- "$@" --tls --cacert "${REDIS_TLS_CA:-/tls/ca.crt}"
fi
mode=$1
shift

case $mode in
    live)
        reply=$(redis-cli "$@" ping 2>&1) || true
        case $reply in
            PONG | NOAUTH* | LOADING*) exit 0 ;;
        esac
        ;;
    ready)
        # REDISCLI_AUTH keeps the password out of the process list.
        reply=$(REDISCLI_AUTH=$(cat "${REDIS_PASSWORD_FILE:?set REDIS_PASSWORD_FILE}") \
            redis-cli "$@" --user recipecache ping 2>&1) || true
        [ "$reply" = PONG ] && exit 0
        ;;
    *)
        echo "usage: probe.sh live|ready" >&2
        exit 2
        ;;
esac
echo "probe $mode: $reply" >&2
exit 1
