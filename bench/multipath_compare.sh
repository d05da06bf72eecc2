#!/bin/bash
# Multipath benchmarks on the leaf–spine testbed (issue 14, docs/multipath.md):
# stellar mode (sprayed over 16 paths) beside roce mode (one path, ECMP) on
# the same fabric, with stellar_stream (every byte checked at the receiver;
# 64 KiB WRITEs, 64 in flight).
#
# The fabric, not the CPU, is the bottleneck: every leaf–spine link is
# limited with tbf to RATE (default 200mbit) each way, so four spines carry
# 4 x RATE and one flow hashed onto one spine at most RATE; the two vCPUs
# push about 2 Gbit/s of stellar_stream over the software routers.
#
#   bench/multipath_compare.sh BUILD [ROUNDS] [RATE]
#
# Scenarios (each round; medians over rounds where there are several):
#   healthy    4 spines up
#   failover   spine 2 blackholed (drops everything, no route change) 2.3 s into 6 s:
#              goodput before/after 2.5 s, longest gap between chunk completions
#   lossy      spine 1 drops 1%, flows not pinned (new source ports every run)
#   degraded   spine 4's links at RATE/10: every path policy and roce, goodput and
#              p99 chunk completion time
#   flap       spine 2 blackholed 1 s of every 10 s for FLAP_SECONDS (default 30; the
#              issue's run is 120): time in gaps > 10 ms
# SCENARIOS="flap" (any of: healthy failover lossy degraded flap) runs only those.
# roce mode runs with its DCQCN line rate at RATE (--line_rate_mbps): a NIC
# whose rate is one link's, as on a real fabric; left at the default
# (100 Gbit/s) it floods its one path, tbf drops, and go-back-N collapses to
# about a seventh of the link.
# Prints one line per run and a summary table; needs root (network namespaces).
set -euo pipefail
build=$(cd "${1:?usage: multipath_compare.sh BUILD [ROUNDS] [RATE]}" && pwd)
rounds=${2:-1}
rate=${3:-200mbit}
flap_seconds=${FLAP_SECONDS:-30}
scenarios=" ${SCENARIOS:-healthy failover lossy degraded flap} "
want() { [[ $scenarios == *" $1 "* ]]; }
here=$(cd "$(dirname "$0")" && pwd)
testbed=$here/fabric/testbed.sh
stream=$build/bench/stellar_stream
export STB_PREFIX=stbb-
trap '"$testbed" down > /dev/null 2>&1 || true' EXIT
mbps=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(\w+)', sys.argv[1]); print(int(m[1]) * {'kbit': 1e-3, 'mbit': 1, 'gbit': 1000}[m[2]])" "$rate" | cut -d. -f1)
slow=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(\w+)', sys.argv[1]); print(f'{int(m[1])//10}{m[2]}')" "$rate")

"$testbed" up --spines 4 --hosts 1 > /dev/null
limit_all() {  # RATE for every link, spine 4's at $1
  for s in 1 2 3 4; do
    local r=$rate
    ((s == 4)) && r=${1:-$rate}
    "$testbed" set-link-rate 1 "$s" "$r"
    "$testbed" set-link-rate 2 "$s" "$r"
  done
}
clear_faults() { for s in 1 2 3 4; do "$testbed" set-loss spine "$s" 0; done; }
server=$("$testbed" addr 2 1)
client=$("$testbed" addr 1 1)
port=$(shuf -i 18000-18999 -n 1)

# run LABEL SECONDS CHUNK [stream options]: one stream, its result line on stdout.
run() {
  local label=$1 seconds=$2 chunk=$3
  shift 3
  # roce: a fresh source port per run (a NIC derives it from the QP), so the
  # single path is not the same ECMP flow every time.
  # ($RANDOM would repeat: run() is a fresh subshell every time.)
  [[ $label == *roce* ]] && set -- "$@" --line_rate_mbps "$mbps" --udp_port_client "$(shuf -i 20000-29999 -n 1)"
  port=$(shuf -i 18000-18999 -n 1)
  # --udp_port_client N goes to the client only (as --udp_port N).
  local server_args=() client_args=() skip=0 a
  for a in "$@"; do
    if ((skip)); then
      skip=0
      client_args+=("$a")
      continue
    fi
    if [[ $a == --udp_port_client ]]; then
      skip=1
      client_args+=(--udp_port)
      continue
    fi
    client_args+=("$a")
    server_args+=("$a")
  done
  "$testbed" exec 2 1 "$stream" --bind "$server" -p "$port" -s "$chunk" --slots 64 "${server_args[@]}" > /tmp/mpc-server.log 2>&1 &
  local spid=$!
  for _ in $(seq 100); do grep -q "waiting on" /tmp/mpc-server.log && break; sleep 0.05; done
  local line
  line=$("$testbed" exec 1 1 "$stream" "$server" --bind "$client" -p "$port" -s "$chunk" --slots 64 -D "$seconds" "${client_args[@]}" | grep '^stream:') || true
  # A client that failed (its error is on stderr) leaves the server waiting: stop it.
  if [[ -z $line ]]; then
    # (ip netns exec may leave the program itself running: kill it by its command line.)
    pkill -f "stellar_stream --bind $server -p $port " 2> /dev/null || true
    line="FAILED"
  fi
  wait "$spid" || true
  grep -q "mismatches 0" /tmp/mpc-server.log || echo "# $label: the server did not verify the stream byte-exact: $(cat /tmp/mpc-server.log)" >&2
  echo "$label $line"
}
# value FIELD < line
value() { grep -o " $1 [0-9.]*" | awk '{print $2}'; }

results=$(mktemp)
for ((r = 1; r <= rounds; r++)); do
  limit_all
  clear_faults
  if want healthy; then
    for mode in stellar roce; do run "healthy-$mode" 5 65536 --mode "$mode" | tee -a "$results"; done
  fi
  if want failover; then
    for mode in stellar roce; do
      ( sleep 2.3; "$testbed" set-loss spine 2 100 ) &
      run "failover-$mode" 6 65536 --mode "$mode" --split 2.5 | tee -a "$results"
      wait
      clear_faults
    done
  fi
  if want lossy; then
    "$testbed" set-loss spine 1 1
    for i in 1 2 3; do
      for mode in stellar roce; do run "lossy-$mode" 4 65536 --mode "$mode" | tee -a "$results"; done
    done
    clear_faults
  fi
  if want degraded; then
    limit_all "$slow"
    for policy in oblivious reps two-choices bandit; do run "degraded-$policy" 5 65536 --path_policy "$policy" | tee -a "$results"; done
    run "degraded-roce" 5 65536 --mode roce | tee -a "$results"
    limit_all
  fi
  if want flap; then
    for mode in stellar roce; do
      (
        for ((k = 0; k < flap_seconds / 10; k++)); do
          sleep $((k == 0 ? 5 : 9))
          "$testbed" set-loss spine 2 100
          sleep 1
          "$testbed" set-loss spine 2 0
        done
      ) &
      run "flap-$mode" "$flap_seconds" 65536 --mode "$mode" | tee -a "$results"
      wait
    done
  fi
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2); else print "n/a"}'; }
field() { grep "^$1 " "$results" | value "$2" | median; }
echo
echo "== multipath on the testbed: 4 spines, links at $rate each way ($rounds round(s); medians)"
printf "%-22s %12s %12s %14s %14s %14s\n" scenario "goodput GB/s" "p99 chunk ms" "longest gap ms" "after split" "stalled frac"
for label in healthy-stellar healthy-roce failover-stellar failover-roce lossy-stellar lossy-roce \
             degraded-oblivious degraded-reps degraded-two-choices degraded-bandit degraded-roce flap-stellar flap-roce; do
  printf "%-22s %12s %12s %14s %14s %14s\n" "$label" "$(field "$label" goodput)" "$(field "$label" chunk_p99_ms)" \
    "$(field "$label" longest_gap_ms)" "$(field "$label" after_split)" "$(field "$label" stalled_fraction)"
done
echo "raw lines: $results"
