#!/usr/bin/env bash
# The user-space part of an 8-byte one-way, Stellar beside sockperf: on the
# ping-pong server, the time from a system call that received the request
# returning to the system call that sends the reply being entered, read off
# kernel tracepoints (perf). Both programs pay the same kernel path, and the
# tracepoints' own cost is the same for both, so the difference of the two
# medians is what Stellar's layers (provider, engine host, engine) add per
# one-way on the server; the client adds about as much on its side. Unlike
# the end-to-end latency, this barely moves with the host's speed phases, so
# it shows a change of a few tens of nanoseconds (docs/benchmarks.md, stop 45).
#
# Usage: bench/user_path.sh BUILD_DIR [ITERATIONS] [SOCKPERF_SECONDS]
# Needs root (tracepoints), perf and sockperf; exits 77 without them.
set -euo pipefail
build=$(cd "${1:?build dir}" && pwd)
iterations=${2:-50000}
seconds=${3:-2}
pingpong=$build/examples/stellar_pingpong
[[ -x $pingpong ]] || { echo "user_path: $pingpong missing" >&2; exit 1; }
if (($(id -u) != 0)) || ! command -v perf > /dev/null || ! command -v sockperf > /dev/null; then
  echo "user_path: needs root, perf and sockperf" >&2
  exit 77
fi
work=$(mktemp -d)
server=
cleanup() {
  if [[ -n $server ]]; then kill "$server" 2> /dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Every receive that returned data, and every send, whichever call each
# program's path picks (Stellar: recvfrom when busy-polling lone datagrams,
# recvmsg/recvmmsg otherwise; sendto for one datagram).
events=()
for call in recvfrom recvmsg recvmmsg; do events+=(-e "syscalls:sys_exit_$call" --filter 'ret > 0'); done
for call in sendto sendmsg sendmmsg; do events+=(-e "syscalls:sys_enter_$call"); done

# FILE -> "p10 p50 p90" in ns of receive-exit to next send-enter.
spans() {
  perf script --ns -i "$1" -F time,event 2> /dev/null |
    awk '{t = $1; sub(":", "", t); if ($2 ~ /sys_exit_recv/) r = t; else if (r > 0) { printf "%.0f\n", (t - r) * 1e9; r = 0 } }' |
    sort -n | awk '{a[NR] = $1} END { if (NR == 0) { print "- - -"; exit } print a[int(NR * 0.1) + 1], a[int(NR * 0.5) + 1], a[int(NR * 0.9) + 1] }'
}

port=$((20000 + RANDOM % 20000))
perf record -q "${events[@]}" -o "$work/stellar.data" "$pingpong" -p "$port" -s 8 -n "$iterations" > /dev/null 2>&1 &
server=$!
sleep 0.5
"$pingpong" 127.0.0.1 -p "$port" -s 8 -n "$iterations" | awk '$1 == 8 {print "stellar one-way p50 (us, under tracing):", $5}'
wait "$server" || true
server=

port=$((port + 1))
perf record -q "${events[@]}" -o "$work/sockperf.data" sockperf server -i 127.0.0.1 -p "$port" --nonblocked > /dev/null 2>&1 &
server=$!
sleep 0.5
sockperf ping-pong -i 127.0.0.1 -p "$port" --nonblocked -m 16 -t "$seconds" 2>&1 |
  awk '/percentile 50.000/ {print "sockperf one-way p50 (us, under tracing):", $NF}'
kill -INT "$server" 2> /dev/null || true
wait "$server" 2> /dev/null || true
server=

read -r s10 s50 s90 <<< "$(spans "$work/stellar.data")"
read -r k10 k50 k90 <<< "$(spans "$work/sockperf.data")"
printf "%-10s %8s %8s %8s   (ns, server: receive returned -> reply's send entered)\n" "" p10 p50 p90
printf "%-10s %8s %8s %8s\n" stellar "$s10" "$s50" "$s90" sockperf "$k10" "$k50" "$k90"
[[ $s50 =~ ^[0-9]+$ && $k50 =~ ^[0-9]+$ ]] && echo "stellar adds $((s50 - k50)) ns per one-way on the server (p50)"
