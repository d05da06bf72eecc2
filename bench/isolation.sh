#!/bin/bash
# Tenant isolation in the engine daemon (issue 15, docs/scheduler.md): an
# 8-byte ping-pong of tenant "lat" alone and beside a bandwidth hog of tenant
# "hog" (64 KiB WRITEs, 128 deep), every context in one stellar-engined with
# a tenants file and a transmit rate, so that the daemon's scheduler shares
# the rate between the two applications. Prints, per round and as medians:
# the ping-pong's p50/p99 alone and beside the hog (ratio: goal <= 1.2), and
# the hog's bandwidth alone and beside the ping-pong (ratio: goal >= 0.9).
# Then a 2-rank 1 MiB allreduce loop of tenant "train" (weight 16) alone and
# beside a checkpoint stream of tenant "ckpt" (weight 1): the allreduce's
# time per iteration (ratio: goal <= 1.1) and what the checkpoint got.
# Last, the same allreduce beside misbehaviour: malformed datagrams sprayed
# at the allreduce's own UDP ports in the daemon, and a tenant "bad" whose
# streams are killed (kill -9) again and again mid-transfer (goal: the
# allreduce's time moves by at most 5%; "bad" has weight 1, so its streams
# while alive take their share as the checkpoint's do).
# Usage: bench/isolation.sh BUILD_DIR [ROUNDS] [TX_RATE_BYTES_PER_S]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
rate=${3:-200000000}
pp=$build/examples/stellar_pingpong
bw=$build/bench/stellar_write_bw
engined=$build/stellar-engined
dir=$(mktemp -d /tmp/stellar-isolation-XXXXXX)
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
cat > "$dir/tenants.json" <<'JSON'
{"tenants": [{"name": "lat", "credential": "lat-secret"}, {"name": "hog", "credential": "hog-secret"},
             {"name": "train", "credential": "train-secret", "weight": 16}, {"name": "ckpt", "credential": "ckpt-secret"},
             {"name": "bad", "credential": "bad-secret"}]}
JSON
"$engined" --socket "$dir/sock" --tenants "$dir/tenants.json" --tx-rate "$rate" --wait adaptive --foreground 2> "$dir/daemon.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$dir/sock" ] && break; sleep 0.05; done
export STELLAR_ENGINE=daemon STELLAR_ENGINED_SOCKET=$dir/sock
ar=$build/examples/stellar_allreduce
port=$((30000 + RANDOM % 10000))

pingpong() {  # -> "p50 p99" one-way µs (t_typical, 99% percentile)
  port=$((port + 1))
  STELLAR_TENANT_CREDENTIAL=lat-secret "$pp" -p $port -s 8 -n 5000 --adaptive --tenant lat --hint control > /dev/null &
  local s=$!
  STELLAR_TENANT_CREDENTIAL=lat-secret "$pp" 127.0.0.1 -p $port -s 8 -n 5000 --adaptive --tenant lat --hint control |
    awk '$1 == 8 {print $5, $8}'
  wait $s
}
hog_start() {  # SECONDS [TENANT]: starts the hog; its MB/s average lands in $dir/hog
  port=$((port + 1))
  local t=${2:-hog}
  STELLAR_TENANT_CREDENTIAL=$t-secret "$bw" -p $port -s 65536 -D "$1" --wait adaptive --tenant "$t" --hint checkpoint > /dev/null &
  hog_server=$!
  STELLAR_TENANT_CREDENTIAL=$t-secret "$bw" 127.0.0.1 -p $port -s 65536 -D "$1" --wait adaptive --tenant "$t" --hint checkpoint |
    awk '$1 == 65536 {print $4}' > "$dir/hog" &
  hog_client=$!
}
allreduce() {  # -> µs per 1 MiB allreduce (2 ranks, tenant train)
  STELLAR_TENANT_CREDENTIAL=train-secret "$ar" -N 2 -b 1M -e 1M -n 100 -w 5 --wait adaptive --no-shm --tenant train |
    awk '$1 == 1048576 {print $5}'
}
hog_wait() { wait $hog_client $hog_server; }  # not in $(...): a subshell cannot wait for our children

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
: > "$dir/results"
for r in $(seq "$rounds"); do
  read -r alone50 alone99 < <(pingpong)
  hog_start 4; sleep 1
  read -r with50 with99 < <(pingpong)
  hog_wait; hog_with=$(cat "$dir/hog")
  hog_start 4; hog_wait; hog_alone=$(cat "$dir/hog")
  echo "$alone50 $alone99 $with50 $with99 $hog_alone $hog_with" >> "$dir/results"
  echo "round $r: ping-pong p50/p99 alone $alone50/$alone99 us, beside the hog $with50/$with99 us;" \
       "hog alone $hog_alone MB/s, beside the ping-pong $hog_with MB/s"
done
col() { awk -v c="$1" '{print $c}' "$dir/results" | median; }
a50=$(col 1) a99=$(col 2) w50=$(col 3) w99=$(col 4) ha=$(col 5) hw=$(col 6)
echo "medians over $rounds rounds (daemon --tx-rate $rate, one shard):"
echo "  ping-pong p50 alone $a50 us, beside hog $w50 us: ratio $(awk -v a="$a50" -v b="$w50" 'BEGIN {printf "%.2f", b / a}')"
echo "  ping-pong p99 alone $a99 us, beside hog $w99 us: ratio $(awk -v a="$a99" -v b="$w99" 'BEGIN {printf "%.2f", b / a}') (goal <= 1.2)"
echo "  hog alone $ha MB/s, beside ping-pong $hw MB/s: ratio $(awk -v a="$ha" -v b="$hw" 'BEGIN {printf "%.2f", b / a}') (goal >= 0.9)"

: > "$dir/results"
for r in $(seq "$rounds"); do
  alone=$(allreduce)
  hog_start 8 ckpt; sleep 1
  beside=$(allreduce)
  hog_wait; ckpt=$(cat "$dir/hog")
  echo "$alone $beside $ckpt" >> "$dir/results"
  echo "round $r: allreduce 1 MiB alone $alone us, beside the checkpoint $beside us; checkpoint $ckpt MB/s"
done
a=$(col 1) b=$(col 2) c=$(col 3)
echo "  allreduce 1 MiB alone $a us, beside checkpoint $b us: ratio $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", b / a}') (goal <= 1.1); checkpoint got $c MB/s"

daemon_ports() { ss -Hulpn | awk -v p="pid=$daemon," 'index($0, p) {n = split($4, a, ":"); print a[n]}' | sort; }
# Malformed datagrams at PORTS for SECONDS, as fast as one Python sender can.
spray() {
  python3 - "$1" $2 <<'PY' &
import os, socket, sys, time
end = time.time() + float(sys.argv[1])
ports = [int(p) for p in sys.argv[2:]]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
n = 0
errors = {}
while time.time() < end:
    for p in ports:
        try:
            s.sendto(os.urandom(64), ("127.0.0.1", p))
            n += 1
        except OSError as e:
            errors[e.strerror] = errors.get(e.strerror, 0) + 1
print(n, "sent", *(f"{k}: {v}" for k, v in errors.items()), file=open(os.environ["SPRAY_COUNT"], "w"))
PY
  spray_pid=$!
}
crashes() {  # SECONDS: tenant bad's stream, killed -9 every 0.5 s and started again
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    hog_start 10 bad; sleep 0.5
    kill -9 $hog_client $hog_server 2>/dev/null || true
    wait $hog_client $hog_server 2>/dev/null || true
  done
}
export SPRAY_COUNT=$dir/spray
: > "$dir/results"
for r in $(seq "$rounds"); do
  alone=$(allreduce)
  # At the victim's own ports: the daemon's sockets that appear once the
  # allreduce's ranks have opened their contexts (they bootstrap first).
  daemon_ports > "$dir/ports-before"
  allreduce > "$dir/sprayed" & victim=$!
  targets=""
  for _ in $(seq 300); do
    targets=$(daemon_ports | comm -13 "$dir/ports-before" - | tr '\n' ' ')
    [ "$(echo $targets | wc -w)" -ge 2 ] && break
    sleep 0.01
  done
  spray 5 "$targets"
  wait $victim; sprayed=$(cat "$dir/sprayed")
  wait $spray_pid
  crashes 6 & crasher=$!
  sleep 1
  crashed=$(allreduce)
  wait $crasher
  echo "$alone $sprayed $crashed" >> "$dir/results"
  echo "round $r: allreduce 1 MiB alone $alone us, beside a malformed spray $sprayed us ($(cat "$dir/spray") datagrams in 5 s)," \
       "beside a tenant killed -9 every 0.5 s $crashed us"
done
a=$(col 1) b=$(col 2) c=$(col 3)
echo "  allreduce beside malformed spray: ratio $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", b / a}');" \
     "beside crashing tenant: ratio $(awk -v a="$a" -v b="$c" 'BEGIN {printf "%.2f", b / a}') (goal <= 1.05)"
grep -c "gone; its QPs freed" "$dir/daemon.log" | sed 's/^/  daemon: contexts cleaned up after their client went: /'
