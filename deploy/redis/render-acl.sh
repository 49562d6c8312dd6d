#!/bin/sh
# Renders users.acl.template into the ACL file redis-server loads ($REDIS_ACL_FILE, default
# /data/users.acl). Passwords are read from files (Kubernetes Secret / compose secrets), never
# from the command line, and written as SHA-256 hashes ("#<hex>" ACL rules).
#
#   REDIS_PASSWORD_FILE            the recipecache user's password (required)
#   REDIS_PREVIOUS_PASSWORD_FILE   a second, still-accepted password during a rotation
#                                  (optional: unset, missing or blank means none)
#   REDIS_ADMIN_PASSWORD_FILE      the admin user's password (required)
#   REDIS_CLUSTER                  1: a Redis Cluster node; the job user also gets the commands
#                                  the cluster client learns the topology with
#
# A password must be at least 16 characters from [A-Za-z0-9._~-]: it goes into redis:// URLs
# unescaped (`openssl rand -hex 32` gives one). Bad input: a one-line error, exit status 2.
set -eu

here=$(dirname "$0")
acl_file=${REDIS_ACL_FILE:-/data/users.acl}

die() {
    echo "render-acl: $*" >&2
    exit 2
}

# Prints " #<sha256 of the password in file $1>".
hash_rule() {
    [ -r "$1" ] || die "cannot read password file $1"
    pw=$(cat "$1")
    case $pw in
        *[!A-Za-z0-9._~-]*) die "$1: password has characters outside [A-Za-z0-9._~-]" ;;
    esac
    [ "${#pw}" -ge 16 ] || die "$1: password shorter than 16 characters"
    printf ' #%s' "$(printf '%s' "$pw" | sha256sum | cut -d ' ' -f 1)"
}

rc_rules=$(hash_rule "${REDIS_PASSWORD_FILE:?set REDIS_PASSWORD_FILE}")
previous=${REDIS_PREVIOUS_PASSWORD_FILE:-}
if [ -n "$previous" ] && [ -e "$previous" ]; then
    [ -r "$previous" ] || die "cannot read password file $previous"
    if [ -n "$(tr -d '[:space:]' <"$previous")" ]; then
        rc_rules="$rc_rules$(hash_rule "$previous")"
    fi
fi
admin_rules=$(hash_rule "${REDIS_ADMIN_PASSWORD_FILE:?set REDIS_ADMIN_PASSWORD_FILE}")
# recipecache.backends.redis_cluster.CLUSTER_ACL_COMMANDS
cluster_rules=""
if [ "${REDIS_CLUSTER:-0}" = 1 ]; then
    cluster_rules=" +cluster|slots +command +asking"
fi

umask 077
sed -e '/^#/d' -e '/^[[:space:]]*$/d' \
    -e "s/ @RECIPECACHE_PASSWORDS@/$rc_rules/" \
    -e "s/ @ADMIN_PASSWORDS@/$admin_rules/" \
    -e "s/ @CLUSTER_COMMANDS@/$cluster_rules/" \
    "$here/users.acl.template" >"$acl_file.tmp"
mv "$acl_file.tmp" "$acl_file"
