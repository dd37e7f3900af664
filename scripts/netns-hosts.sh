#!/usr/bin/env bash
# Several "hosts" on one machine for measuring what crosses a network (issue 20): network namespaces
# rtx-h0..rtx-h(N-1), each with a veth pair into one bridge (rtx-br0) in the root namespace, addresses
# 10.77.0.(i+1)/24 inside, MTU 9000 (a datacenter link) unless MTU says otherwise, and optionally shaped
# with netem (DELAY, e.g. "100us"; RATE, e.g. "25gbit") on each host's side.
#
#   sudo scripts/netns-hosts.sh up 4          # make 4 hosts (idempotent: removes old ones first)
#   sudo scripts/netns-hosts.sh check 4       # each host pings every other over the bridge
#   ip netns exec rtx-h2 COMMAND              # run COMMAND on host 2 (its address: 10.77.0.3)
#   sudo scripts/netns-hosts.sh down 4
#
# Everything it makes lives in its own namespaces and one bridge with a private /24; nothing is routed
# outside. Needs root (CAP_NET_ADMIN) and iproute2.
set -euo pipefail
ACTION=${1:?usage: netns-hosts.sh up|check|down N}
N=${2:-4}
MTU=${MTU:-9000}
BR=rtx-br0

down() {
    for i in $(seq 0 $((N - 1))); do
        ip netns del "rtx-h$i" 2>/dev/null || true
        ip link del "rtx-v$i" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
}

up() {
    down
    ip link add "$BR" type bridge
    ip link set "$BR" mtu "$MTU" up
    for i in $(seq 0 $((N - 1))); do
        ns="rtx-h$i"
        ip netns add "$ns"
        ip link add "rtx-v$i" mtu "$MTU" type veth peer name eth0 netns "$ns"
        ip link set "rtx-v$i" master "$BR" up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 mtu "$MTU" up
        ip -n "$ns" link set lo up
        if [ -n "${DELAY:-}${RATE:-}" ]; then
            ip netns exec "$ns" tc qdisc add dev eth0 root netem ${DELAY:+delay "$DELAY"} ${RATE:+rate "$RATE"}
        fi
    done
}

check() {
    # One datagram of MTU - 28 bytes (IP + UDP headers) with "don't fragment", host i -> host j, read on j.
    local payload=$((MTU - 28))
    for i in $(seq 0 $((N - 1))); do
        for j in $(seq 0 $((N - 1))); do
            [ "$i" = "$j" ] && continue
            ip netns exec "rtx-h$j" python3 -c "
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('10.77.0.$((j + 1))', 7777)); s.settimeout(3)
data, _ = s.recvfrom(65535); sys.exit(0 if len(data) == $payload else 1)" &
            local reader=$!
            sleep 0.2
            ip netns exec "rtx-h$i" python3 -c "
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
s.sendto(b'x' * $payload, ('10.77.0.$((j + 1))', 7777))"
            wait "$reader" || { echo "netns-hosts: host $i cannot reach host $j with $MTU-byte packets" >&2; exit 1; }
        done
    done
    echo "netns-hosts: $N hosts, every pair reachable with $MTU-byte packets"
}

case "$ACTION" in
    up) up; check ;;
    check) check ;;
    down) down ;;
    *) echo "usage: netns-hosts.sh up|check|down N" >&2; exit 2 ;;
esac
