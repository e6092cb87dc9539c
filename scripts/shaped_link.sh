#!/usr/bin/env bash
# Two "hosts" on one machine for the disaggregated hand-off: network namespaces
# $NS_PREFILL and $NS_DECODE joined by a veth pair whose egress `tc tbf` limits to
# RATE in both directions, so KV written prefill -> decode over UCX/TCP crosses a
# link of known speed (python -m client.bench_disagg --shaped-link uses it).
#
#   scripts/shaped_link.sh up [RATE]    create (or re-shape) the link; RATE as tc takes it
#                                       (default 200mbit); idempotent
#   scripts/shaped_link.sh down         remove both namespaces (and so the veth pair); idempotent
#   scripts/shaped_link.sh status       namespaces, addresses, qdiscs and their counters
#
# Environment: NS_PREFILL (tdm-prefill), NS_DECODE (tdm-decode), DEV_PREFILL (tdm-p),
# DEV_DECODE (tdm-d), ADDR_PREFILL (10.213.7.1), ADDR_DECODE (10.213.7.2), BURST (64kb).
# Needs root and iproute2 (ip netns, tc). Only the addresses above are used: nothing
# leaves the machine, and `down` leaves nothing behind.
set -euo pipefail

NS_PREFILL=${NS_PREFILL:-tdm-prefill}
NS_DECODE=${NS_DECODE:-tdm-decode}
DEV_PREFILL=${DEV_PREFILL:-tdm-p}
DEV_DECODE=${DEV_DECODE:-tdm-d}
ADDR_PREFILL=${ADDR_PREFILL:-10.213.7.1}
ADDR_DECODE=${ADDR_DECODE:-10.213.7.2}
# tbf's bucket: small enough that the rate holds over a few ms, at least one GSO
# segment (64 KiB) so that veth's large packets are not split needlessly.
BURST=${BURST:-64kb}

has_ns() { ip netns list | awk '{print $1}' | grep -qx "$1"; }

in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

up() {
    local rate=${1:-200mbit}
    has_ns "$NS_PREFILL" || ip netns add "$NS_PREFILL"
    has_ns "$NS_DECODE" || ip netns add "$NS_DECODE"
    if ! in_ns "$NS_PREFILL" ip link show "$DEV_PREFILL" >/dev/null 2>&1; then
        # a half-made pair from an interrupted run would block the `add`
        ip link del "$DEV_PREFILL" 2>/dev/null || true
        ip link add "$DEV_PREFILL" type veth peer name "$DEV_DECODE"
        ip link set "$DEV_PREFILL" netns "$NS_PREFILL"
        ip link set "$DEV_DECODE" netns "$NS_DECODE"
    fi
    for side in "$NS_PREFILL $DEV_PREFILL $ADDR_PREFILL" "$NS_DECODE $DEV_DECODE $ADDR_DECODE"; do
        set -- $side
        in_ns "$1" ip addr replace "$3/30" dev "$2"
        in_ns "$1" ip link set lo up
        in_ns "$1" ip link set "$2" up
        # both directions: KV goes prefill -> decode, acks and control come back
        in_ns "$1" tc qdisc replace dev "$2" root tbf rate "$rate" burst "$BURST" latency 50ms
    done
    echo "shaped link up: $NS_PREFILL/$DEV_PREFILL $ADDR_PREFILL <-> $NS_DECODE/$DEV_DECODE $ADDR_DECODE, tbf rate $rate"
}

down() {
    # deleting a namespace deletes the veth end inside it, and with it the pair
    for ns in "$NS_PREFILL" "$NS_DECODE"; do
        if has_ns "$ns"; then ip netns del "$ns"; fi
    done
    ip link del "$DEV_PREFILL" 2>/dev/null || true
    echo "shaped link down"
}

status() {
    for side in "$NS_PREFILL $DEV_PREFILL" "$NS_DECODE $DEV_DECODE"; do
        set -- $side
        if ! has_ns "$1"; then echo "$1: absent"; continue; fi
        echo "== $1"
        in_ns "$1" ip -brief addr show dev "$2" || true
        in_ns "$1" tc -s qdisc show dev "$2" || true
    done
}

if [[ $EUID -ne 0 ]]; then
    echo "shaped_link.sh: needs root (ip netns, tc)" >&2
    exit 2
fi
case "${1:-}" in
    up) up "${2:-}" ;;
    down) down ;;
    status) status ;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
