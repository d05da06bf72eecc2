#!/bin/bash
# One comparison run, side by side, on loopback and on the leaf–spine testbed
# (bench/fabric/testbed.sh): Stellar's two modes of the soft provider
# (`stellar`, and `roce` = the raw-RoCEv2 baseline) against UCX over TCP
# (ucx_perftest), kernel TCP (iperf3) and raw UDP (sockperf), for
#   - small-message latency, p50 and p99, by message size
#   - 1 MiB bandwidth, and beside it the CPU seconds per GB moved (both
#     processes, user + system, bench/cputime.py; stellar, roce, UCX, iperf3)
#   - goodput under 0, 0.1% and 1% loss (loopback: the soft provider's
#     STELLAR_FAULT_DROP on both processes; testbed: nftables drop on spine 1,
#     with the flows pinned to spine 1 both ways; TCP only on the testbed)
#   - a 4-to-1 incast through a tbf-limited leaf downlink (testbed): p99 of
#     64-byte writes of a separate latency flow, and the aggregate goodput.
# Every case runs ROUNDS times, round-robin over all cases, and the report
# takes medians (shared machine: drift hits every transport alike).
#
# Usage: bench/compare/compare.sh [--build DIR] [--out DIR] [--rounds N]
#                                 [--quick] [--no-testbed] [--segment all|none|udp]
#   --build DIR    build tree with bench/stellar_write_{lat,bw} (default: build)
#   --out DIR      results: compare.txt (table), compare.json, *.png (default: bench-results)
#   --quick        a small loopback-only subset, one round (smoke test)
#   --only REGEX   keep the cases ("ENV KIND TRANSPORT SIZE LOSS") that match, e.g. 'tb incast'
#   --segment MODE where the testbed's hosts cut UDP GSO and TCP TSO batches into
#                  packets (bench/fabric/testbed.sh): all (default: both, the
#                  fabric sees single packets as on a wire), none (both cross
#                  whole), udp (UDP only: TCP's batches cross the routers whole,
#                  so TCP pays one forwarding per 64 KiB and Stellar one per 8 KiB)
# The testbed needs root; without root the testbed half is left out.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
testbed=$here/../fabric/testbed.sh
build=build out=bench-results rounds=3 quick=0 use_testbed=1 only=. segment=all
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --no-testbed) use_testbed=0; shift ;;
    --only) only=$2; shift 2 ;;
    --segment) segment=$2; shift 2 ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
  esac
done
[[ $segment =~ ^(all|none|udp)$ ]] || { echo "compare: --segment takes all, none or udp, not '$segment'" >&2; exit 2; }
lat_bin=$build/bench/stellar_write_lat
bw_bin=$build/bench/stellar_write_bw
for f in "$lat_bin" "$bw_bin"; do [[ -x $f ]] || { echo "compare: $f missing (build the bench targets)" >&2; exit 1; }; done
for t in sockperf ucx_perftest iperf3 gnuplot python3; do
  command -v "$t" > /dev/null || { echo "compare: $t missing (scripts/install-deps.sh)" >&2; exit 1; }
done
if ((quick)); then rounds=1 use_testbed=0; fi
if ((use_testbed)) && { (($(id -u) != 0)) || ! ip netns list > /dev/null 2>&1; }; then
  echo "compare: not root or no ip netns: loopback only" >&2
  use_testbed=0
fi
mkdir -p "$out"
records=$out/records.jsonl
: > "$records"

# Durations: long enough for a few thousand samples, short enough for the
# whole run to fit in about 10-15 minutes at 3 rounds.
lat_iters=5000 bw_seconds=3 sock_seconds=2 incast_seconds=12 incast_lat_iters=1000
if ((quick)); then lat_iters=2000 bw_seconds=1 sock_seconds=1; fi

export STB_PREFIX=stb-cmp-
servers=()
testbed_up=0
cleanup() {
  local pid
  for pid in "${servers[@]}"; do kill "$pid" 2> /dev/null || true; done
  rm -f "$cpu_log"
  ((testbed_up)) && "$testbed" down
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Where each side runs. Loopback: 127.0.0.1 in this namespace. Testbed: the
# server on host 1 of leaf 2, the client on host 1 of leaf 1, so every packet
# crosses a spine.
server_node="2 1" client_node="1 1"
on() {  # ENV "L H" CMD... ; run CMD on that host
  local env=$1 node=$2
  shift 2
  if [[ $env == lo ]]; then "$@"; else "$testbed" exec ${node% *} ${node#* } "$@"; fi
}
addr() { if [[ $1 == lo ]]; then echo 127.0.0.1; else echo "10.${2% *}.${2#* }.2"; fi; }
port=$((30000 + RANDOM % 10000))
next_port() { port=$((port + 1)); }
background() { "$@" & servers+=($!); }  # a server, killed on exit if still running
reap() {  # servers end by themselves after a client's run; a failed run's server is killed after 5 s
  local pid i
  for pid in "${servers[@]}"; do
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2> /dev/null || break; sleep 0.05; done
    kill "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
  done
  servers=()
}
wait_listen() {  # ENV NODE PORT PROTO: until a peer program's socket exists (no timing in results)
  local i
  for ((i = 0; i < 100; i++)); do
    on "$1" "$2" ss -Hln"${4:0:1}" "sport = :$3" 2> /dev/null | grep -q . && return 0
    sleep 0.05
  done
}

# Spine-1 pinning on the testbed: a client UDP (or TCP) port whose flow to the
# server's port hashes onto spine 1 in both directions, so that data and ACKs
# meet the loss placed on spine 1, as STELLAR_FAULT_DROP hits both on loopback.
pin_port() {  # SERVER_PORT PROTO -> client port
  local p
  for ((p = 45000; p < 46000; p++)); do
    [[ $("$testbed" path 1 1 2 1 "$p" "$1" "$2") == 1 && $("$testbed" path 2 1 1 1 "$1" "$p" "$2") == 1 ]] && { echo "$p"; return; }
  done
  echo "compare: no port pins to spine 1" >&2
  exit 1
}

set_loss() { "$testbed" set-loss spine 1 "$2"; }  # ENV PCT, testbed only
cpu_log=$(mktemp)
cpu_per_gb() {  # BYTES -> "cpu=S" (seconds per GB, the processes logged since the last call)
  awk -v b="$1" '{s += $1} END {if (b > 0) printf "cpu=%.4f\n", s / (b / 1e9)}' "$cpu_log"
  : > "$cpu_log"
}
fault_env() {  # ENV PCT -> STELLAR_FAULT_DROP probability (loopback only)
  if [[ $1 == lo ]]; then python3 -c "print(float('$2') / 100)"; else echo 0; fi; }

# ---- measurements: each prints key=value pairs ----
stellar_lat() {  # ENV MODE SIZE
  local env=$1 mode=$2 size=$3 s c
  next_port
  s=$(addr "$env" "$server_node"); c=$(addr "$env" "$client_node")
  background on "$env" "$server_node" timeout 60 "$lat_bin" --bind "$s" -p $port --mode "$mode" -s "$size" -n $lat_iters > /dev/null
  on "$env" "$client_node" timeout 60 "$lat_bin" "$s" --bind "$c" -p $port --mode "$mode" -s "$size" -n $lat_iters |
    awk -v s="$size" '$1 == s {print "p50=" $5, "p99=" $8}'
  reap
}
sockperf_lat() {  # ENV SIZE
  local env=$1 size=$2 s
  next_port
  s=$(addr "$env" "$server_node")
  background on "$env" "$server_node" timeout 60 sockperf server -i "$s" -p $port --nonblocked > /dev/null 2>&1
  wait_listen "$env" "$server_node" $port udp
  on "$env" "$client_node" timeout 60 sockperf ping-pong -i "$s" -p $port --nonblocked -m "$size" -t $sock_seconds 2>&1 |
    awk '/percentile 50.000/ {p50 = $NF} /percentile 99.000/ {p99 = $NF} END {print "p50=" p50, "p99=" p99}'
  kill "${servers[@]}" 2> /dev/null || true  # sockperf's server runs until killed
  reap
}
ucx_lat() {  # ENV SIZE (ucx_perftest reports typical one-way latency, no percentiles)
  local env=$1 size=$2 s
  next_port
  s=$(addr "$env" "$server_node")
  background on "$env" "$server_node" env UCX_TLS=tcp timeout 60 ucx_perftest -p $port > /dev/null 2>&1
  wait_listen "$env" "$server_node" $port tcp
  on "$env" "$client_node" env UCX_TLS=tcp timeout 60 ucx_perftest "$s" -p $port -t tag_lat -s "$size" -n $lat_iters 2> /dev/null |
    awk '/^Final:/ {print "p50=" $3}'
  reap
}
stellar_bw() {  # ENV MODE LOSS_PCT -> GB/s (10^9)
  local env=$1 mode=$2 loss=$3 s c drop pins=()
  next_port
  s=$(addr "$env" "$server_node"); c=$(addr "$env" "$client_node")
  drop=$(fault_env "$env" "$loss")
  [[ $env == tb ]] && pins=(--udp_port 4791) && set_loss tb "$loss"
  # Both processes busy-poll, Stellar's default wait and perftest's. (The
  # testbed's server used to wait adaptively, lest a second spinning process
  # starve the namespaces' routers; the routers forward in the senders'
  # softirq context, and stop 49 measured the opposite: the adaptive server
  # sleeps after every wake that brings no completion, and a WRITE stream
  # brings none, so the stream ran at 1.25-1.42 GB/s and 1.12-1.25 s/GB
  # against 2.14-2.20 GB/s and 0.94-0.97 s/GB busy. Since stop 51 an
  # adaptive wait spins from the last datagram, and the adaptive server
  # measured as the busy one: 3.03 and 2.13 GB/s against 2.98 and 2.30.)
  # TB_SERVER_WAIT=adaptive runs it so.
  local server_wait=()
  [[ $env == tb ]] && server_wait=(--wait "${TB_SERVER_WAIT:-busy}")
  : > "$cpu_log"
  background on "$env" "$server_node" env STELLAR_FAULT_DROP="$drop" python3 "$here/../cputime.py" "$cpu_log" timeout 90 "$bw_bin" --bind "$s" -p $port "${pins[@]}" \
    --mode "$mode" -s 1048576 -D $bw_seconds -t 16 "${server_wait[@]}" > /dev/null
  [[ $env == tb ]] && pins=(--udp_port "$stellar_pin")
  local report
  report=$(mktemp)
  on "$env" "$client_node" env STELLAR_FAULT_DROP="$drop" python3 "$here/../cputime.py" "$cpu_log" timeout 90 "$bw_bin" "$s" --bind "$c" -p $port "${pins[@]}" \
    --mode "$mode" -s 1048576 -D $bw_seconds -t 16 --out_json "$report" | awk '$1 == 1048576 {printf "gbps=%.4f\n", $4 * 1048576 / 1e9}'
  reap
  cpu_per_gb "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['cpu']['bytes'])" "$report" 2> /dev/null || echo 0)"
  rm -f "$report"
  [[ $env == tb ]] && set_loss tb 0
  return 0
}
ucx_bw() {  # ENV -> GB/s; ucx_perftest's MB/s are 2^20 bytes
  local env=$1 s
  next_port
  s=$(addr "$env" "$server_node")
  : > "$cpu_log"
  background on "$env" "$server_node" env UCX_TLS=tcp python3 "$here/../cputime.py" "$cpu_log" timeout 60 ucx_perftest -p $port > /dev/null 2>&1
  wait_listen "$env" "$server_node" $port tcp
  on "$env" "$client_node" env UCX_TLS=tcp python3 "$here/../cputime.py" "$cpu_log" timeout 60 ucx_perftest "$s" -p $port -t tag_bw -s 1048576 -n 2000 2> /dev/null |
    awk '/^Final:/ {printf "gbps=%.4f\n", $7 * 1048576 / 1e9}'
  reap
  cpu_per_gb $((2000 * 1048576))
}
iperf_bw() {  # ENV LOSS_PCT -> GB/s; one TCP stream
  local env=$1 loss=$2 s pins=()
  next_port
  s=$(addr "$env" "$server_node")
  [[ $env == tb ]] && pins=(--cport "$(pin_port $port tcp)") && set_loss tb "$loss"
  : > "$cpu_log"
  background on "$env" "$server_node" python3 "$here/../cputime.py" "$cpu_log" timeout 60 iperf3 -s -1 -B "$s" -p $port > /dev/null 2>&1
  wait_listen "$env" "$server_node" $port tcp
  local bytes
  bytes=$(on "$env" "$client_node" python3 "$here/../cputime.py" "$cpu_log" timeout 60 iperf3 -c "$s" -p $port "${pins[@]}" -t $bw_seconds -J 2> /dev/null |
    python3 -c "import json,sys; e = json.load(sys.stdin)['end']['sum_received']; print('gbps=%.4f %d' % (e['bits_per_second'] / 8e9, e['bytes']))")
  echo "${bytes% *}"
  reap
  cpu_per_gb "${bytes##* }"
  [[ $env == tb ]] && set_loss tb 0
  return 0
}
incast() {  # MODE: 4 writers on leaf 1 -> host 2.1 behind a 1 Gbit/s tbf; 64 B latency flow 2.2 -> 2.1
  # The eight bandwidth processes wait adaptively (spin, then sleep): ten
  # busy-polling processes on a 2-core host would measure the scheduler.
  local mode=$1 h base lat_out started finished files=() writers=()
  "$testbed" set-rate 2 1 1gbit
  next_port; base=$port; port=$((port + 8))
  for h in 1 2 3 4; do
    background "$testbed" exec 2 1 timeout 90 "$bw_bin" --bind 10.2.1.2 -p $((base + h)) --mode "$mode" -s 65536 -D $incast_seconds -t 64 --wait adaptive > /dev/null
  done
  background "$testbed" exec 2 1 timeout 90 "$lat_bin" --bind 10.2.1.2 -p $base --mode "$mode" -s 64 -n $incast_lat_iters > /dev/null
  for h in 1 2 3 4; do
    files+=("$(mktemp)")
    "$testbed" exec 1 $h timeout 90 "$bw_bin" 10.2.1.2 --bind 10.1.$h.2 -p $((base + h)) --mode "$mode" -s 65536 \
      -D $incast_seconds -t 64 --wait adaptive > "${files[-1]}" &
    writers+=($!)
  done
  sleep 1  # let the writers fill the queue before sampling latency
  started=$(date +%s.%N)
  lat_out=$("$testbed" exec 2 2 timeout 90 "$lat_bin" 10.2.1.2 --bind 10.2.2.2 -p $base --mode "$mode" -s 64 -n $incast_lat_iters |
    awk '$1 == 64 {print "p50=" $5, "p99=" $8}')
  finished=$(date +%s.%N)
  wait "${writers[@]}" || true
  reap
  "$testbed" set-rate 2 1 off
  # Whether the latency samples all fell inside the incast (writers run incast_seconds from ~1 s before).
  echo "$lat_out" "gbps=$(cat "${files[@]}" | awk '$1 == 65536 {s += $4} END {printf "%.4f", s * 1048576 / 1e9}')" \
    "inside=$(awk -v a="$started" -v b="$finished" -v d=$incast_seconds 'BEGIN {print (b - a < d - 1.5) ? 1 : 0}')"
  rm -f "${files[@]}"
}

# ---- the case list: ENV KIND TRANSPORT SIZE LOSS ----
cases=()
if ((quick)); then
  cases=("lo lat stellar 64 0" "lo lat roce 64 0" "lo lat sockperf 64 0"
    "lo bw stellar 1048576 0" "lo bw roce 1048576 0" "lo bw stellar 1048576 1" "lo bw roce 1048576 1")
else
  envs=(lo)
  ((use_testbed)) && envs+=(tb)
  for env in "${envs[@]}"; do
    for size in 64 512 4096 32768; do
      for t in sockperf ucx stellar roce; do cases+=("$env lat $t $size 0"); done
    done
    for t in ucx iperf3; do cases+=("$env bw $t 1048576 0"); done
    for loss in 0 0.1 1; do
      for t in stellar roce; do cases+=("$env bw $t 1048576 $loss"); done
      [[ $env == tb && $loss != 0 ]] && cases+=("$env bw iperf3 1048576 $loss")
    done
    [[ $env == tb ]] && cases+=("tb incast stellar 64 0" "tb incast roce 64 0")
  done
fi

filtered=()
for c in "${cases[@]}"; do [[ $c =~ $only ]] && filtered+=("$c"); done
cases=("${filtered[@]}")
((${#cases[@]})) || { echo "compare: no case matches '$only'" >&2; exit 1; }
[[ " ${cases[*]}" == *" tb "* ]] || use_testbed=0

if ((use_testbed)); then
  "$testbed" up --spines 2 --hosts 4 --segment "$segment" > /dev/null
  testbed_up=1
  stellar_pin=$(pin_port 4791 udp)
fi

measure() {  # ENV KIND TRANSPORT SIZE LOSS
  case $2:$3 in
    lat:sockperf) sockperf_lat "$1" "$4" ;;
    lat:ucx) ucx_lat "$1" "$4" ;;
    lat:*) stellar_lat "$1" "$3" "$4" ;;
    bw:ucx) ucx_bw "$1" ;;
    bw:iperf3) iperf_bw "$1" "$5" ;;
    bw:*) stellar_bw "$1" "$3" "$5" ;;
    incast:*) incast "$3" ;;
  esac
}

total=$((rounds * ${#cases[@]})) done_cases=0 started=$(date +%s)
for ((r = 1; r <= rounds; r++)); do
  for c in "${cases[@]}"; do
    done_cases=$((done_cases + 1))
    elapsed=$(($(date +%s) - started))
    left=$((done_cases > 1 ? elapsed * (total - done_cases + 1) / (done_cases - 1) : 0))
    printf "# case %d/%d (round %d): %-32s ~%dm%02ds left\n" $done_cases $total $r "$c" $((left / 60)) $((left % 60)) >&2
    set -- $c
    result=$(measure "$@" 2> /dev/null || true)
    python3 - "$records" "$r" "$result" "$@" <<'EOF'
import json, sys
path, rnd, result, env, kind, transport, size, loss = sys.argv[1:9]
values = {}
for kv in result.split():
    k, _, v = kv.partition("=")
    try:
        values[k] = float(v)
    except ValueError:
        pass
with open(path, "a") as f:
    f.write(json.dumps({"env": env, "kind": kind, "transport": transport, "size": int(size),
                        "loss_pct": float(loss), "round": int(rnd), "values": values}) + "\n")
EOF
  done
done
echo "# measured $total cases in $(($(date +%s) - started)) s" >&2

python3 "$here/report.py" --records "$records" --out "$out" --rounds "$rounds" \
  --command "bench/compare/compare.sh $( ((quick)) && echo --quick) --rounds $rounds --build $build --segment $segment"
