#!/bin/bash
# Allreduce side by side, one invocation, same machine, same rank count and
# sizes: stellar_allreduce over the network path (--no-shm: loopback UDP,
# although the ranks share a host) and over its shared-memory channel,
# Gloo's ring allreduce over TCP (gloo_allreduce) and Open MPI's
# MPI_Allreduce over TCP and over shared memory (mpi_allreduce). The
# network figures compare with Gloo and MPI over TCP, the shared-memory
# ones with MPI over shared memory. float sum, in place, sizes 1 KiB..64 MiB by 4x. Each
# figure is the median of ROUNDS runs (default 3), the programs alternating
# so that drift on a shared machine hits all of them. Prints busbw (GB/s,
# nccl-tests' definition) per size with Stellar's ratios to each peer, and the
# 1 KiB times, then the CPU seconds per GB of each (all ranks, user +
# system, bench/cputime.py) for a 16 MiB allreduce loop, its start-up (a
# one-call run) subtracted; writes the tables as JSON to OUT (default
# bench-results/allreduce.json). Last, the host's cross-CPU copy rate
# (stellar_host_probe) measured before each run: on a VM it swings several
# fold within minutes and every program's figures with it (docs/benchmarks.md,
# "The slow mode is the host's"), so a ratio between runs of very different
# probes says more about the host than about the programs.
# Usage: bench/allreduce_compare.sh BUILD_DIR [ROUNDS] [RANKS] [OUT] [-- extra stellar_allreduce options]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
ranks=${3:-2}
out=${4:-bench-results/allreduce.json}
shift $(( $# < 4 ? $# : 4 ))
[[ ${1:-} == -- ]] && shift
extra=("$@")
# Two sweeps per run, the same for every program: up to 4 MiB 100 timed
# calls (ten of a 1 MiB allreduce last ~3 ms here, so one descheduling of
# a rank on this 2-vCPU VM moved a round's median by 30%), 16 and 64 MiB ten.
sweeps=("-b 1K -e 4M -f 4 -n 100 -w 10" "-b 16M -e 64M -f 4 -n 10 -w 3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"

mpi=(mpirun --allow-run-as-root --oversubscribe -np "$ranks" --bind-to none)
run() {  # tool round
  local f="$work/$1.$2" s
  : > "$f"
  for s in "${sweeps[@]}"; do
    read -r -a sweep <<< "$s"
    case $1 in
      stellar) "$build/examples/stellar_allreduce" -N "$ranks" "${sweep[@]}" -c 0 --no-shm "${extra[@]}" >> "$f" ;;
      stellar_shm) "$build/examples/stellar_allreduce" -N "$ranks" "${sweep[@]}" -c 0 "${extra[@]}" >> "$f" ;;
      gloo) "$build/bench/gloo_allreduce" -N "$ranks" "${sweep[@]}" >> "$f" ;;
      mpi_tcp) "${mpi[@]}" --mca btl self,tcp "$build/bench/mpi_allreduce" "${sweep[@]}" >> "$f" 2> /dev/null ;;
      mpi_shm) "${mpi[@]}" --mca btl self,vader "$build/bench/mpi_allreduce" "${sweep[@]}" >> "$f" 2> /dev/null ;;
    esac
  done
}

tools=(stellar stellar_shm gloo mpi_tcp mpi_shm)

# CPU per GB: a 16 MiB loop, minus the same program's start-up (one 8-byte call).
cputime="python3 $(dirname "$0")/cputime.py"
cpu_run() {  # tool size iterations
  local size=$2 n=$3
  case $1 in
    stellar) $cputime "$work/cpu.$1" "$build/examples/stellar_allreduce" -N "$ranks" -b "$size" -e "$size" -n "$n" -w 0 -c 0 --no-shm "${extra[@]}" ;;
    stellar_shm) $cputime "$work/cpu.$1" "$build/examples/stellar_allreduce" -N "$ranks" -b "$size" -e "$size" -n "$n" -w 0 -c 0 "${extra[@]}" ;;
    gloo) $cputime "$work/cpu.$1" "$build/bench/gloo_allreduce" -N "$ranks" -b "$size" -e "$size" -n "$n" -w 0 ;;
    mpi_tcp) $cputime "$work/cpu.$1" "${mpi[@]}" --mca btl self,tcp "$build/bench/mpi_allreduce" -b "$size" -e "$size" -n "$n" -w 0 ;;
    mpi_shm) $cputime "$work/cpu.$1" "${mpi[@]}" --mca btl self,vader "$build/bench/mpi_allreduce" -b "$size" -e "$size" -n "$n" -w 0 ;;
  esac > /dev/null 2>&1
}
cpu_iterations=40
total=$((rounds * ${#tools[@]})); n=0; started=$(date +%s)
for ((r = 1; r <= rounds; r++)); do
  for t in "${tools[@]}"; do
    n=$((n + 1))
    elapsed=$(($(date +%s) - started))
    left=$(( n > 1 ? elapsed * (total - n + 1) / (n - 1) : 0 ))
    printf '[%2d/%d] %-8s round %d   (elapsed %ds, about %ds left)\n' "$n" "$total" "$t" "$r" "$elapsed" "$left" >&2
    "$build/bench/stellar_host_probe" 500 > "$work/probe.$t.$r" 2> /dev/null || echo n/a > "$work/probe.$t.$r"
    run "$t" "$r"
  done
done

for t in "${tools[@]}"; do
  printf '[cpu] %-12s 16 MiB x %d, and its start-up\n' "$t" "$cpu_iterations" >&2
  cpu_run "$t" 8 1
  cpu_run "$t" 16M "$cpu_iterations"
done

python3 - "$work" "$rounds" "$ranks" "$out" "$cpu_iterations" "${tools[@]}" <<'PY'
import json, statistics, sys, platform, os
work, rounds, ranks, out, cpu_iterations, tools = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6:]
# nccl-tests rows: size count type redop time algbw busbw #wrong [in-place group]
results = {}  # tool -> size -> {"time": [...], "busbw": [...]}
for t in tools:
    for r in range(1, rounds + 1):
        for line in open(f"{work}/{t}.{r}"):
            f = line.split()
            if len(f) >= 8 and f[0].isdigit():
                size = int(f[0])
                # stellar_allreduce prints out-of-place then in-place; the peers run in place: compare in place.
                time, busbw = (float(f[8]), float(f[10])) if len(f) >= 12 else (float(f[4]), float(f[6]))
                d = results.setdefault(t, {}).setdefault(size, {"time": [], "busbw": []})
                d["time"].append(time); d["busbw"].append(busbw)
med = {t: {s: {k: statistics.median(v) for k, v in d.items()} for s, d in sz.items()} for t, sz in results.items()}
sizes = sorted(med.get("stellar", {}))
def human(b):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale: return f"{b // scale} {unit}"
    return f"{b} B"
print(f"\nallreduce, float sum, in place, {ranks} ranks, medians of {rounds} rounds")
print("stellar: network path (--no-shm), against gloo and mpi-tcp; stellar-shm: its shared-memory channel, against mpi-shm")
print(f"{'size':>9} | {'busbw GB/s: stellar':>19} {'stellar-shm':>11} {'gloo':>6} {'mpi-tcp':>8} {'mpi-shm':>8} | {'vs gloo':>7} {'vs mpi-tcp':>10} {'shm vs mpi-shm':>14} | {'time us: stellar':>16} {'gloo':>8} {'mpi-tcp':>8}")
rows = []
for s in sizes:
    g = lambda t, k: med.get(t, {}).get(s, {}).get(k, float("nan"))
    # Bandwidth ratios from the times (same bytes and ranks: busbw a / busbw b
    # = time b / time a): busbw is printed to 0.01 GB/s, so a small size's
    # ratio read off it was nan or a coarse step (Gloo's 4 KiB: 0.00 GB/s).
    ratio = lambda a, b: g(b, "time") / g(a, "time") if g(a, "time") > 0 else float("nan")
    row = {"bytes": s, **{f"{t}_busbw": g(t, "busbw") for t in tools}, **{f"{t}_time_us": g(t, "time") for t in tools}}
    rows.append(row)
    print(f"{human(s):>9} | {g('stellar','busbw'):19.3f} {g('stellar_shm','busbw'):11.3f} {g('gloo','busbw'):6.3f} {g('mpi_tcp','busbw'):8.3f} {g('mpi_shm','busbw'):8.3f} | "
          f"{ratio('stellar', 'gloo'):7.2f} {ratio('stellar', 'mpi_tcp'):10.2f} {ratio('stellar_shm', 'mpi_shm'):14.2f} | "
          f"{g('stellar','time'):16.1f} {g('gloo','time'):8.1f} {g('mpi_tcp','time'):8.1f}")
small = med.get("stellar", {}).get(1024, {}).get("time"), med.get("gloo", {}).get(1024, {}).get("time")
if all(small):
    print(f"\n1 KiB: stellar {small[0]:.1f} us = {small[0] / small[1]:.2f}x Gloo's {small[1]:.1f} us (target <= 0.25x)")
# CPU seconds (every rank, user + system) per GB of allreduce vector: the
# 16 MiB run minus the one-call start-up, over its calls (stellar_allreduce
# runs each iteration out of place and in place: twice the calls).
cpu = {}
for t in tools:
    try:
        startup, loop = [float(x) for x in open(f"{work}/cpu.{t}").read().split()[:2]]
    except (OSError, ValueError):
        continue
    calls = cpu_iterations * (2 if t.startswith("stellar") else 1)
    cpu[t] = max(loop - startup, 0.0) / (calls * 16 * 1048576 / 1e9)
if cpu:
    print(f"\nCPU seconds per GB reduced, all {ranks} ranks, 16 MiB x {cpu_iterations}, start-up subtracted:")
    for t in tools:
        if t in cpu:
            base = cpu.get("mpi_shm" if t == "stellar_shm" else "mpi_tcp")
            print(f"  {t:12s} {cpu[t]:7.3f} s/GB" + (f"  ({cpu[t] / base:.2f}x {'mpi-shm' if t == 'stellar_shm' else 'mpi-tcp'})" if base and t.startswith("stellar") else ""))
json.dump({"machine": f"{platform.node()} {os.cpu_count()} cpus", "ranks": ranks, "rounds": rounds, "rows": rows, "cpu_s_per_gb_16MiB": cpu},
          open(out, "w"), indent=1)
print(f"JSON: {out}")
PY

echo
echo "host probe before each run (cross-CPU copy GB/s, stellar_host_probe):"
printf '%-6s' round; printf ' %11s' "${tools[@]}"; echo
for ((r = 1; r <= rounds; r++)); do
  printf '%-6s' "$r"
  for t in "${tools[@]}"; do printf ' %11s' "$(cat "$work/probe.$t.$r")"; done
  echo
done
