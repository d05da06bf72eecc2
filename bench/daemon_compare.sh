#!/bin/bash
# The engine daemon against the in-process engine, side by side in one run
# (issue 13's speed targets, docs/benchmarks.md "Engine daemon"):
#  1. application CPU seconds per GB moved, both processes of a 1 MiB RDMA
#     WRITE stream and both ranks of a 16 MiB allreduce, daemon / inline, both
#     with --wait adaptive (so neither is charged for spinning);
#  2. 8-byte WRITE messages per second over 16 QPs in the daemon placement,
#     with 1 and 2 shard threads (--cores);
#  3. 8-byte SEND latency (stellar_send_lat, half the round trip): typical
#     and p99, daemon (polling, as on a core of its own) vs inline, the
#     programs with --wait adaptive: on two cores a polling daemon and two
#     spinning programs would only measure the scheduler's time slice.
# Each figure is the median of ROUNDS runs (default 3), the placements
# alternating. Both ends run on this host, so in the daemon placement one
# daemon carries both sides' engines: its CPU is every engine's on the host.
# Usage: bench/daemon_compare.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
bw=$build/bench/stellar_write_bw
lat=$build/bench/stellar_send_lat
allreduce=$build/examples/stellar_allreduce
engined=$build/stellar-engined
dir=$(mktemp -d /tmp/stellar-daemon-compare.XXXXXX)
sock=$dir/engined.sock
daemon=
port=$((30000 + RANDOM % 10000))
next_port() { port=$((port + 1)); }
stop_daemon() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null || true; daemon=; fi
}
start_daemon() {  # cores wait
  stop_daemon
  "$engined" --socket "$sock" --foreground --cores "$1" --wait "$2" >>"$dir/daemon.log" 2>&1 &
  daemon=$!
  for _ in $(seq 200); do [[ -S $sock ]] && break; sleep 0.05; done
}
trap 'stop_daemon; rm -rf "$dir"' EXIT
export STELLAR_ENGINED_SOCKET=$sock
median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
# "# cpu: placement P; application X s = Y s/GB ..." -> X
app_seconds() { sed -n 's/.*; application \([0-9.]*\) s.*/\1/p'; }

write_stream() {  # placement -> "application-s-per-GB gbps" over both processes
  next_port
  STELLAR_ENGINE=$1 "$bw" -p $port -s 1048576 -n 3000 --wait adaptive >"$dir/server" 2>&1 &
  local s=$!
  sleep 0.3
  STELLAR_ENGINE=$1 "$bw" 127.0.0.1 -p $port -s 1048576 -n 3000 --wait adaptive >"$dir/client" 2>&1
  wait $s
  local app gb gbps
  app=$(cat "$dir/server" "$dir/client" | app_seconds | awk '{s += $1} END {print s}')
  gb=$(awk '$1 == 1048576 {print $2 * 1048576 / 1e9}' "$dir/client")
  gbps=$(awk '$1 == 1048576 {printf "%.3f", $4 * 1048576 / 1e9}' "$dir/client")
  echo "$(awk -v a="$app" -v g="$gb" 'BEGIN {printf "%.4f", a / g}') $gbps"
}
allreduce_16m() {  # placement -> application s/GB, the two ranks' figures summed (each per GB it reduced)
  STELLAR_ENGINE=$1 "$allreduce" -N 2 -b 16M -e 16M -n 20 -w 2 --wait adaptive --no-shm >"$dir/allreduce" 2>&1
  sed -n 's/.*application [0-9.]* s = \([0-9.]*\) s\/GB.*/\1/p' "$dir/allreduce" | awk '{s += $1} END {printf "%.4f", s}'
}
small_ops() {  # -> Mpps of 8-byte WRITEs over 16 QPs
  next_port
  "$bw" -p $port -s 8 -q 16 -t 1024 -n 400000 --wait adaptive >"$dir/server" 2>&1 &
  local s=$!
  sleep 0.3
  "$bw" 127.0.0.1 -p $port -s 8 -q 16 -t 1024 -n 400000 --wait adaptive >"$dir/client" 2>&1
  wait $s
  awk '$1 == 8 {printf "%.3f", $5}' "$dir/client"
}
latency_8() {  # placement -> "typical p99" one-way us
  next_port
  STELLAR_ENGINE=$1 "$lat" -p $port -s 8 -n 5000 --wait adaptive >"$dir/server" 2>&1 &
  local s=$!
  sleep 0.3
  STELLAR_ENGINE=$1 "$lat" 127.0.0.1 -p $port -s 8 -n 5000 --wait adaptive >"$dir/client" 2>&1
  wait $s
  awk '$1 == 8 {print $5, $8}' "$dir/client"
}

declare -A cpu gbps ar mpps p50 p99
for r in $(seq "$rounds"); do
  for placement in inline daemon; do
    [[ $placement == daemon ]] && start_daemon 1 adaptive || stop_daemon
    read -r c g < <(write_stream $placement)
    cpu[$placement]+="$c "
    gbps[$placement]+="$g "
    ar[$placement]+="$(allreduce_16m $placement) "
    # Latency wants the daemon polling, as on a SmartNIC core of its own.
    [[ $placement == daemon ]] && start_daemon 1 poll
    read -r a b < <(latency_8 $placement)
    p50[$placement]+="$a "
    p99[$placement]+="$b "
  done
  for cores in 1 2; do
    start_daemon $cores adaptive
    mpps[$cores]+="$(STELLAR_ENGINE=daemon small_ops) "
  done
  stop_daemon
done
m() { echo "$1" | tr ' ' '\n' | grep . | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}'; }
echo "| figure (median of $rounds) | inline | daemon | daemon / inline |"
echo "|---|---|---|---|"
ci=$(m "${cpu[inline]}"); cd=$(m "${cpu[daemon]}")
echo "| application CPU s/GB, 1 MiB WRITE stream, both processes | $ci | $cd | $(ratio "$cd" "$ci") |"
echo "| 1 MiB WRITE stream GB/s | $(m "${gbps[inline]}") | $(m "${gbps[daemon]}") | $(ratio "$(m "${gbps[daemon]}")" "$(m "${gbps[inline]}")") |"
ai=$(m "${ar[inline]}"); ad=$(m "${ar[daemon]}")
echo "| application CPU s/GB, allreduce 16 MiB, 2 ranks | $ai | $ad | $(ratio "$ad" "$ai") |"
echo "| 8 B SEND latency, typical us (daemon polling, programs adaptive) | $(m "${p50[inline]}") | $(m "${p50[daemon]}") | +$(awk -v a="$(m "${p50[daemon]}")" -v b="$(m "${p50[inline]}")" 'BEGIN {printf "%.2f", a - b}') us |"
echo "| 8 B SEND latency p99 us | $(m "${p99[inline]}") | $(m "${p99[daemon]}") | |"
echo
echo "| daemon shard threads | 8 B WRITEs, 16 QPs, M msgs/s |"
echo "|---|---|"
for cores in 1 2; do echo "| $cores | $(m "${mpps[$cores]}") |"; done
