#!/bin/bash
# Side-by-side figures for the core issue, one invocation, same machine:
# 8-byte one-way latency (stellar_pingpong vs sockperf busy-poll UDP vs UCX
# over TCP) and 1 MiB write bandwidth (stellar_write_bw vs UCX over TCP), plus
# goodput under 1% injected loss. Each figure is the median of ROUNDS runs
# (default 3), the peers and Stellar alternating, so that drift on a shared
# machine hits both sides. Prints medians and ratios.
# Usage: bench/compare_core.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
pp=$build/examples/stellar_pingpong
bw=$build/bench/stellar_write_bw
port=$((30000 + RANDOM % 10000))
next_port() { port=$((port + 1)); }

stellar_lat() {  # mode -> median one-way µs
  next_port
  "$pp" -p $port -s 8 -n 20000 --mode "$1" > /dev/null & local s=$!
  "$pp" 127.0.0.1 -p $port -s 8 -n 20000 --mode "$1" | awk '$1 == 8 {print $5}'
  wait $s
}
sockperf_lat() {
  next_port
  sockperf server -i 127.0.0.1 -p $port --nonblocked > /dev/null 2>&1 & local s=$!
  sleep 0.5
  sockperf ping-pong -i 127.0.0.1 -p $port --nonblocked -m 16 -t 5 2>&1 | awk '/percentile 50.000/ {print $NF}'
  kill $s; wait $s 2>/dev/null || true
}
ucx_lat() {
  next_port
  UCX_TLS=tcp ucx_perftest -p $port > /dev/null 2>&1 & local s=$!
  sleep 0.5
  UCX_TLS=tcp ucx_perftest 127.0.0.1 -p $port -t tag_lat -s 8 -n 20000 2>/dev/null | awk '/^Final:/ {print $3}'
  wait $s 2>/dev/null || true
}
ucx_bw() {  # -> MB/s
  next_port
  UCX_TLS=tcp ucx_perftest -p $port > /dev/null 2>&1 & local s=$!
  sleep 0.5
  UCX_TLS=tcp ucx_perftest 127.0.0.1 -p $port -t tag_bw -s 1048576 -n 2000 2>/dev/null | awk '/^Final:/ {print $7}'
  wait $s 2>/dev/null || true
}
stellar_bw() {  # mode drop -> GB/s
  next_port
  STELLAR_FAULT_DROP=$2 "$bw" -p $port --mode "$1" -s 1048576 -n 1000 -t 16 > /dev/null & local s=$!
  # perftest columns: #bytes #iterations BW-peak BW-average[MiB/s] MsgRate -> GB/s (1e9)
  STELLAR_FAULT_DROP=$2 "$bw" 127.0.0.1 -p $port --mode "$1" -s 1048576 -n 1000 -t 16 | awk '$1 == 1048576 {printf "%.3f", $4 * 1048576 / 1e9}'
  wait $s
}

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
declare -A runs
cases=(sock ucxl sl rl ucxb sb sbl rb rbl)
total=$((rounds * ${#cases[@]})); done_cases=0; started=$(date +%s)
measure() {
  case $1 in
    sock) sockperf_lat ;; ucxl) ucx_lat ;; sl) stellar_lat stellar ;; rl) stellar_lat roce ;;
    ucxb) ucx_bw ;; sb) stellar_bw stellar 0 ;; sbl) stellar_bw stellar 0.01 ;; rb) stellar_bw roce 0 ;; rbl) stellar_bw roce 0.01 ;;
  esac
}
for ((r = 1; r <= rounds; r++)); do
  for c in "${cases[@]}"; do
    done_cases=$((done_cases + 1))
    elapsed=$(($(date +%s) - started))
    echo "# case $done_cases/$total: $c (round $r), about $((elapsed * (total - done_cases + 1) / done_cases))s left" >&2
    runs[$c]+="$(measure "$c") "
  done
done
for c in "${cases[@]}"; do declare "$c=$(echo ${runs[$c]} | tr ' ' '\n' | median)"; done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
ucxb_gbs=$(awk -v m="$ucxb" 'BEGIN { printf "%.3f", m * 1048576 / 1e9 }')  # ucx_perftest reports MB/s with MB = 2^20
echo
printf "%-48s %12s %10s\n" "measurement" "value" "ratio"
printf "%-48s %10s us %10s\n" "sockperf UDP ping-pong one-way p50" "$sock" "1.00"
printf "%-48s %10s us %10s\n" "UCX tcp tag_lat one-way p50" "$ucxl" "$(ratio "$ucxl" "$sock")"
printf "%-48s %10s us %10s\n" "stellar WRITE 8B one-way p50, stellar mode" "$sl" "$(ratio "$sl" "$sock")"
printf "%-48s %10s us %10s\n" "stellar WRITE 8B one-way p50, roce mode" "$rl" "$(ratio "$rl" "$sock")"
printf "%-48s %8s GB/s %10s\n" "UCX tcp tag_bw 1 MiB" "$ucxb_gbs" "1.00"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, stellar mode" "$sb" "$(ratio "$sb" "$ucxb_gbs")"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, stellar mode, 1% loss" "$sbl" "$(ratio "$sbl" "$sb") of lossless"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, roce mode" "$rb" "$(ratio "$rb" "$ucxb_gbs")"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, roce mode, 1% loss" "$rbl" "$(ratio "$rbl" "$rb") of lossless"
