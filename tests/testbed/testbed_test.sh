#!/bin/bash
# Tests of the leaf–spine testbed (bench/fabric/testbed.sh). One case per
# invocation, each on its own namespace prefix so that ctest may run them in
# parallel, each tearing its fabric down on exit, failure or interrupt.
# Assertions are on packet counts only, never on time.
# Usage: tests/testbed/testbed_test.sh up|ecmp|loss|failover|teardown|segment
# Exit 77 (ctest SKIP) when not root or `ip netns` is unavailable.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
testbed=$here/../../bench/fabric/testbed.sh
flows=$here/../../bench/fabric/udpflows.py
case_name=${1:?case}

if (($(id -u) != 0)) || ! ip netns list > /dev/null 2>&1; then
  echo "SKIP: needs root and ip netns"
  exit 77
fi
export STB_PREFIX="stbt-$case_name-"
trap '"$testbed" down' EXIT
trap 'exit 130' INT TERM  # an interrupt ends the test; the EXIT trap then tears down
fail() { echo "FAIL: $*"; "$testbed" status || true; exit 1; }

rx_packets() { "$testbed" exec "$1" "$2" cat /sys/class/net/eth0/statistics/rx_packets; }
spine_count() { "$testbed" counters | awk -v s="spine$1" '$1 == s {print $2}'; }
# Source ports in [from, from+n) whose flow host 1.1 -> host 2.1:9999 leaf 1 hashes onto spine S.
ports_on_spine() {
  local s=$1 from=$2 n=$3 p
  for ((p = from; p < from + n; p++)); do
    [[ $("$testbed" path 1 1 2 1 "$p" 9999) == "$s" ]] && echo "$p"
  done
  return 0
}
send() {  # COUNT_PER_PORT SPORT... from host 1.1 to host 2.1
  local count=$1
  shift
  "$testbed" exec 1 1 python3 "$flows" 10.1.1.2 10.2.1.2 9999 "$count" "$@" > /dev/null
}

"$testbed" up --spines 2 --hosts 2 > /dev/null

case $case_name in
  up)
    # Every host reaches every other host through the fabric (UDP, counted at the receiver).
    for src in "1 1" "1 2" "2 1" "2 2"; do
      for dst in "1 1" "1 2" "2 1" "2 2"; do
        [[ $src == "$dst" ]] && continue
        set -- $src $dst
        before=$(rx_packets "$3" "$4")
        "$testbed" exec "$1" "$2" python3 "$flows" "10.$1.$2.2" "10.$3.$4.2" 9999 10 40000 > /dev/null
        after=$(rx_packets "$3" "$4")
        ((after - before >= 10)) || fail "host $1.$2 -> $3.$4: $((after - before)) of 10 datagrams arrived"
      done
    done
    ;;

  ecmp)
    # 16 flows differing in source port: the ECMP hash (policy 1, L4) puts
    # some on each spine, and each spine forwards what the route lookup said.
    sports=$(seq 20000 20015)
    on1=$(ports_on_spine 1 20000 16 | wc -l)
    on2=$(ports_on_spine 2 20000 16 | wc -l)
    ((on1 > 0 && on2 > 0)) || fail "the hash put all 16 flows on one spine ($on1/$on2)"
    a1=$(spine_count 1); a2=$(spine_count 2)
    send 200 $sports
    d1=$(($(spine_count 1) - a1)); d2=$(($(spine_count 2) - a2))
    echo "flows per spine $on1/$on2, packets per spine $d1/$d2"
    # Each spine carries its flows' datagrams; the slack covers ARP and the
    # receiver's rate-limited ICMP port-unreachable replies.
    ((d1 >= on1 * 200 && d1 <= on1 * 200 + 100)) || fail "spine 1 forwarded $d1, expected $((on1 * 200))"
    ((d2 >= on2 * 200 && d2 <= on2 * 200 + 100)) || fail "spine 2 forwarded $d2, expected $((on2 * 200))"
    ;;

  loss)
    # 20000 datagrams over a link with 1% loss: 200 expected lost, sd ~14.
    mapfile -t ports < <(ports_on_spine 1 21000 64)
    ((${#ports[@]} > 0)) || fail "no source port hashes onto spine 1"
    port=${ports[0]}
    "$testbed" set-loss link 1 1 1
    before=$(rx_packets 2 1)
    send 20000 "$port"
    arrived=$(($(rx_packets 2 1) - before))
    lost=$((20000 - arrived))
    echo "1% loss link: $lost of 20000 lost"
    ((lost >= 100 && lost <= 300)) || fail "measured loss $lost/20000 outside 0.5-1.5%"
    # 0.1% granularity: 20000 datagrams, 20 expected lost, sd ~4.5.
    "$testbed" set-loss link 1 1 0.1
    before=$(rx_packets 2 1)
    send 20000 "$port"
    lost=$((20000 - ($(rx_packets 2 1) - before)))
    echo "0.1% loss link: $lost of 20000 lost"
    ((lost >= 3 && lost <= 45)) || fail "measured loss $lost/20000 outside 0.015-0.225%"
    # Removing the loss restores a clean path.
    "$testbed" set-loss link 1 1 0
    before=$(rx_packets 2 1)
    send 5000 "$port"
    lost=$((5000 - ($(rx_packets 2 1) - before)))
    ((lost <= 0)) || fail "$lost datagrams lost after the loss was removed"
    ;;

  failover)
    # With leaf 1's link to spine 1 down, every flow crosses spine 2, in both
    # directions' routes; restoring the link brings spine 1 back.
    "$testbed" fail-link 1 1
    for p in $(seq 20000 20015); do
      [[ $("$testbed" path 1 1 2 1 "$p" 9999) == 2 ]] || fail "flow from port $p still routed via spine 1"
    done
    a1=$(spine_count 1); a2=$(spine_count 2)
    before=$(rx_packets 2 1)
    send 200 $(seq 20000 20015)
    d1=$(($(spine_count 1) - a1)); d2=$(($(spine_count 2) - a2))
    arrived=$(($(rx_packets 2 1) - before))
    echo "link down: spine1 $d1, spine2 $d2 packets, $arrived of 3200 arrived"
    ((d1 == 0)) || fail "spine 1 forwarded $d1 packets with its leaf 1 link down"
    ((arrived >= 3200)) || fail "only $arrived of 3200 datagrams arrived after failover"
    "$testbed" restore-link 1 1
    a1=$(spine_count 1)
    send 200 $(seq 20000 20015)
    (($(spine_count 1) - a1 > 0)) || fail "spine 1 carries nothing after the link was restored"
    ;;

  teardown)
    # `down` leaves no namespace and no link with the prefix, and no process
    # that would keep a deleted namespace's veths alive.
    "$testbed" exec 2 1 sleep 300 2>/dev/null &
    sleeper=$!
    "$testbed" down
    wait "$sleeper" 2>/dev/null || true  # returns only because down killed it
    left=$(ip netns list | grep -c "^$STB_PREFIX" || true)
    ((left == 0)) || fail "$left namespaces left"
    links=$(ip -o link show | grep -c "$STB_PREFIX" || true)
    ((links == 0)) || fail "$links links with the prefix left in the root namespace"
    ;;

  segment)
    # Where the hosts cut their send batches (testbed.sh --segment): 10 UDP
    # GSO sends of 8 x 1000 bytes reach leaf 1 as 80 datagrams when UDP is
    # cut at the host (udp, all) and as 10 whole batches when not (none); a
    # TCP stream reaches it in packets of at most the MSS when TCP is cut (all).
    leaf_rx() { ip netns exec "${STB_PREFIX}leaf1" cat /sys/class/net/to-h1/statistics/rx_packets; }
    gso_batches() {  # -> packets leaf 1 received for 10 batches of 8 segments
      local before
      before=$(leaf_rx)
      "$testbed" exec 1 1 python3 -c '
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_UDP, 103, 1000)  # UDP_SEGMENT: 1000-byte segments
for _ in range(10):
    s.sendto(bytes(8000), ("10.2.1.2", 9999))'
      echo $(($(leaf_rx) - before))
    }
    for mode in udp all none; do
      "$testbed" segment "$mode"
      [[ $("$testbed" status | head -1) == *"segmentation at the hosts: $mode" ]] || fail "status does not say $mode"
      n=$(gso_batches)
      echo "segment $mode: leaf 1 received $n packets for 10 GSO batches of 8"
      if [[ $mode == none ]]; then
        ((n >= 10 && n < 20)) || fail "segment none: $n packets, expected the 10 batches whole"
      else
        ((n >= 80)) || fail "segment $mode: $n packets, expected 80 datagrams"
      fi
    done
    "$testbed" segment all
    "$testbed" exec 2 1 timeout 20 python3 -c '
import socket
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind(("10.2.1.2", 9998)); l.listen(1)
c, _ = l.accept()
while c.recv(1 << 20): pass' &
    server=$!
    before=$(leaf_rx)
    "$testbed" exec 1 1 python3 -c '
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("10.2.1.2", 9998)); break
    except OSError: time.sleep(0.05)
c.sendall(bytes(4 << 20)); c.close()'
    wait "$server"
    n=$(($(leaf_rx) - before))
    echo "segment all: leaf 1 received $n packets for a 4 MiB TCP stream"
    # MSS on the 9000-byte links: 9000 - 20 (IP) - 20 (TCP) - 12 (timestamps) = 8948.
    ((n >= (4 << 20) / 8948)) || fail "segment all: $n packets for 4 MiB of TCP, expected at least $(((4 << 20) / 8948))"
    ;;

  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
