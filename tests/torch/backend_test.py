#!/usr/bin/python3
"""Multi-process tests of the "stellar" torch.distributed backend (stellar_torch).

    backend_test.py ops      [--world N] [--shm 0|1]   every op and dtype against gloo
    backend_test.py ddp      [--world N] [--shm 0|1]   DDP, 20 steps: stellar's parameters == gloo's (torchrun)
    backend_test.py failures [--shm 0|1]               a killed rank, a hung rank, mismatched calls, bad arguments

Every rank runs each operation on the same inputs through a stellar group and
a gloo group and compares the outputs; where gloo does not support an
operation or dtype (AVG, reduce_scatter, bfloat16 ...) the output is compared
with the value computed locally from every rank's inputs (which are a
function of the rank), and for the rest it is compared with that too. The
inputs are small integers, so sums and products are exact in every dtype
and the comparison is exact (AVG of floats excepted).

Run with Debian's python3 (it has torch) and PYTHONPATH at the build's
plugins/torch. Exits non-zero, naming what differed, on any failure.
"""
import argparse
import copy
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stellar_torch  # registers the backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8]
R = dist.ReduceOp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def values(shape, dtype, rank, salt=0):
    """Rank `rank`'s input: small integers (|v| <= 5, or 0..10 unsigned)."""
    v = (torch.arange(numel(shape), dtype=torch.int64) * 7 + rank * 3 + salt) % 11
    if dtype != torch.uint8:
        v = v - 5
    return v.to(dtype).reshape(shape)


def factors(shape, dtype, rank):
    """Inputs for PRODUCT: 1, 2 (and -1 when signed), so products stay exact."""
    choices = torch.tensor([1, 2] if dtype == torch.uint8 else [1, 2, -1], dtype=torch.int64)
    return choices[(torch.arange(numel(shape)) + rank) % len(choices)].to(dtype).reshape(shape)


def is_float(dtype):
    return dtype.is_floating_point


def reference(op, inputs, dtype, world):
    """op over the ranks' inputs, computed in 64 bits and cast back."""
    wide = [x.to(torch.float64 if is_float(dtype) else torch.int64) for x in inputs]
    acc = wide[0].clone()
    for x in wide[1:]:
        if op == R.SUM or op == R.AVG:
            acc += x
        elif op == R.PRODUCT:
            acc *= x
        elif op == R.MIN:
            acc = torch.minimum(acc, x)
        elif op == R.MAX:
            acc = torch.maximum(acc, x)
        elif op == R.BAND:
            acc &= x
        elif op == R.BOR:
            acc |= x
        elif op == R.BXOR:
            acc ^= x
    if op == R.AVG:
        acc = acc / world if is_float(dtype) else torch.div(acc, world, rounding_mode="trunc")
    return acc.to(dtype)


class Checker:
    def __init__(self, rank, gloo):
        self.rank = rank
        self.gloo = gloo
        self.failures = []
        self.compared_with_gloo = 0
        self.compared_with_reference = 0

    def _same(self, a, b, exact):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if exact:
            return torch.equal(a, b)
        return torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=1e-2, atol=1e-2)

    def case(self, what, run, want=None, exact=True, with_gloo=True):
        """run(group) -> list of output tensors, on the stellar group and on
        gloo's; `want` (list) is the locally computed expectation."""
        got = run(None)
        try:
            theirs = run(self.gloo) if with_gloo else None
        except RuntimeError as e:  # gloo does not do this one (same on every rank: raised at the call)
            if not any(m in str(e) for m in ("does not support", "no support", "Unsupported", "not supported", "Invalid scalar type")):
                raise
            theirs = None
        if theirs is not None:
            self.compared_with_gloo += 1
            for i, (a, b) in enumerate(zip(got, theirs)):
                if not self._same(a, b, exact):
                    self.failures.append(f"rank {self.rank}: {what}: output {i} differs from gloo's:\n  stellar {a.flatten()[:8].tolist()}...\n  gloo    {b.flatten()[:8].tolist()}...")
        if want is not None:
            self.compared_with_reference += 1
            for i, (a, b) in enumerate(zip(got, want)):
                if not self._same(a, b, exact):
                    self.failures.append(f"rank {self.rank}: {what}: output {i} is not the expected value:\n  stellar {a.flatten()[:8].tolist()}...\n  want    {b.flatten()[:8].tolist()}...")


def ops_worker(rank, world, port, shm, results):
    os.environ["STELLAR_COLL_SHM"] = str(shm)
    dist.init_process_group("stellar", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    assert dist.get_backend() == "stellar"
    gloo = dist.new_group(backend="gloo")
    check = Checker(rank, gloo)
    ranks = range(world)

    for dtype in DTYPES:
        sizes = [1, 1003] + ([300_000] if dtype in (torch.float32, torch.bfloat16, torch.int64) else [])
        for n in sizes:
            tag = f"{dtype} x{n}"
            shape = (n,)
            # ---- all_reduce with every op torch has (bitwise: integers only) ----
            reduce_ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG] + ([] if is_float(dtype) else [R.BAND, R.BOR, R.BXOR])
            for op in reduce_ops:
                make = factors if op == R.PRODUCT else values
                inputs = [make(shape, dtype, r) for r in ranks]

                def run(group, op=op, make=make):
                    t = make(shape, dtype, rank)
                    if group is not None and op == R.AVG:
                        raise RuntimeError("gloo does not support AVG")
                    dist.all_reduce(t, op=op, group=group)
                    return [t]
                check.case(f"all_reduce {op} {tag}", run, [reference(op, inputs, dtype, world)], exact=not (op == R.AVG and is_float(dtype)))
            # PREMUL_SUM (NCCL's; sum of 2 * input here), checked against the reference only.
            premul = dist._make_nccl_premul_sum(2.0)
            if is_float(dtype):
                t = values(shape, dtype, rank)
                dist.all_reduce(t, op=premul)
                want = reference(R.SUM, [values(shape, dtype, r).to(torch.float64) * 2 for r in ranks], torch.float64, world).to(dtype)
                check.compared_with_reference += 1
                if not torch.equal(t, want):
                    check.failures.append(f"rank {rank}: all_reduce PREMUL_SUM(2) {tag}: {t[:4].tolist()} != {want[:4].tolist()}")
            inputs = [values(shape, dtype, r) for r in ranks]
            # ---- reduce to every root ----
            for root in ranks:
                for op in (R.SUM, R.MAX):
                    def run(group, root=root, op=op):
                        t = values(shape, dtype, rank)
                        dist.reduce(t, root, op=op, group=group)
                        return [t] if rank == root else []
                    check.case(f"reduce {op} root {root} {tag}", run, [reference(op, inputs, dtype, world)] if rank == root else [])
            # ---- broadcast from every root ----
            for root in ranks:
                def run(group, root=root):
                    t = values(shape, dtype, rank) if rank == root else torch.zeros(shape, dtype=dtype)
                    dist.broadcast(t, root, group=group)
                    return [t]
                check.case(f"broadcast root {root} {tag}", run, [inputs[root]])
            # ---- all_gather (list) and all_gather_into_tensor ----
            def run(group):
                outs = [torch.zeros(shape, dtype=dtype) for _ in ranks]
                dist.all_gather(outs, values(shape, dtype, rank), group=group)
                return outs
            check.case(f"all_gather {tag}", run, inputs)

            def run(group):
                out = torch.zeros((world * n,), dtype=dtype)
                dist.all_gather_into_tensor(out, values(shape, dtype, rank), group=group)
                return [out]
            check.case(f"all_gather_into_tensor {tag}", run, [torch.cat(inputs)])
            # ---- reduce_scatter (list) and reduce_scatter_tensor: rank r's block q is values(salt=q) ----
            blocks = [[values(shape, dtype, r, salt=q) for q in ranks] for r in ranks]
            want = reference(R.SUM, [blocks[r][rank] for r in ranks], dtype, world)
            def run(group):
                out = torch.zeros(shape, dtype=dtype)
                dist.reduce_scatter(out, [values(shape, dtype, rank, salt=q) for q in ranks], group=group)
                return [out]
            check.case(f"reduce_scatter {tag}", run, [want])

            def run(group):
                out = torch.zeros(shape, dtype=dtype)
                dist.reduce_scatter_tensor(out, torch.cat([values(shape, dtype, rank, salt=q) for q in ranks]), op=R.MAX, group=group)
                return [out]
            check.case(f"reduce_scatter_tensor max {tag}", run, [reference(R.MAX, [blocks[r][rank] for r in ranks], dtype, world)])
            # ---- all_to_all_single with uneven splits, and all_to_all (lists) ----
            def split(frm, to):
                return (frm + 2 * to + n) % 4 + n % 5
            def rows(frm, to):  # the rows rank `frm` sends to rank `to`: 3 columns each
                return values((split(frm, to), 3), dtype, frm, salt=to)
            def run(group):
                send = torch.cat([rows(rank, q) for q in ranks])
                out = torch.zeros((sum(split(q, rank) for q in ranks), 3), dtype=dtype)
                dist.all_to_all_single(out, send, [split(q, rank) for q in ranks], [split(rank, q) for q in ranks], group=group)
                return [out]
            check.case(f"all_to_all_single uneven {tag}", run, [torch.cat([rows(q, rank) for q in ranks])])

            def run(group):
                outs = [torch.zeros((split(q, rank), 3), dtype=dtype) for q in ranks]
                dist.all_to_all(outs, [rows(rank, q) for q in ranks], group=group)
                return outs
            check.case(f"all_to_all {tag}", run, [rows(q, rank) for q in ranks])
            # ---- gather and scatter ----
            root = n % world
            def run(group):
                outs = [torch.zeros(shape, dtype=dtype) for _ in ranks] if rank == root else None
                dist.gather(values(shape, dtype, rank), outs, dst=root, group=group)
                return outs or []
            check.case(f"gather root {root} {tag}", run, inputs if rank == root else [])

            def run(group):
                out = torch.zeros(shape, dtype=dtype)
                dist.scatter(out, [values(shape, dtype, root, salt=q) for q in ranks] if rank == root else None, src=root, group=group)
                return [out]
            check.case(f"scatter root {root} {tag}", run, [values(shape, dtype, root, salt=rank)])

    # ---- non-contiguous tensors: results land in the caller's strided views ----
    base = [values((40, 30), torch.float32, r) for r in ranks]
    def run(group):
        t = values((40, 30), torch.float32, rank).t()  # 30 x 40, not contiguous
        assert not t.is_contiguous()
        dist.all_reduce(t, group=group)
        return [t]
    check.case("all_reduce of a transposed tensor", run, [reference(R.SUM, base, torch.float32, world).t()])

    def run(group):
        outs = [torch.zeros((30, 40), dtype=torch.float32).t() for _ in ranks]  # 40 x 30 views
        dist.all_gather(outs, values((40, 30), torch.float32, rank)[:, :], group=group)
        return outs
    check.case("all_gather into transposed outputs", run, base)

    def run(group):
        t = (values((40, 60), torch.int64, rank) if rank == 0 else torch.zeros((40, 60), dtype=torch.int64))[:, ::2]
        dist.broadcast(t, 0, group=group)
        return [t]
    # Against the reference only: gloo (1.13) gets a strided slice wrong on the receiving ranks.
    check.case("broadcast of a strided slice", run, [values((40, 60), torch.int64, 0)[:, ::2]], with_gloo=False)

    # ---- send/recv and isend/irecv: a ring both ways, tags, sizes, a collective between ----
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        for n in (0, 1, 4097, 500_000):
            for dtype in (torch.float32, torch.int8):
                out_r = values((n,), dtype, rank, salt=1)
                out_l = values((n,), dtype, rank, salt=2)
                in_l, in_r = torch.zeros((n,), dtype=dtype), torch.zeros((n,), dtype=dtype)
                reqs = [dist.irecv(in_l, left, tag=11), dist.isend(out_r, right, tag=11),
                        dist.irecv(in_r, right, tag=22), dist.isend(out_l, left, tag=22)]
                for q in reqs:
                    q.wait()
                check.compared_with_reference += 2
                if not torch.equal(in_l, values((n,), dtype, left, salt=1)) or not torch.equal(in_r, values((n,), dtype, right, salt=2)):
                    check.failures.append(f"rank {rank}: isend/irecv ring of {n} {dtype}: wrong data")
        # Blocking send/recv into a non-contiguous tensor, then an allreduce.
        if rank == 0:
            dist.send(values((20, 20), torch.float64, 0), 1, tag=5)
        elif rank == 1:
            t = torch.zeros((20, 20), dtype=torch.float64).t()
            dist.recv(t, 0, tag=5)
            check.compared_with_reference += 1
            if not torch.equal(t, values((20, 20), torch.float64, 0)):
                check.failures.append(f"rank {rank}: send/recv into a transposed tensor: wrong data")
        t = torch.ones(7)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((7,), float(world))):
            check.failures.append(f"rank {rank}: all_reduce after point-to-point: {t.tolist()}")
    # ---- async_op: many in flight, then wait in reverse ----
    ts = [values((1000,), torch.float32, rank, salt=i) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
        assert w.is_completed() and w.is_success()
    futs = [dist.all_reduce(values((10,), torch.int32, rank), async_op=True).get_future() for _ in range(3)]
    for f in futs:
        v = f.wait()
        if not torch.equal(v[0], reference(R.SUM, [values((10,), torch.int32, r) for r in ranks], torch.int32, world)):
            check.failures.append(f"rank {rank}: a Work's future holds {v[0].tolist()}")
    for i, t in enumerate(ts):
        if not torch.equal(t, reference(R.SUM, [values((1000,), torch.float32, r, salt=i) for r in ranks], torch.float32, world)):
            check.failures.append(f"rank {rank}: async all_reduce {i} wrong")
    dist.barrier()
    counters = dist.group.WORLD.counters()
    if counters["shared_memory_peers"] != (world - 1 if shm else 0):
        check.failures.append(f"rank {rank}: {counters['shared_memory_peers']} shared-memory peers with STELLAR_COLL_SHM={shm}")
    results[rank] = (check.failures, check.compared_with_gloo, check.compared_with_reference)
    dist.destroy_process_group()


def ops(args):
    results = mp.Manager().dict()
    mp.spawn(ops_worker, args=(args.world, free_port(), args.shm, results), nprocs=args.world)
    failures = []
    for r in range(args.world):
        f, g, ref = results[r]
        print(f"rank {r}: {g} cases compared with gloo, {ref} with the reference, {len(f)} wrong")
        failures += f
    for f in failures[:40]:
        print(f)
    return 1 if failures or not results else 0


# ---- DDP under torchrun: the same model trained over stellar and over gloo ----

def ddp_worker():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("stellar", timeout=datetime.timedelta(seconds=60))  # env:// from torchrun
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    initial = [p.detach().clone() for p in template.parameters()]
    trained = {}
    for name, group in (("stellar", None), ("gloo", gloo)):
        model = copy.deepcopy(template)
        # Several small buckets: many allreduces a step, overlapping backward.
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.005)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(20):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
        trained[name] = [p.detach().clone() for p in model.parameters()]
    bad = []
    for i, (a, b, p0) in enumerate(zip(trained["stellar"], trained["gloo"], initial)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            bad.append(f"rank {rank}: parameter {i} differs, max |stellar - gloo| = {(a - b).abs().max().item():.3g}")
        if torch.equal(a, p0):
            bad.append(f"rank {rank}: parameter {i} never changed")
    # Every rank holds the same parameters.
    flat = torch.cat([p.flatten() for p in trained["stellar"]])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=R.MIN)
    dist.all_reduce(high, op=R.MAX)
    if not torch.equal(low, high):
        bad.append(f"rank {rank}: ranks disagree on the parameters")
    print(f"rank {rank}: DDP 20 steps, {len(trained['stellar'])} parameters, max |stellar - gloo| = "
          f"{max((a - b).abs().max().item() for a, b in zip(trained['stellar'], trained['gloo'])):.3g}", flush=True)
    for b in bad:
        print(b, flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


def ddp(args):
    # --redirects/--tee 1: torch 1.13's elastic agent on Python 3.11 cannot
    # parse the default "0" (IntFlag iteration skips the zero member, so
    # Std.from_str returns None and the agent fails before any worker runs).
    env = dict(os.environ, STELLAR_COLL_SHM=str(args.shm))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(args.world),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--redirects", "1", "--tee", "1",
           os.path.abspath(__file__), "ddp-worker"]
    return subprocess.run(cmd, env=env, timeout=600).returncode


# ---- failures: each child exits 0 when it saw what it should ----

def expect_error(what, fn, *needles):
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        if all(n in msg for n in needles):
            return msg
        raise AssertionError(f"{what}: the error does not say {needles}: {msg}")
    raise AssertionError(f"{what}: no error")


def failure_worker(rank, world, port, shm, scenario, timeout_s):
    os.environ["STELLAR_COLL_SHM"] = str(shm)
    try:
        dist.init_process_group("stellar", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        t = torch.ones(1000)
        dist.all_reduce(t)  # all are up
        if scenario == "killed":
            if rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            def loop():
                big = torch.ones(1 << 20)
                while True:
                    dist.all_reduce(big)
            msg = expect_error("allreduce with a killed rank", loop, "stellar")
            took = time.monotonic() - start
            print(f"rank {rank}: after {took:.2f} s: {msg[:200]}", flush=True)
            if took > timeout_s + 5:
                print(f"rank {rank}: the error came after {took:.1f} s, beyond the {timeout_s} s timeout", flush=True)
                os._exit(3)
        elif scenario == "hung":
            if rank == 1:
                time.sleep(timeout_s + 3)  # never calls; then leaves
                os._exit(0)
            start = time.monotonic()
            msg = expect_error("allreduce with a hung rank", lambda: dist.all_reduce(torch.ones(10)), "stellar")
            took = time.monotonic() - start
            print(f"rank {rank}: after {took:.2f} s: {msg[:200]}", flush=True)
            if took > timeout_s + 5:
                os._exit(3)
        elif scenario == "mismatch":
            n = 10 if rank == 0 else 20
            msg = expect_error("allreduce of different sizes", lambda: dist.all_reduce(torch.ones(n)), "stellar")
            print(f"rank {rank}: {msg[:200]}", flush=True)
        elif scenario == "arguments":
            # Refused at the call, on every rank alike, without communicating.
            expect_error("bool allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool)), "stellar", "Bool")
            expect_error("bitwise op on floats", lambda: dist.all_reduce(torch.ones(4), op=R.BAND), "stellar", "integer")
            expect_error("recv from any source", lambda: dist.recv(torch.ones(4)), "stellar", "source")
            expect_error("a root out of range", lambda: dist.group.WORLD.broadcast([torch.ones(4)], _opts(world + 3)), "stellar", "root")
            expect_error("all_to_all_single with bad splits", lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [1] * world, [3] * world),
                         "stellar", "splits")
            expect_error("all_gather into too few outputs", lambda: dist.all_gather([torch.zeros(4)], torch.zeros(4)), "stellar")
            t = torch.ones(5)
            dist.all_reduce(t)  # the group still works
            assert torch.equal(t, torch.full((5,), float(world))), t
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        os._exit(2)
    os._exit(0)


def _opts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o


def failures(args):
    ctx = mp.get_context("spawn")
    bad = 0
    for scenario, world, timeout_s in (("arguments", 2, 30), ("mismatch", 2, 10), ("hung", 2, 3), ("killed", 3, 10)):
        if args.only and scenario != args.only:
            continue
        port = free_port()
        procs = [ctx.Process(target=failure_worker, args=(r, world, port, args.shm, scenario, timeout_s)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 60)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        want = [0] * world
        if scenario == "killed":
            want[world - 1] = -signal.SIGKILL
        ok = codes == want
        print(f"{scenario} (STELLAR_COLL_SHM={args.shm}): exit codes {codes}, want {want}: {'ok' if ok else 'FAILED'}", flush=True)
        bad += not ok
    return 1 if bad else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test", choices=["ops", "ddp", "ddp-worker", "failures"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shm", type=int, choices=[0, 1], default=1)
    parser.add_argument("--only", help="failures: run this scenario alone")
    args = parser.parse_args()
    if args.test == "ddp-worker":
        return ddp_worker()
    return {"ops": ops, "ddp": ddp, "failures": failures}[args.test](args)


if __name__ == "__main__":
    sys.exit(main())
