#!/bin/sh
# The container view of a kwok pod's exec.
#
# kwok runs every pod exec as a process on this host, in the pod's workdir and with the
# environment of the pod's Exec (podexec.py: the container's env plus SANDPOOL_WORKDIR,
# SANDPOOL_IMAGE_WORKDIR, ...). `cluster.py up` (kwoknodes.py) puts a directory first on
# kwok's PATH whose `sh` and `python3` are this script, so an exec of either (sandpool's
# per-command wrapper, its agent) gets what a container would give it:
#
# * a mount namespace of its own, in which the pod's workdir is bind-mounted at the
#   container's workingDir (SANDPOOL_IMAGE_WORKDIR, e.g. /testbed) and <workdir>.tmp at
#   /tmp, so paths are the image's and /tmp is the pod's, never the host's;
# * for `python3` (the agent of a session), also a pid namespace of its own with the
#   command as its pid 1 (`unshare --pid --fork`; the command is exec'd), as under the local
#   backend's `bwrap --as-pid-1`: the kernel drops every signal a process of the namespace
#   sends it that it has no handler for (SIGKILL and SIGSTOP included), so a policy's
#   `kill -9 -1` cannot end the session; the agent reaps the orphans its commands leave,
#   and when it ends every process of the namespace dies with it. `sh` execs (one per
#   command, when the agent cannot run) stay in the host's pid namespace, where the exec
#   wrapper finds a sandbox's processes by their environment marker.
#
# A process that is not a pod's exec (no SANDPOOL_WORKDIR) runs the real command untouched.
# Exit 125 with a `sandpool: ` line when the view cannot be set up (the exec channel reports
# it as a transport error). The real command is looked up on PATH without this directory.
set -f
if [ "${1-}" = --sandpool-view ]; then  # second stage, inside the new namespaces
    wd=$2 img=$3 tmp=$4
    shift 4
    # The workdir first: it may itself be under /tmp.
    { [ -z "$img" ] || { { [ -d "$img" ] || mkdir -p "$img"; } && mount --bind "$wd" "$img"; }; } \
        && { [ -d "$tmp" ] || mkdir -p "$tmp"; } && mount --bind "$tmp" /tmp \
        || { echo "sandpool: cannot set up the pod's filesystem view" >&2; exit 125; }
    exec "$@"
fi
self=$0 name=${0##*/} here=${0%/*} path=
IFS=:
for d in $PATH; do [ "$d" = "$here" ] || path=${path:+$path:}$d; done
unset IFS
PATH=$path
[ -n "${SANDPOOL_WORKDIR-}" ] || exec "$name" "$@"
case $name in python3) pid="--pid --fork --mount-proc" ;; *) pid= ;; esac
# shellcheck disable=SC2086 # $pid is a list of flags
exec unshare --mount --propagation private $pid -- /bin/sh "$self" --sandpool-view \
    "$SANDPOOL_WORKDIR" "${SANDPOOL_IMAGE_WORKDIR-}" "${SANDPOOL_WORKDIR%/}.tmp" "$name" "$@"
