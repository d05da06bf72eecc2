#!/usr/bin/env python3
"""Turns compare.sh's records (one JSON line per case and round) into the
comparison table (stdout and compare.md), compare.json and the PNG plots.

Each figure is the median over rounds. Ratios: latency against sockperf (raw
UDP, the floor of a UDP transport); bandwidth, goodput and incast against
`roce` mode, the raw-RoCEv2 baseline for `stellar` mode.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
from collections import defaultdict

TRANSPORTS = ["stellar", "roce", "ucx", "iperf3", "sockperf"]
HEADERS = {"stellar": "stellar", "roce": "roce", "ucx": "UCX-tcp", "iperf3": "TCP", "sockperf": "UDP"}
ENV_NAMES = {"lo": "loopback", "tb": "testbed"}
LOSS_MECHANISM = {"lo": "STELLAR_FAULT_DROP in both processes (stellar/roce only)",
                  "tb": "nftables drop on spine 1; flows pinned to spine 1 both ways"}


def load(path):
    runs = defaultdict(lambda: defaultdict(list))
    for line in open(path):
        r = json.loads(line)
        key = (r["env"], r["kind"], r["transport"], r["size"], r["loss_pct"])
        for k, v in r["values"].items():
            runs[key][k].append(v)
    return runs


def median(runs, key, value):
    v = runs.get(key, {}).get(value, [])
    return statistics.median(v) if v else None


def fmt(v, digits=2):
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:.0f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def build_rows(runs):
    """Rows of (env, measurement, unit, {transport: value}, ratio, baseline, note)."""
    rows = []
    envs = [e for e in ("lo", "tb") if any(k[0] == e for k in runs)]
    for env in envs:
        sizes = sorted({k[3] for k in runs if k[0] == env and k[1] == "lat"})
        for pct in ("p50", "p99"):
            for size in sizes:
                vals = {t: median(runs, (env, "lat", t, size, 0.0), pct) for t in TRANSPORTS}
                rows.append((env, f"latency {size} B one-way {pct}", "us", vals,
                             ratio(vals["stellar"], vals["sockperf"]), "UDP", ""))
        losses = sorted({k[4] for k in runs if k[0] == env and k[1] == "bw"})
        for loss in losses:
            vals = {t: median(runs, (env, "bw", t, 1048576, loss), "gbps") for t in TRANSPORTS}
            name = "1 MiB bandwidth" if loss == 0 else f"1 MiB goodput, {loss:g}% loss"
            rows.append((env, name, "GB/s", vals, ratio(vals["stellar"], vals["roce"]), "roce",
                         LOSS_MECHANISM[env] if loss else ""))
            cpu = {t: median(runs, (env, "bw", t, 1048576, loss), "cpu") for t in TRANSPORTS}
            if any(v is not None for v in cpu.values()):
                rows.append((env, (name.replace("bandwidth", "CPU per GB") if loss == 0 else f"1 MiB CPU per GB, {loss:g}% loss"),
                             "s/GB", cpu, ratio(cpu["stellar"], cpu["iperf3"]), "TCP",
                             "both processes, user + system (bench/cputime.py)"))
        if any(k[0] == env and k[1] == "incast" for k in runs):
            note = "tbf 1gbit, 256 KB queue on leaf 2's downlink to the receiver"
            for t in ("stellar", "roce"):
                inside = runs.get((env, "incast", t, 64, 0.0), {}).get("inside", [])
                if inside and min(inside) < 1:
                    note += f"; {t}: latency run outlasted the incast in {inside.count(0.0)} of {len(inside)} rounds"
            for value, name, unit in (("p50", "incast 4:1, 64 B latency p50", "us"),
                                      ("p99", "incast 4:1, 64 B latency p99", "us"),
                                      ("gbps", "incast 4:1, aggregate goodput", "GB/s")):
                vals = {t: median(runs, (env, "incast", t, 64, 0.0), value) for t in TRANSPORTS}
                rows.append((env, name, unit, vals, ratio(vals["stellar"], vals["roce"]), "roce", note))
    return rows


def table_text(rows):
    head = ["env", "measurement", "unit"] + [HEADERS[t] for t in TRANSPORTS] + ["stellar/base", "base"]
    body = [[ENV_NAMES[r[0]], r[1], r[2]] + [fmt(r[3][t], 3 if r[2] == "GB/s" else 2) for t in TRANSPORTS]
            + [fmt(r[4]), r[5]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    text = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(text), "\n".join(md)


def targets(runs):
    out = []
    s = median(runs, ("tb", "bw", "stellar", 1048576, 1.0), "gbps")
    r = median(runs, ("tb", "bw", "roce", 1048576, 1.0), "gbps")
    x = ratio(s, r)
    out.append({"target": "testbed, 1% loss on one spine: stellar goodput >= 3x roce", "stellar": s, "roce": r,
                "ratio": x, "met": None if x is None else x >= 3.0})
    s = median(runs, ("tb", "incast", "stellar", 64, 0.0), "p99")
    r = median(runs, ("tb", "incast", "roce", 64, 0.0), "p99")
    x = ratio(s, r)
    out.append({"target": "4-to-1 incast, 64 B write p99: stellar <= 0.5x roce", "stellar_us": s, "roce_us": r,
                "ratio": x, "met": None if x is None else x <= 0.5})
    return out


def plots(runs, out):
    """gnuplot: latency p50 vs message size; goodput vs loss rate."""
    series = []
    for env in ("lo", "tb"):
        for t in TRANSPORTS:
            pts = sorted((k[3], median(runs, k, "p50")) for k in runs if k[:3] == (env, "lat", t))
            pts = [p for p in pts if p[1] is not None]
            if pts:
                series.append((f"{ENV_NAMES[env]} {HEADERS[t]}", pts))
    lat_data = os.path.join(out, "latency.dat")
    with open(lat_data, "w") as f:
        for name, pts in series:
            f.write(f'"{name}"\n' + "".join(f"{x} {y}\n" for x, y in pts) + "\n\n")
    loss_series = []
    for env in ("lo", "tb"):
        for t in TRANSPORTS:
            pts = sorted((k[4], median(runs, k, "gbps")) for k in runs if k[:3] == (env, "bw", t) and k[3] == 1048576)
            pts = [p for p in pts if p[1] is not None]
            if len(pts) > 1:
                loss_series.append((f"{ENV_NAMES[env]} {HEADERS[t]}", pts))
    loss_data = os.path.join(out, "goodput_loss.dat")
    with open(loss_data, "w") as f:
        for name, pts in loss_series:
            f.write(f'"{name}"\n' + "".join(f"{x} {y}\n" for x, y in pts) + "\n\n")

    def plot_cmd(n, data):
        if n == 0:  # nothing measured for this plot (e.g. --only): an empty frame that says so
            return "[1:2] -1 notitle"
        return ", ".join(f"'{data}' index {i} using 1:2 with linespoints title columnheader(1)" for i in range(n))

    script = f"""
set terminal pngcairo size 900,600 noenhanced
set grid
set key outside right
set output '{os.path.join(out, "latency.png")}'
set title 'One-way latency p50 vs message size (median of rounds)'
set logscale x 2
set logscale y
set xlabel 'message size [bytes]'
set ylabel 'latency [us]'
{"set yrange [0:1]; set label 'no data' at graph 0.5,0.5 center" if not series else ""}
plot {plot_cmd(len(series), lat_data)}
unset label
set output '{os.path.join(out, "goodput_loss.png")}'
set title '1 MiB goodput vs loss rate'
unset logscale x
unset logscale y
set xlabel 'loss [%]'
set ylabel 'goodput [GB/s]'
set yrange [0:*]
{"set yrange [0:1]; set label 'no data' at graph 0.5,0.5 center" if not loss_series else ""}
plot {plot_cmd(len(loss_series), loss_data)}
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    runs = load(a.records)
    rows = build_rows(runs)
    text, md = table_text(rows)
    tg = targets(runs)
    load_avg = os.getloadavg()
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, load average {load_avg[0]:.2f} at the end"
    print()
    print(text)
    print()
    for env in sorted({r[0] for r in rows if r[6] and "loss" in r[1]}):
        print(f"loss on {ENV_NAMES[env]}: {LOSS_MECHANISM[env]}")
    for note in sorted({r[6] for r in rows if r[1].startswith("incast")}):
        print(f"incast: {note}")
    for t in tg:
        if t["ratio"] is not None:
            print(f"target: {t['target']}: ratio {t['ratio']:.2f} -> {'met' if t['met'] else 'NOT met'}")
    with open(os.path.join(a.out, "compare.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "compare.md"), "w") as f:
        f.write(md + "\n")
    doc = {
        "command": a.command, "machine": machine, "rounds": a.rounds, "statistic": "median over rounds",
        "loss_mechanism": LOSS_MECHANISM,
        "rows": [{"env": ENV_NAMES[r[0]], "measurement": r[1], "unit": r[2],
                  "values": {t: v for t, v in r[3].items() if v is not None},
                  "ratio_stellar_to_base": r[4], "base": r[5], "note": r[6]} for r in rows],
        "targets": tg,
        "runs": [{"env": k[0], "kind": k[1], "transport": k[2], "size": k[3], "loss_pct": k[4], "values": v}
                 for k, v in sorted(runs.items())],
    }
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump(doc, f, indent=2)
    plots(runs, a.out)
    print(f"\nwrote {a.out}/compare.txt, compare.md, compare.json, latency.png, goodput_loss.png")


if __name__ == "__main__":
    main()
