#!/bin/bash
# Runs the ping-pong example as two processes over loopback, both modes, with
# fault injection on for the second pair, and checks the perftest-style table.
set -euo pipefail
bin="$1"
port=$((20000 + RANDOM % 20000))
for mode in stellar roce; do
  for faults in 0 0.01; do
    port=$((port + 1))
    STELLAR_FAULT_DROP=$faults "$bin" -p "$port" -s 64 -n 2000 --mode "$mode" > /tmp/pp_server.$$ 2>&1 &
    server=$!
    out=$(STELLAR_FAULT_DROP=$faults "$bin" 127.0.0.1 -p "$port" -s 64 -n 2000 --mode "$mode")
    wait "$server"
    echo "$out"
    echo "$out" | grep -Eq '^ 64 +2000 +[0-9.]+ +[0-9.]+ +[0-9.]+' || { echo "no latency row for $mode"; exit 1; }
  done
done
rm -f /tmp/pp_server.$$
