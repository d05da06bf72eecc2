#!/bin/bash
# The demo: builds Stellar and runs the ping-pong example over loopback on
# the soft provider, in both wire modes, then once more with 1% injected loss.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTELLAR_BUILD_TESTS=OFF -DSTELLAR_BUILD_BENCH=OFF > /dev/null
ninja -C build stellar_pingpong
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
