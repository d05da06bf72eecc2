#!/bin/bash
# The SmartNIC placement end to end: stellar-engined built for aarch64, run
# under qemu-user, serves the x86-64 stellar_pingpong on both sides through
# the same rings and socket protocol as the native daemon. A correctness
# check (every round trip's marker must arrive), not a speed one: qemu
# translates every instruction.
#   engined_aarch64_test.sh AARCH64_STELLAR_ENGINED X86_STELLAR_PINGPONG
set -euo pipefail
engined=$1
pingpong=$2
# ELF e_machine (bytes 18-19): 0xb7 is EM_AARCH64.
[[ $(od -An -tx1 -j18 -N2 "$engined" | tr -d ' ') == b700 ]] || { echo "$engined is not an aarch64 program"; exit 1; }
dir=$(mktemp -d /tmp/stellar-aarch64.XXXXXX)
sock=$dir/engined.sock
daemon=
cleanup() {
  [[ -n $daemon ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
qemu-aarch64 -L /usr/aarch64-linux-gnu "$engined" --socket "$sock" --foreground --wait adaptive >"$dir/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 200); do [[ -S $sock ]] && break; sleep 0.05; done
[[ -S $sock ]] || { echo "the aarch64 daemon did not come up"; cat "$dir/daemon.log"; exit 1; }
export STELLAR_ENGINE=daemon STELLAR_ENGINED_SOCKET=$sock
for size in 8 4096 65536 1048576; do
  port=$((20000 + RANDOM % 12000))
  : >"$dir/server.log"
  timeout 120 "$pingpong" -p $port -s $size -n 20 --warmup 5 --adaptive >"$dir/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do grep -q 'waiting on' "$dir/server.log" && break; sleep 0.05; done
  if ! out=$(timeout 120 "$pingpong" -p $port -s $size -n 20 --warmup 5 --adaptive 127.0.0.1 2>&1); then
    echo "pingpong at $size bytes through the aarch64 daemon failed:"; echo "$out"; cat "$dir/server.log" "$dir/daemon.log"; exit 1
  fi
  wait $server || { echo "the server at $size bytes failed"; cat "$dir/server.log" "$dir/daemon.log"; exit 1; }
  echo "$out" | grep -qE "^ $size +20 " || { echo "no result row for $size bytes:"; echo "$out"; exit 1; }
  echo "$out" | grep -q 'placement daemon' || { echo "the client did not run in the daemon placement:"; echo "$out"; exit 1; }
  echo "$size bytes: $(echo "$out" | grep -E "^ $size " | awk '{print "typical", $5, "us over qemu"}')"
done
kill -0 $daemon || { echo "the aarch64 daemon died"; cat "$dir/daemon.log"; exit 1; }
# The last client's teardown may still be under way: give it a moment.
freed=0
for _ in $(seq 40); do
  freed=$(grep -c 'gone; its QPs' "$dir/daemon.log" || true)
  [[ $freed -ge 8 ]] && break
  sleep 0.05
done
[[ $freed -eq 8 ]] || { echo "the daemon freed $freed contexts, not 8:"; cat "$dir/daemon.log"; exit 1; }
echo "aarch64 stellar-engined (qemu-user) served x86-64 stellar_pingpong at 4 sizes, and freed all 8 contexts"
