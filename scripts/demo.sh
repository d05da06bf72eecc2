#!/bin/bash
# The demo: builds Stellar and runs the ping-pong example over loopback on
# the soft provider, in both wire modes, then once more with 1% injected loss;
# then the allreduce example (nccl-tests' all_reduce_perf format) on local
# ranks: a size sweep on 2 ranks over the network path and through shared
# memory, and every data type and reduction on 3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTELLAR_BUILD_TESTS=OFF -DSTELLAR_BUILD_BENCH=OFF > /dev/null
ninja -C build stellar_pingpong stellar_allreduce
bin=build/examples/stellar_pingpong
run() {  # mode, fault drop probability
  local port=$((21000 + RANDOM % 20000))
  STELLAR_FAULT_DROP=$2 "$bin" -p "$port" -s 8 -n 20000 --mode "$1" > /dev/null &
  local server=$!
  echo; echo "=== RDMA WRITE ping-pong, 8 bytes, mode $1, injected loss $2 ==="
  STELLAR_FAULT_DROP=$2 "$bin" 127.0.0.1 -p "$port" -s 8 -n 20000 --mode "$1"
  wait "$server"
}
run stellar 0
run roce 0
run stellar 0.01
run roce 0.01

echo; echo "=== allreduce, 2 local ranks over the soft provider (loopback UDP, --no-shm), float sum, 1 KiB .. 16 MiB ==="
build/examples/stellar_allreduce -N 2 -b 1K -e 16M -f 4 -n 10 -w 3 --no-shm
echo; echo "=== the same through the shared-memory channel (the default for ranks on one host) ==="
build/examples/stellar_allreduce -N 2 -b 1K -e 16M -f 4 -n 10 -w 3
echo; echo "=== allreduce, 3 local ranks, every data type and reduction, 8 B .. 64 KiB, checked ==="
build/examples/stellar_allreduce -N 3 -b 8 -e 64K -f 8 -n 3 -w 1 -d all -o all
