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
#   REDIS_PROJECTS_DIR             optional: one file per project, named after the project's
#                                  recipecache namespace and holding its password (two lines
#                                  during a rotation). Each becomes a user rc-<namespace> with the
#                                  job user's commands on that namespace's keys only, so a project
#                                  can neither read nor overwrite another's artifacts (missing or
#                                  empty: no project users)
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

# Prints " #<sha256 of password $2>" after checking it ($1: the file it came from, for errors).
hash_password() {
    case $2 in
        *[!A-Za-z0-9._~-]*) die "$1: password has characters outside [A-Za-z0-9._~-]" ;;
    esac
    [ "${#2}" -ge 16 ] || die "$1: password shorter than 16 characters"
    printf ' #%s' "$(printf '%s' "$2" | sha256sum | cut -d ' ' -f 1)"
}

# Prints " #<sha256 of the password in file $1>".
hash_rule() {
    [ -r "$1" ] || die "cannot read password file $1"
    hash_password "$1" "$(cat "$1")"
}

# Prints one "user rc-<namespace> ..." line for the project password file $1: the rules of the
# job user line $2 (its commands), confined to the namespace's keys in both key layouts
# (rc:<kind>:<ns>/... and, on a cluster, rc:<kind>:{<ns>/...}).
project_user() {
    ns=$(basename "$1")
    case $ns in
        [A-Za-z0-9]*) ;;
        *) die "$1: a project file is named after its namespace ([A-Za-z0-9][A-Za-z0-9._-]*)" ;;
    esac
    case $ns in
        *[!A-Za-z0-9._-]*) die "$1: a project file is named after its namespace ([A-Za-z0-9][A-Za-z0-9._-]*)" ;;
    esac
    [ "${#ns}" -le 64 ] || die "$1: a namespace has at most 64 characters"
    [ -r "$1" ] || die "cannot read password file $1"
    rules=""
    while IFS= read -r pw || [ -n "$pw" ]; do
        [ -n "$pw" ] || continue
        rule=$(hash_password "$1" "$pw") || exit 2
        rules="$rules$rule"
    done <"$1"
    [ -n "$rules" ] || die "$1: no password"
    commands=$(printf '%s\n' "$2" | sed -n 's/^user recipecache on .* ~rc:\* resetchannels //p')
    [ -n "$commands" ] || die "users.acl.template: no job user line to copy the commands from"
    printf 'user rc-%s on%s ~rc:?:%s/* ~rc:?:{%s/* resetchannels %s\n' "$ns" "$rules" "$ns" "$ns" "$commands"
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
projects=${REDIS_PROJECTS_DIR:-}
if [ -n "$projects" ] && [ -d "$projects" ]; then
    job_user=$(grep '^user recipecache ' "$acl_file.tmp")
    for file in "$projects"/*; do  # not dotfiles: a Kubernetes Secret volume's ..data links
        [ -e "$file" ] || continue
        project_user "$file" "$job_user" >>"$acl_file.tmp" || exit 2
    done
fi
mv "$acl_file.tmp" "$acl_file"
