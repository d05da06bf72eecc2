#!/bin/bash
# Every perftest-style program as a new user runs it: server + client over
# loopback, every size from 2 B to 8 MiB (-a; atomics: 8 B), both wire
# modes, without and with 1% injected loss; each size must print a
# well-formed row, and the JSON must hold every size. Then a client killed
# with SIGKILL mid-run: the server must notice and exit non-zero, with a
# message, within a bound.
set -euo pipefail
# The server's banner says it listens; a client started before that would
# find the port closed (as perftest's own client would).
wait_listening() {
  for _ in $(seq 200); do grep -q waiting "$1" && return 0; sleep 0.05; done
  echo "the server never said it was listening:"; cat "$1"; exit 1
}
dir="$1"
port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768-)
lat_row='^ [0-9]+ +[0-9]+( +[0-9]+\.[0-9]+){7}$'
bw_row='^ [0-9]+ +[0-9]+( +[0-9]+\.[0-9]+){3}$'
log=$(mktemp)
json=$(mktemp)
trap 'rm -f "$log" "$json"' EXIT
for program in write_lat read_lat send_lat atomic_lat write_bw read_bw send_bw; do
  for mode in stellar roce; do
    for faults in 0 0.01; do
      args=(-a -n 5 --wait adaptive --mode "$mode")
      [[ $program == *_bw ]] && args=(-a -n 8 -t 8 -q 2 --wait adaptive --mode "$mode")
      expected=23
      [[ $program == atomic_lat ]] && expected=1
      # roce mode under loss may retry a run once when its retries ran out:
      # its go-back-N resends a whole 8 MiB message per timeout, and on two
      # busy cores the seven retries ran out once in a clean-clone CI (the
      # failure is printed, any other failure or a second one fails the
      # test; issue 16 is to make that path cheaper).
      attempts=1
      [[ $mode == roce && $faults != 0 ]] && attempts=2
      for attempt in $(seq "$attempts"); do
        port=$((port + 1))
        : > "$log"  # empty before the server starts: the last one's banner must not count
        STELLAR_FAULT_DROP=$faults timeout 300 "$dir/stellar_$program" -p "$port" "${args[@]}" > "$log" 2>&1 &
        server=$!
        wait_listening "$log"
        failed=""
        out=$(STELLAR_FAULT_DROP=$faults timeout 300 "$dir/stellar_$program" 127.0.0.1 -p "$port" "${args[@]}" --out_json "$json") || failed=client
        if [[ -n $failed ]]; then
          kill "$server" 2>/dev/null || true  # its client is gone: do not wait for it to notice
          wait "$server" 2>/dev/null || true
        else
          wait "$server" || failed=server
        fi
        [[ -z $failed ]] && break
        echo "stellar_$program ($mode, loss $faults): $failed failed (attempt $attempt of $attempts)"; echo "$out"; cat "$log"
        # Only the known flake (retries ran out) earns the second attempt.
        ((attempt < attempts)) && grep -q "retry counter exceeded" <<< "$out$(cat "$log")" || exit 1
      done
      if [[ $program == *_bw ]]; then pattern=$bw_row; else pattern=$lat_row; fi
      rows=0
      while read -r line; do
        if ! [[ " $line" =~ $pattern ]]; then echo "stellar_$program: malformed row: '$line'"; echo "$out"; exit 1; fi
        rows=$((rows + 1))
      done < <(echo "$out" | grep -E '^ [0-9]')
      [[ $rows == "$expected" ]] || { echo "stellar_$program ($mode, loss $faults): $rows rows, expected $expected"; echo "$out"; exit 1; }
      python3 -c "import json,sys; d=json.load(open('$json')); assert len(d['results']) == $expected and all(r['iterations'] > 0 for r in d['results'])" \
        || { echo "stellar_$program: bad JSON"; exit 1; }
      echo "stellar_$program $mode loss $faults: $rows sizes, last: $(echo "$out" | grep -E '^ [0-9]' | tail -1)"
    done
  done
done

# A client killed mid-run: one-sided traffic gives the server no completion
# to fail, so it must find out by itself (its keepalive READ) and exit.
for mode in stellar roce; do
  port=$((port + 1))
  : > "$log"  # empty before the server starts: the last one's banner must not count
  timeout 120 "$dir/stellar_write_bw" -p "$port" -D 60 --wait adaptive --mode "$mode" > "$log" 2>&1 &
  server=$!
  wait_listening "$log"
  "$dir/stellar_write_bw" 127.0.0.1 -p "$port" -D 60 --wait adaptive --mode "$mode" > /dev/null 2>&1 &  # no timeout wrapper: $! is the client
  client=$!
  sleep 2
  kill -9 "$client"
  wait "$client" 2> /dev/null || true
  start=$SECONDS
  status=0
  wait "$server" || status=$?
  if [[ $status == 0 || $status == 124 ]]; then echo "write_bw server ($mode) after kill -9 of the client: exit $status"; cat "$log"; exit 1; fi
  grep -q "stopped answering" "$log" || { echo "write_bw server ($mode): no clear message"; cat "$log"; exit 1; }
  echo "write_bw server ($mode) noticed the dead client in $((SECONDS - start)) s: $(grep -o 'the client stopped.*' "$log")"
done
