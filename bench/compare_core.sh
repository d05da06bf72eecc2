#!/bin/bash
# Side-by-side figures for the core issue, one invocation, same machine:
# 8-byte one-way latency (stellar_pingpong vs sockperf busy-poll UDP vs UCX
# over TCP) and 1 MiB write bandwidth (stellar_write_bw vs UCX over TCP), plus
# goodput under 1% injected loss; beside every bandwidth the CPU seconds per
# GB moved, both processes, user + system (bench/cputime.py), for Stellar,
# UCX and a kernel TCP stream (iperf3). Each figure is the median of ROUNDS
# runs (default 3), the peers and Stellar alternating, so that drift on a
# shared machine hits both sides. Prints medians and ratios, then each
# round's own ratios beside the host's cross-CPU copy rate measured before
# and after that round's bandwidth runs (stellar_host_probe): on a VM that
# rate swings several-fold within minutes and every loopback stream swings
# with it (docs/benchmarks.md, "The slow mode"), so a ratio is only read
# against a round whose two probes agree.
# Usage: bench/compare_core.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
pp=$build/examples/stellar_pingpong
bw=$build/bench/stellar_write_bw
probe=$build/bench/stellar_host_probe
port=$((30000 + RANDOM % 10000))
next_port() { port=$((port + 1)); }
cputime="python3 $(dirname "$0")/cputime.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpu_per_gb() {  # CASE BYTES: both processes' CPU seconds (in $work/cpu) per GB, appended to $work/cpu.CASE
  awk -v b="$2" '{s += $1} END {printf "%.4f\n", s / (b / 1e9)}' "$work/cpu" >> "$work/cpu.$1"
  rm -f "$work/cpu"
}

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
  UCX_TLS=tcp $cputime "$work/cpu" ucx_perftest -p $port > /dev/null 2>&1 & local s=$!
  sleep 0.5
  UCX_TLS=tcp $cputime "$work/cpu" ucx_perftest 127.0.0.1 -p $port -t tag_bw -s 1048576 -n 3000 2>/dev/null | awk '/^Final:/ {print $7}'
  wait $s 2>/dev/null || true
  cpu_per_gb ucxb $((3000 * 1048576))
}
iperf_bw() {  # one kernel TCP stream, 3 s -> GB/s
  next_port
  $cputime "$work/cpu" iperf3 -s -1 -B 127.0.0.1 -p $port > /dev/null 2>&1 & local s=$!
  sleep 0.5
  $cputime "$work/cpu" iperf3 -c 127.0.0.1 -p $port -t 3 -J > "$work/iperf.json" 2> /dev/null
  wait $s 2>/dev/null || true
  python3 -c "import json,sys; e = json.load(open(sys.argv[1]))['end']['sum_received']; print('%.3f %d' % (e['bits_per_second'] / 8e9, e['bytes']))" \
    "$work/iperf.json" > "$work/iperf.out"
  cpu_per_gb tcpb "$(cut -d' ' -f2 "$work/iperf.out")"
  cut -d' ' -f1 "$work/iperf.out"
}
stellar_bw() {  # mode drop case -> GB/s
  next_port
  STELLAR_FAULT_DROP=$2 $cputime "$work/cpu" "$bw" -p $port --mode "$1" -s 1048576 -n 3000 -t 16 > /dev/null & local s=$!
  # perftest columns: #bytes #iterations BW-peak BW-average[MiB/s] MsgRate -> GB/s (1e9)
  STELLAR_FAULT_DROP=$2 $cputime "$work/cpu" "$bw" 127.0.0.1 -p $port --mode "$1" -s 1048576 -n 3000 -t 16 | awk '$1 == 1048576 {printf "%.3f", $4 * 1048576 / 1e9}'
  wait $s
  cpu_per_gb "$3" $((3000 * 1048576))
}

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
declare -A runs
# The 1 MiB streams compared in a goal run next to each other (UCX, Stellar,
# TCP), between two probes of the host.
cases=(sock ucxl sl rl pre ucxb sb tcpb post sbl rb rbl)
total=$((rounds * ${#cases[@]})); done_cases=0; started=$(date +%s)
measure() {
  case $1 in
    sock) sockperf_lat ;; ucxl) ucx_lat ;; sl) stellar_lat stellar ;; rl) stellar_lat roce ;;
    ucxb) ucx_bw ;; tcpb) iperf_bw ;; pre | post) "$probe" ;;
    sb) stellar_bw stellar 0 sb ;; sbl) stellar_bw stellar 0.01 sbl ;; rb) stellar_bw roce 0 rb ;; rbl) stellar_bw roce 0.01 rbl ;;
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
for c in ucxb tcpb sb sbl rb rbl; do declare "cpu_$c=$(median < "$work/cpu.$c")"; done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
ucxb_gbs=$(awk -v m="$ucxb" 'BEGIN { printf "%.3f", m * 1048576 / 1e9 }')  # ucx_perftest reports MB/s with MB = 2^20
echo
printf "%-48s %12s %10s\n" "measurement" "value" "ratio"
printf "%-48s %10s us %10s\n" "sockperf UDP ping-pong one-way p50" "$sock" "1.00"
printf "%-48s %10s us %10s\n" "UCX tcp tag_lat one-way p50" "$ucxl" "$(ratio "$ucxl" "$sock")"
printf "%-48s %10s us %10s\n" "stellar WRITE 8B one-way p50, stellar mode" "$sl" "$(ratio "$sl" "$sock")"
printf "%-48s %10s us %10s\n" "stellar WRITE 8B one-way p50, roce mode" "$rl" "$(ratio "$rl" "$sock")"
printf "%-48s %8s GB/s %10s\n" "UCX tcp tag_bw 1 MiB" "$ucxb_gbs" "1.00"
printf "%-48s %8s GB/s %10s\n" "iperf3 kernel TCP, one stream" "$tcpb" "$(ratio "$tcpb" "$ucxb_gbs")"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, stellar mode" "$sb" "$(ratio "$sb" "$ucxb_gbs")"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, stellar mode, 1% loss" "$sbl" "$(ratio "$sbl" "$sb") of lossless"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, roce mode" "$rb" "$(ratio "$rb" "$ucxb_gbs")"
printf "%-48s %8s GB/s %10s\n" "stellar WRITE 1 MiB, roce mode, 1% loss" "$rbl" "$(ratio "$rbl" "$rb") of lossless"
echo
printf "%-48s %10s %10s\n" "CPU seconds per GB, both processes" "s/GB" "vs TCP"
printf "%-48s %10s %10s\n" "iperf3 kernel TCP" "$cpu_tcpb" "1.00"
printf "%-48s %10s %10s\n" "UCX tcp tag_bw 1 MiB" "$cpu_ucxb" "$(ratio "$cpu_ucxb" "$cpu_tcpb")"
printf "%-48s %10s %10s\n" "stellar WRITE 1 MiB, stellar mode" "$cpu_sb" "$(ratio "$cpu_sb" "$cpu_tcpb")"
printf "%-48s %10s %10s\n" "stellar WRITE 1 MiB, stellar mode, 1% loss" "$cpu_sbl" "$(ratio "$cpu_sbl" "$cpu_tcpb")"
printf "%-48s %10s %10s\n" "stellar WRITE 1 MiB, roce mode" "$cpu_rb" "$(ratio "$cpu_rb" "$cpu_tcpb")"
printf "%-48s %10s %10s\n" "stellar WRITE 1 MiB, roce mode, 1% loss" "$cpu_rbl" "$(ratio "$cpu_rbl" "$cpu_tcpb")"

echo
echo "Each round on its own (host probe: cross-CPU copy GB/s before and after the round's streams;"
echo "a round whose two probes differ by more than 2x changed phase in the middle and is marked *)"
echo "and its 8 B one-way latencies (measured just before the probe), so that a latency ratio too is read within one phase"
printf "%-6s %15s %9s %9s %11s %13s %11s %11s %9s\n" "round" "probe GB/s" "stellar" "UCX" "bw vs UCX" "CPU vs TCP" "stellar us" "sockperf us" "lat ratio"
read -r -a pre_r <<< "${runs[pre]}"; read -r -a post_r <<< "${runs[post]}"
read -r -a sl_r <<< "${runs[sl]}"; read -r -a sock_r <<< "${runs[sock]}"
read -r -a sb_r <<< "${runs[sb]}"; read -r -a ucxb_r <<< "${runs[ucxb]}"
mapfile -t cpu_sb_r < "$work/cpu.sb"; mapfile -t cpu_tcpb_r < "$work/cpu.tcpb"
for ((r = 0; r < rounds; r++)); do
  u=$(awk -v m="${ucxb_r[r]}" 'BEGIN { printf "%.3f", m * 1048576 / 1e9 }')
  mark=$(awk -v a="${pre_r[r]}" -v b="${post_r[r]}" 'BEGIN { print (a == "n/a" || b == "n/a" || a > 2 * b || b > 2 * a) ? "*" : "" }')
  printf "%-6s %15s %9s %9s %11s %13s %11s %11s %9s\n" "$((r + 1))$mark" "${pre_r[r]} / ${post_r[r]}" "${sb_r[r]}" "$u" \
    "$(ratio "${sb_r[r]}" "$u")" "$(ratio "${cpu_sb_r[r]}" "${cpu_tcpb_r[r]}")" "${sl_r[r]}" "${sock_r[r]}" "$(ratio "${sl_r[r]}" "${sock_r[r]}")"
done
