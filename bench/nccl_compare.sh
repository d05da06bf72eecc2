#!/bin/bash
# The NCCL net plugin (libnccl-net-stellar.so) through its harness, beside
# the perftest-style programs on the same transport, one invocation, same
# machine (issue 17): isend/irecv bandwidth at 4 KiB-64 MiB with 8 requests
# in flight (NCCL's steps per connection) against stellar_write_bw with a
# send queue of 8; 8-byte one-way latency (half the isend/irecv round trip)
# against stellar_pingpong. CPU seconds per GB moved, both processes, beside
# each bandwidth. Each figure is the median of ROUNDS rounds (default 3),
# plugin and program alternating. Loopback, soft provider, stellar mode.
# Usage: bench/nccl_compare.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
harness=$build/plugins/nccl/stellar_nccl_harness
bw=$build/bench/stellar_write_bw
pp=$build/examples/stellar_pingpong
cputime="python3 $(dirname "$0")/cputime.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=$((30000 + RANDOM % 10000))
sizes=(4096 16384 65536 262144 1048576 4194304 16777216 67108864)
count() { local c=$(( (2 << 30) / $1 )); ((c < 64)) && c=64; ((c > 200000)) && c=200000; echo $c; }  # as the harness

for ((r = 1; r <= rounds; r++)); do
  echo "round $r/$rounds" >&2
  NCCL_NET_PLUGIN=stellar LD_LIBRARY_PATH="$build/plugins/nccl" STELLAR_NCCL_ADDRESS=127.0.0.1 "$harness" bench 2> /dev/null > "$work/h.$r"
  awk '/^latency/ {print $6}' "$work/h.$r" >> "$work/lat.plugin"
  for s in "${sizes[@]}"; do
    awk -v s=$s '$1 == s {print $3, $4}' "$work/h.$r" >> "$work/bw.plugin.$s"
    port=$((port + 1)); n=$(count $s)
    $cputime "$work/cpu" "$bw" -p $port -s $s -n $n -t 8 > /dev/null & srv=$!
    sleep 0.3
    $cputime "$work/cpu" "$bw" 127.0.0.1 -p $port -s $s -n $n -t 8 | awk -v s=$s '$1 == s {printf "%.3f", $4 * 1048576 / 1e9}' > "$work/one"
    wait $srv
    echo "$(cat "$work/one") $(awk -v b=$((n * s)) '{c += $1} END {printf "%.4f", c / (b / 1e9)}' "$work/cpu")" >> "$work/bw.write.$s"
    rm -f "$work/cpu"
  done
  port=$((port + 1))
  "$pp" -p $port -s 8 -n 20000 > /dev/null & srv=$!
  "$pp" 127.0.0.1 -p $port -s 8 -n 20000 | awk '$1 == 8 {print $5}' >> "$work/lat.write"
  wait $srv
done

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
col() { awk -v c=$2 '{print $c}' "$1" | median; }
echo "# NCCL plugin (harness) vs stellar_write_bw / stellar_pingpong, loopback, median of $rounds"
printf "%10s %12s %12s %8s %14s %14s\n" bytes plugin_GB/s write_GB/s ratio plugin_cpu/GB write_cpu/GB
for s in "${sizes[@]}"; do
  p=$(col "$work/bw.plugin.$s" 1); w=$(col "$work/bw.write.$s" 1)
  pc=$(col "$work/bw.plugin.$s" 2); wc=$(col "$work/bw.write.$s" 2)
  printf "%10s %12s %12s %8.2f %14s %14s\n" $s $p $w "$(awk -v a=$p -v b=$w 'BEGIN {print a / b}')" $pc $wc
done
pl=$(median < "$work/lat.plugin"); wl=$(median < "$work/lat.write")
printf "8 B one-way latency: plugin %s us, stellar_pingpong %s us, ratio %.2f\n" $pl $wl "$(awk -v a=$pl -v b=$wl 'BEGIN {print a / b}')"
