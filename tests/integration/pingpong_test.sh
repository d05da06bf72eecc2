#!/bin/bash
# The ping-pong example as a new user runs it: two processes over loopback,
# every size from 2 B to 8 MiB (-a, as perftest's -a), both wire modes,
# without and with 1% injected loss; every size must print a row. Then the
# server as an attacker or a dying client meets it: a connection attempt
# that fails must not end the server, and a server nobody connects to gives
# up after --wait_client with a message.
set -euo pipefail
# The server's banner says it listens; a client started before that would
# find the port closed (as perftest's own client would).
wait_listening() {
  for _ in $(seq 200); do grep -q waiting "$1" && return 0; sleep 0.05; done
  echo "the server never said it was listening:"; cat "$1"; exit 1
}
bin="$1"
port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768-)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rows_expected=23  # 2^1 .. 2^23
for mode in stellar roce; do
  for faults in 0 0.01; do
    port=$((port + 1))
    : > "$log"  # empty before the server starts: the last one's banner must not count
    STELLAR_FAULT_DROP=$faults timeout 120 "$bin" -p "$port" -a -n 20 --warmup 5 --adaptive --mode "$mode" > "$log" 2>&1 &
    server=$!
    wait_listening "$log"
    out=$(STELLAR_FAULT_DROP=$faults timeout 120 "$bin" 127.0.0.1 -p "$port" -a -n 20 --warmup 5 --adaptive --mode "$mode") || {
      echo "client failed ($mode, loss $faults):"; echo "$out"; cat "$log"; exit 1; }
    wait "$server" || { echo "server failed ($mode, loss $faults):"; cat "$log"; exit 1; }
    rows=$(echo "$out" | grep -Ec '^ [0-9]+ +20 +[0-9.]+ +[0-9.]+ +[0-9.]+' || true)
    echo "$mode, loss $faults: $rows sizes"
    echo "$out" | grep -E '^ (2|4096|4194304|8388608) '
    [[ $rows == "$rows_expected" ]] || { echo "expected $rows_expected rows"; echo "$out"; exit 1; }
  done
done

# A failed attempt (connect and close; a malformed request) costs that attempt only.
port=$((port + 1))
: > "$log"  # empty before the server starts: the last one's banner must not count
timeout 60 "$bin" -p "$port" -s 64 -n 100 --adaptive > "$log" 2>&1 &
server=$!
wait_listening "$log"
exec 3<>"/dev/tcp/127.0.0.1/$port"; exec 3>&-
exec 3<>"/dev/tcp/127.0.0.1/$port"; echo '{"type":"connect","udp_port":"x"}' >&3; exec 3>&-
out=$(timeout 60 "$bin" 127.0.0.1 -p "$port" -s 64 -n 100 --adaptive)
wait "$server" || { echo "server ended with an error after failed attempts:"; cat "$log"; exit 1; }
echo "$out" | grep -Eq '^ 64 +100 ' || { echo "no row after failed attempts"; echo "$out"; exit 1; }
echo "server survived failed connection attempts"

# Nobody comes: the server says what it waited for and exits non-zero.
port=$((port + 1))
if timeout 30 "$bin" -p "$port" --wait_client 1 > "$log" 2>&1; then echo "server without a client exited 0"; exit 1; fi
grep -q "no client connected within 1 s" "$log" || { echo "no clear message:"; cat "$log"; exit 1; }
echo "server without a client gave up: $(grep -o 'no client.*' "$log")"
