#!/bin/bash
# Runs every perftest-style program briefly over loopback (server + client)
# and checks that the client prints a well-formed result row and valid JSON.
set -euo pipefail
dir="$1"
port=$((40000 + RANDOM % 15000))
lat_row='^ [0-9]+ +[0-9]+( +[0-9]+\.[0-9]+){7}$'
bw_row='^ [0-9]+ +[0-9]+( +[0-9]+\.[0-9]+){3}$'
for program in write_lat read_lat send_lat atomic_lat write_bw read_bw send_bw; do
  port=$((port + 1))
  args=(-n 300 -s 4100)
  [[ $program == *_bw ]] && args=(-n 200 -s 65536 -q 2)
  [[ $program == atomic_lat ]] && args=(-n 300)
  timeout 60 "$dir/stellar_$program" -p "$port" "${args[@]}" > /dev/null &
  server=$!
  json=$(mktemp)
  out=$(timeout 60 "$dir/stellar_$program" 127.0.0.1 -p "$port" "${args[@]}" --out_json "$json")
  wait "$server"
  row=$(echo "$out" | grep -E '^ [0-9]' | head -1)
  if [[ $program == *_bw ]]; then pattern=$bw_row; else pattern=$lat_row; fi
  if ! [[ $row =~ $pattern ]]; then echo "stellar_$program: malformed row: '$row'"; echo "$out"; exit 1; fi
  python3 -c "import json,sys; d=json.load(open('$json')); assert d['results'] and d['results'][0]['iterations'] > 0" \
    || { echo "stellar_$program: bad JSON"; exit 1; }
  rm -f "$json"
  echo "stellar_$program: $row"
done
