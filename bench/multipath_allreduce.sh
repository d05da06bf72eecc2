#!/bin/bash
# A 4-rank allreduce across both leaves of the testbed (issue 14): stellar
# mode (each connection sprayed over 16 paths) beside roce mode (one path per
# QP, hashed by ECMP), on a healthy fabric and with one spine degraded.
# --no-shm: the namespaces share one kernel, and the fabric is the point.
#
# Ranks 0 and 1 sit on leaf 1 (hosts 1.1, 1.2), ranks 2 and 3 on leaf 2, so
# the ring crosses the spines twice (1 -> 2 and 3 -> 0). Every leaf–spine
# link is limited with tbf to RATE (default 200mbit) each way, spine 4's to
# RATE/10 in the degraded cases (each spine in turn: which spine a roce-mode
# QP hashes onto is fixed by its addresses and ports, so degrading each one
# in turn gives the average over where ECMP might have put it, and the
# worst): the fabric, not the two CPUs, is the limit.
# roce mode's DCQCN line rate is set to RATE (a NIC whose rate is one link's,
# as in bench/multipath_compare.sh). The 4 ranks share 2 cores, so they wait
# adaptively (--wait adaptive). The allreduce checks its results (-c 1).
#
#   bench/multipath_allreduce.sh BUILD [ROUNDS] [RATE]
#
# Stellar mode runs once more per degraded spine with that spine also marking
# every ECN-capable packet CE (testbed.sh set-mark: a switch whose queue is
# past its ECN threshold, as a degraded link's would be).
#
# Prints each run's in-place busbw per size (computed from the in-place time:
# size / time x 2(n-1)/n) and a summary: healthy (median over rounds), and
# degraded as the mean and the minimum over the four spines (each spine's
# figure the median over rounds).
set -euo pipefail
build=$(cd "${1:?usage: multipath_allreduce.sh BUILD [ROUNDS] [RATE]}" && pwd)
rounds=${2:-1}
rate=${3:-200mbit}
here=$(cd "$(dirname "$0")" && pwd)
testbed=$here/fabric/testbed.sh
allreduce=$build/examples/stellar_allreduce
[[ -x $allreduce ]] || { echo "no $allreduce"; exit 1; }
export STB_PREFIX=stba-
work=$(mktemp -d)
trap '"$testbed" down > /dev/null 2>&1 || true; rm -rf "$work"' EXIT
mbps=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(\w+)', sys.argv[1]); print(int(m[1]) * {'kbit': 1e-3, 'mbit': 1, 'gbit': 1000}[m[2]])" "$rate" | cut -d. -f1)
slow=$(python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(\w+)', sys.argv[1]); print(f'{int(m[1])//10}{m[2]}')" "$rate")

"$testbed" up --spines 4 --hosts 2 > /dev/null
limit_all() {  # RATE on every leaf–spine link, spine $1's (0: none) at RATE/10
  for s in 1 2 3 4; do
    local r=$rate
    ((s == $1)) && r=$slow
    "$testbed" set-link-rate 1 "$s" "$r"
    "$testbed" set-link-rate 2 "$s" "$r"
  done
}
master=$("$testbed" addr 1 1)
hosts=("1 1" "1 2" "2 1" "2 2")
sizes="1048576 2097152 4194304"  # -b 1M -e 4M -f 2
failures=0

# run LABEL MODE: one 4-rank allreduce; rank 0's table goes to $work/LABEL.out.
run() {
  local label=$1 mode=$2 port pids=() r rc=0
  port=$(shuf -i 30000-39999 -n 1)
  local extra=()
  [[ $mode == roce ]] && extra=(--line_rate_mbps "$mbps")
  for r in 0 1 2 3; do
    # shellcheck disable=SC2086
    "$testbed" exec ${hosts[$r]} \
      env RANK=$r WORLD_SIZE=4 MASTER_ADDR="$master" MASTER_PORT="$port" \
      timeout 300 "$allreduce" -b 1M -e 4M -f 2 -n 3 -w 1 -c 1 --wait adaptive --no-shm --timeout 20000 --mode "$mode" "${extra[@]}" \
      > "$work/$label.rank$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  if ((rc != 0)); then
    # A failed run is a result (roce mode's go-back-N can collapse on a slow
    # link): busbw 0 at every size, and the ranks' errors shown.
    # The rank that failed first says why; the others say it aborted.
    echo "$label: FAILED (exit $rc): $(grep -h -i -E 'error|fail|timed out' "$work/$label.rank"* | grep -v 'aborted the communicator' | head -2 | tr '\n' ' ')"
    for z in $sizes; do echo "$z 0 0"; done > "$work/$label.out"
    failures=$((failures + 1))
    return 0
  fi
  # size count type redop time algbw busbw wrong time algbw busbw wrong: in-place time is column 9
  awk '!/^#/ && NF >= 12 {printf "%s %.5f %s\n", $1, $1 / $9 / 1000 * 1.5, $12}' "$work/$label.rank0" > "$work/$label.out"
  awk '$3 != 0 {bad = 1} END {exit bad}' "$work/$label.out" || { echo "$label: wrong results"; cat "$work/$label.out"; exit 1; }
  echo "$label: $(awk '{printf "%s B %s GB/s; ", $1, $2}' "$work/$label.out")"
}

for ((round = 1; round <= rounds; round++)); do
  for spine in 0 1 2 3 4; do
    limit_all "$spine"
    # A run that collapses waits out the communicator's timeout (20 s without
    # progress); a healthy one takes a few seconds at these sizes.
    for mode in stellar roce; do run "s$spine-$mode-$round" "$mode"; done
    if ((spine > 0)); then
      "$testbed" set-mark spine "$spine" 100
      run "s$spine-marking-$round" stellar
      "$testbed" set-mark spine "$spine" 0
    fi
  done
done

ratio() { python3 -c "import sys; a, b = map(float, sys.argv[1:]); print(f'{a / b:.2f}' if b > 0 else 'inf')" "$1" "$2"; }
median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
figure() {  # SPINE MODE SIZE: the median over rounds
  for ((r = 1; r <= rounds; r++)); do awk -v z="$3" '$1 == z {print $2}' "$work/s$1-$2-$r.out"; done | median
}
echo
echo "4-rank allreduce busbw (in place, GB/s; median of $rounds rounds), leaf–spine links $rate, a degraded spine's $slow"
printf "%-16s %9s %9s %9s %7s %14s\n" scenario size stellar roce ratio "stellar+marks"
for size in $(awk '{print $1}' "$work/s0-stellar-1.out"); do
  s=$(figure 0 stellar "$size") c=$(figure 0 roce "$size")
  printf "%-16s %9s %9.4f %9.4f %7s\n" healthy "$size" "$s" "$c" "$(ratio "$s" "$c")"
  read -r smean smin < <(for sp in 1 2 3 4; do figure "$sp" stellar "$size"; done | awk '{t += $1; m = (NR == 1 || $1 < m) ? $1 : m} END {print t / NR, m}')
  read -r cmean cmin < <(for sp in 1 2 3 4; do figure "$sp" roce "$size"; done | awk '{t += $1; m = (NR == 1 || $1 < m) ? $1 : m} END {print t / NR, m}')
  read -r mmean mmin < <(for sp in 1 2 3 4; do figure "$sp" marking "$size"; done | awk '{t += $1; m = (NR == 1 || $1 < m) ? $1 : m} END {print t / NR, m}')
  printf "%-16s %9s %9.4f %9.4f %7s %14.4f\n" "degraded (mean)" "$size" "$smean" "$cmean" "$(ratio "$smean" "$cmean")" "$mmean"
  printf "%-16s %9s %9.4f %9.4f %7s %14.4f\n" "degraded (worst)" "$size" "$smin" "$cmin" "$(ratio "$smin" "$cmin")" "$mmin"
done
echo "failed runs (counted as busbw 0): $failures"
