#!/bin/bash
# Runs stellar_allreduce the three ways users launch it — forked local ranks
# (-N), a torchrun-style environment, and mpirun — and checks the
# nccl-tests-style table, the zero-wrong summary and the exit status; then a
# job whose second rank never comes must fail, not hang.
set -euo pipefail
bin="$1"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
row='^ +[0-9]+ +[0-9]+ +(float|half|bfloat16|double|int32|int64) +(sum|prod|min|max|avg) +[0-9.]+ +[0-9.]+ +[0-9.]+ +0 +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$'

check_table() {  # file, expected number of result rows
  grep -q '#       size         count      type   redop     time   algbw   busbw #wrong' "$1" || { echo "no column header"; cat "$1"; exit 1; }
  grep -q '^# Out of bounds values : 0 OK' "$1" || { echo "wrong values reported"; cat "$1"; exit 1; }
  grep -q '^# Avg bus bandwidth    : [0-9.e+-]\+' "$1" || { echo "no average bus bandwidth"; cat "$1"; exit 1; }
  local rows
  rows=$(grep -Ec "$row" "$1" || true)
  [[ $rows -eq $2 ]] || { echo "expected $2 result rows, found $rows"; cat "$1"; exit 1; }
}

echo "--- 3 forked ranks, every type, every reduction (sizes 4 B .. 64 KiB)"
"$bin" -N 3 -b 4 -e 64K -f 128 -n 2 -w 1 -d all -o all > "$work/forked" 
cat "$work/forked"
check_table "$work/forked" $((6 * 5 * 3))

echo "--- shared memory between the forked ranks by default, the network with --no-shm or STELLAR_COLL_SHM=0"
segments_before=$(ls /dev/shm | grep '^stellar-coll-' || true)
"$bin" -N 3 -b 1M -e 1M -n 2 -w 1 > "$work/shm"
check_table "$work/shm" 1
grep -q '^# transport: .*shared memory 2 of 2 peers (rank 0; 2 single-copy)' "$work/shm" || { echo "shared memory not reported"; cat "$work/shm"; exit 1; }
# Direct gather off: the pairs keep to their slots (no single copy), same results.
"$bin" -N 3 -b 1M -e 1M -n 2 -w 1 -c 1 --no-direct > "$work/shm-slots"
check_table "$work/shm-slots" 1
grep -q '^# transport: .*shared memory 2 of 2 peers (rank 0; 0 single-copy)' "$work/shm-slots" || { echo "--no-direct still single copy"; cat "$work/shm-slots"; exit 1; }
"$bin" -N 3 -b 1M -e 1M -n 2 -w 1 --no-shm > "$work/noshm"
check_table "$work/noshm" 1
grep -q '^# transport: .*shared memory off (--no-shm)' "$work/noshm" || { echo "--no-shm not reported"; cat "$work/noshm"; exit 1; }
STELLAR_COLL_SHM=0 "$bin" -N 2 -b 64K -e 64K -n 2 -w 1 > "$work/env-noshm"
grep -q '^# transport: .*shared memory off' "$work/env-noshm" || { echo "STELLAR_COLL_SHM=0 not honoured"; cat "$work/env-noshm"; exit 1; }
if STELLAR_COLL_SHM=maybe "$bin" -N 2 -b 8 -e 8 > "$work/env-bad" 2>&1; then echo "STELLAR_COLL_SHM=maybe accepted"; exit 1; fi
segments_after=$(ls /dev/shm | grep '^stellar-coll-' || true)
left=$(comm -13 <(echo "$segments_before" | sort) <(echo "$segments_after" | sort) | grep . || true)
[[ -z $left ]] || { echo "segments left in /dev/shm: $left"; exit 1; }

echo "--- torchrun-style environment, 2 ranks, 1 MiB..4 MiB (ring)"
port=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768-)
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$bin" -b 1M -e 4M -f 4 -n 3 -w 1 > "$work/env$r" 2>&1 &
done
wait
check_table "$work/env0" 2
cat "$work/env0"

if command -v mpirun > /dev/null; then
  echo "--- mpirun -np 2"
  port=$((port + 1))
  mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port \
    "$bin" -b 8K -e 8K -n 3 -w 1 -o avg > "$work/mpi" 2>&1
  check_table "$work/mpi" 1
  cat "$work/mpi"
else
  echo "--- mpirun not installed: that launch is not checked"
fi

echo "--- a rank that never arrives: rank 0 must fail within the timeout"
port=$((port + 1))
if RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$bin" --timeout 1500 -b 8 -e 8 > "$work/alone" 2>&1; then
  echo "a job with a missing rank succeeded"; cat "$work/alone"; exit 1
fi
grep -q "ranks arrived within" "$work/alone" || { echo "unclear error:"; cat "$work/alone"; exit 1; }
cat "$work/alone"
echo "allreduce example: ok"
