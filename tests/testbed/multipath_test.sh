#!/bin/bash
# Multipath over the leaf–spine testbed (issue 14): one stellar-mode
# connection from host 1.1 to host 2.1 across 4 spines, with stellar_stream
# (bench/stream.cpp), which checks every byte at the receiver and fails on
# any error completion. One case per invocation, on its own namespace prefix,
# torn down on exit. Assertions are on bytes, counters and packet counts,
# never on time.
#
#   spray      every spine carries part of the one connection (spine counters)
#   blackhole  a spine drops everything mid-transfer (no route change): the
#              connection retires its paths there and finishes, no error
#   lossy      a spine drops 1% from the start
#   degraded   a spine's links limited to 10% of the others' rate (tbf)
#   roce       the baseline: roce mode (one path) finishes over the same fabric,
#              and every RoCEv2 datagram on leaf 1's host port has a correct
#              ICRC for its IP id (UDP GSO segments: ids 0, 1, 2, ...)
#   ecn        a spine marks every ECN-capable packet congestion-experienced: the
#              marks reach the receiver, are echoed, and the default policy sends
#              under a fifth of the packets through that spine (a fair share is a
#              quarter), losing none for it
#   move       the client's host is renumbered mid-transfer (testbed.sh
#              move-host): the client follows its address, the server
#              validates the new one, and the stream finishes byte-exact
#
# Usage: tests/testbed/multipath_test.sh CASE BUILD_DIR
# Exit 77 (ctest SKIP) when not root or `ip netns` is unavailable.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
testbed=$here/../../bench/fabric/testbed.sh
case_name=${1:?case}
build=$(cd "${2:?build dir}" && pwd)
stream=$build/bench/stellar_stream
[[ -x $stream ]] || { echo "no $stream"; exit 1; }

if (($(id -u) != 0)) || ! ip netns list > /dev/null 2>&1; then
  echo "SKIP: needs root and ip netns"
  exit 77
fi
export STB_PREFIX="stbm-$case_name-"
work=$(mktemp -d)
server_pid=
cleanup() {
  [[ -n $server_pid ]] && kill "$server_pid" 2> /dev/null || true
  "$testbed" down
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() {
  echo "FAIL: $*"
  echo "--- server:"; cat "$work/server.log" || true
  echo "--- client:"; cat "$work/client.log" || true
  "$testbed" status || true
  exit 1
}

"$testbed" up --spines 4 --hosts 1 > /dev/null
server_addr=$("$testbed" addr 2 1)
client_addr=$("$testbed" addr 1 1)
spine_counts() { "$testbed" counters | awk '{print $2}' | paste -sd' '; }

# stream CHUNKS CHUNK_BYTES [stellar_stream options...]: runs the server in
# host 2.1 and the client in host 1.1 in the background; wait_stream waits.
start_stream() {
  local chunks=$1 chunk=$2
  shift 2
  : > "$work/server.log"
  "$testbed" exec 2 1 "$stream" --bind "$server_addr" -p 18600 -s "$chunk" --wait_client 60 "$@" > "$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 200); do
    grep -q "waiting on" "$work/server.log" && break
    sleep 0.05
  done
  grep -q "waiting on" "$work/server.log" || fail "the server did not start"
  "$testbed" exec 1 1 "$stream" "$server_addr" --bind "$client_addr" -p 18600 -s "$chunk" -n "$chunks" "$@" > "$work/client.log" 2>&1 &
  client_pid=$!
}
wait_stream() {
  local rc=0
  wait "$client_pid" || rc=$?
  ((rc == 0)) || fail "the client failed (exit $rc)"
  rc=0
  wait "$server_pid" || rc=$?
  server_pid=
  ((rc == 0)) || fail "the server failed (exit $rc)"
  grep -q "verified $1 chunks.*mismatches 0" "$work/server.log" || fail "the server did not verify $1 chunks byte-exact"
  cat "$work/client.log" "$work/server.log" | grep -E '^stream'
}
field() { grep -o "$1 [0-9.]*" "$work/client.log" | awk '{print $2}'; }

case $case_name in
  spray)
    # 32 paths: the chance that the hash leaves a spine without any is 4 x (3/4)^32.
    read -r -a before <<< "$(spine_counts)"
    start_stream 200 262144 --paths 32
    wait_stream 200
    read -r -a after <<< "$(spine_counts)"
    total=0
    for i in 0 1 2 3; do total=$((total + after[i] - before[i])); done
    for i in 0 1 2 3; do
      d=$((after[i] - before[i]))
      echo "spine $((i + 1)): $d packets of $total"
      ((d * 50 >= total)) || fail "spine $((i + 1)) carried $d of $total packets (under 2%)"
    done
    ;;

  blackhole)
    start_stream 1200 262144 --paths 16
    sleep 0.4
    "$testbed" set-loss spine 2 100
    wait_stream 1200
    (($(field paths_retired) >= 1)) || fail "no path was retired"
    ;;

  lossy)
    "$testbed" set-loss spine 1 1
    start_stream 600 262144 --paths 16
    wait_stream 600
    ;;

  degraded)
    for s in 1 2 3; do "$testbed" set-link-rate 1 "$s" 1gbit; "$testbed" set-link-rate 2 "$s" 1gbit; done
    "$testbed" set-link-rate 1 4 100mbit
    "$testbed" set-link-rate 2 4 100mbit
    start_stream 200 262144 --paths 16
    wait_stream 200
    ;;

  roce)
    # Leaf 1 sees the datagrams as host 1.1's veth segmented its UDP GSO
    # messages, each with the IP id the kernel gave it: every ICRC must be
    # right for the bytes on the wire (what a RoCE NIC checks).
    ip netns exec "${STB_PREFIX}leaf1" python3 "$here/roce_icrc_check.py" to-h1 2000 > "$work/icrc.log" 2>&1 &
    icrc_pid=$!
    sleep 0.3
    start_stream 200 262144 --mode roce
    wait_stream 200
    grep -q "paths 1 " "$work/client.log" || fail "roce mode used more than one path"
    wait "$icrc_pid" || { cat "$work/icrc.log"; fail "ICRCs on the wire"; }
    cat "$work/icrc.log"
    grep -q "IP ids seen: \[0, 1, 2" "$work/icrc.log" || fail "no GSO-numbered IP ids on the wire (roce mode without GSO?)"
    ;;

  ecn)
    "$testbed" set-mark spine 4 100
    # The marking spine's share is bimodal on this 2-core host: 4-12% in most
    # runs, 19.7-20.7% in about one of six (old and new builds alike, measured
    # side by side on 2026-12-02), when the marks come late in a 0.26 s
    # stream. A second stream runs when the first misses; both are printed,
    # and a second miss fails.
    for attempt in 1 2; do
      read -r -a before <<< "$(spine_counts)"
      start_stream 2000 65536 --paths 16
      wait_stream 2000
      read -r -a after <<< "$(spine_counts)"
      marks=$(grep -o "congestion_marks [0-9]*" "$work/server.log" | awk '{print $2}')
      ((marks > 0)) || fail "no congestion mark reached the server"
      total=0
      for i in 0 1 2 3; do total=$((total + after[i] - before[i])); done
      marked=$((after[3] - before[3]))
      echo "spine 4 (marking) carried $marked of $total packets; the server saw $marks marks (attempt $attempt)"
      ((marked * 5 < total)) && break
      ((attempt < 2)) || fail "the marking spine carried $marked of $total packets (a fifth or more), twice"
    done
    ;;

  move)
    # Long enough to be moving when the address changes at 0.4 s on a fast
    # run too (3000 chunks once took longer than that here; now 0.37 s).
    start_stream 15000 65536 --paths 16
    sleep 0.4
    "$testbed" move-host 1 1 9
    wait_stream 15000
    grep -q "local 10.1.1.9" "$work/client.log" || fail "the client did not move to 10.1.1.9"
    (($(field address_changes) == 1)) || fail "the client moved $(field address_changes) times, not once"
    server_migrations=$(grep -o "migrations [0-9]*" "$work/server.log" | awk '{print $2}')
    ((server_migrations == 1)) || fail "the server validated $server_migrations moves, not one"
    awk -v t="$(field move_to_ack_ms)" 'BEGIN { exit !(t > 0) }' || fail "no acknowledgement reached the client's new address"
    echo "longest gap between chunk completions (the move's stall, at most): $(field longest_gap_ms) ms;" \
      "client's rebind to the first acknowledgement at its new address: $(field move_to_ack_ms) ms"
    ;;

  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo "PASS: $case_name"
