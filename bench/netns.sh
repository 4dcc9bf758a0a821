#!/usr/bin/env bash
# Run a command inside a fresh network namespace whose loopback is rate-limited with tc tbf,
# so gloo traffic between local ranks costs wall time on a "link" instead of being nearly free.
#
#   bash bench/netns.sh <command> [args...]        RATE=2gbit (default) BURST=256kb
#
# The namespace is always deleted on exit. Exit status: the command's, or 3 when the
# namespace cannot be set up (no root, no iproute2, no tbf qdisc).
set -u

RATE="${RATE:-2gbit}"
BURST="${BURST:-256kb}"
NS="mpo-bench-$$"

explain() {
    # Builtins only: this also runs when PATH lacks the tools.
    printf '%s\n' >&2 \
        "bench/netns.sh: cannot set up a rate-limited loopback ($1). It needs root (or" \
        "CAP_NET_ADMIN and CAP_SYS_ADMIN) to create a network namespace with 'ip netns add'," \
        "iproute2's 'ip' and 'tc' on PATH, and the kernel's tbf queueing discipline (sch_tbf) to" \
        "cap the namespace's loopback at RATE=$RATE. Run it as root on a machine that has them, or" \
        "run the benchmark without the limit (python -m bench.dp_overlap), knowing that on a bare" \
        "loopback communication costs CPU rather than link time, so overlap shows little."
    exit 3
}

if [ "$#" -eq 0 ]; then
    echo "usage: bash bench/netns.sh <command> [args...]" >&2
    exit 2
fi
command -v ip >/dev/null 2>&1 || explain "'ip' (iproute2) not found"
command -v tc >/dev/null 2>&1 || explain "'tc' (iproute2) not found"
[ "$(id -u)" -eq 0 ] || explain "not running as root"

cleanup() { ip netns del "$NS" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$NS" 2>/dev/null || explain "'ip netns add' failed"
ip netns exec "$NS" ip link set lo up || explain "could not bring up lo in the namespace"
ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$RATE" burst "$BURST" latency 100ms \
    || explain "'tc qdisc add ... tbf' failed"

export MPO_BENCH_LINK="loopback in a network namespace, tc tbf rate $RATE burst $BURST latency 100ms"
ip netns exec "$NS" "$@"
