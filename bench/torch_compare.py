#!/usr/bin/python3
"""torch.distributed allreduce and DDP step time: the stellar backend next to gloo.

Three backends: stellar with its shared-memory channel (the default on one
host), stellar on the network path (STELLAR_COLL_SHM=0: soft-RDMA over
loopback UDP) and gloo (TCP over loopback). Each runs in processes of its own
(an idle stellar group's engine would take CPU from gloo on a small host),
one backend after another, round after round, so they see the same machine;
each figure is the median of the rounds, each time the slowest rank's (the
op is done when all are).

    PYTHONPATH=BUILD/plugins/torch bench/torch_compare.py [--world 2 4] [--rounds 3]

Prints one markdown table per world size (time per op, bus bandwidth,
stellar / gloo ratios) and the DDP step time of a small MLP under each
backend. Float32, in place, sum. No assertion: timings belong here, not in
the tests.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stellar_torch  # noqa: F401  (registers the backend)

BACKENDS = ("stellar", "stellar-net", "gloo")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def human(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(seconds, control):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    return t.item()


def time_allreduce(group, control, tensor, iters):
    for _ in range(2):
        dist.all_reduce(tensor, group=group)
    dist.barrier(group=control)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    return slowest(time.perf_counter() - start, control) / iters


def ddp_step_time(group, control, rank, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier(group=control)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return slowest(time.perf_counter() - start, control) / steps, sum(p.numel() for p in model.parameters())


def worker(rank, world, port, backend, args, out):
    torch.set_num_threads(1)
    if backend == "stellar-net":
        os.environ["STELLAR_COLL_SHM"] = "0"
    dist.init_process_group("gloo" if backend == "gloo" else "stellar", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD  # also carries the timing exchange and barriers
    sizes = []
    size = args.min
    while size <= args.max:
        sizes.append(size)
        size *= 4
    if sizes[-1] != args.max:
        sizes.append(args.max)
    times = {}
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        iters = max(5, min(1000, (64 << 20) // size // 2))
        times[size] = time_allreduce(group, group, tensor, iters)
    step, params = ddp_step_time(group, group, rank, args.ddp_steps) if args.ddp_steps > 0 else (None, None)
    if rank == 0:
        counters = group.counters() if backend != "gloo" else None
        out[backend] = (times, step, params, counters)
    dist.barrier(group=group)
    dist.destroy_process_group()


def run_world(world, args):
    samples = {b: [] for b in BACKENDS}
    for _ in range(args.rounds):
        for b in BACKENDS:
            out = mp.Manager().dict()
            mp.spawn(worker, args=(world, free_port(), b, args, out), nprocs=world)
            samples[b].append(out[b])
    sizes = sorted(samples["gloo"][0][0])
    rows = [(size, {b: statistics.median(r[0][size] for r in samples[b]) for b in BACKENDS}) for size in sizes]
    ddp = {b: statistics.median(r[1] for r in samples[b]) for b in BACKENDS} if args.ddp_steps > 0 else None
    return rows, ddp, samples["gloo"][0][2], samples["stellar"][-1][3], samples["stellar-net"][-1][3]


def report(world, rows, ddp, params, shm_counters, net_counters):
    bus = 2 * (world - 1) / world
    print(f"\n### {world} processes: torch.distributed.all_reduce, float32, sum, in place (median of rounds)\n")
    print(f"stellar: shared-memory peers {shm_counters['shared_memory_peers']}, wait {shm_counters['wait']}; "
          f"stellar-net: shared-memory peers {net_counters['shared_memory_peers']}, wait {net_counters['wait']}\n")
    print("| size | stellar µs | stellar-net µs | gloo µs | stellar GB/s | stellar-net GB/s | gloo GB/s "
          "| stellar / gloo (bw) | stellar-net / gloo (bw) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, t in rows:
        bw = {b: size * bus / t[b] / 1e9 for b in BACKENDS}
        print(f"| {human(size)} | {t['stellar'] * 1e6:.1f} | {t['stellar-net'] * 1e6:.1f} | {t['gloo'] * 1e6:.1f} "
              f"| {bw['stellar']:.3f} | {bw['stellar-net']:.3f} | {bw['gloo']:.3f} "
              f"| {t['gloo'] / t['stellar']:.2f} | {t['gloo'] / t['stellar-net']:.2f} |")
    if ddp is None:  # --ddp-steps 0
        sys.stdout.flush()
        return
    print(f"\nDDP step (MLP 256-1024-1024-256, {params} parameters, batch 32, CPU): "
          + ", ".join(f"{b} {ddp[b] * 1e3:.2f} ms" for b in BACKENDS)
          + f"; stellar / gloo {ddp['stellar'] / ddp['gloo']:.2f}, stellar-net / gloo {ddp['stellar-net'] / ddp['gloo']:.2f}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min", type=parse_size, default=parse_size("1K"))
    parser.add_argument("--max", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ddp-steps", type=int, default=20, help="DDP steps to time (0: no DDP measurement)")
    args = parser.parse_args()
    if args.rounds < 1 or args.ddp_steps < 0 or args.min < 4 or args.max < args.min or any(w < 2 for w in args.world):
        parser.error("want --rounds >= 1, --ddp-steps >= 0, 4 <= --min <= --max, and worlds of 2 or more")
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, {datetime.datetime.now().isoformat(timespec='seconds')}")
    for world in args.world:
        report(world, *run_world(world, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
