#!/bin/bash
# Smoke test of the comparison run: `bench/compare/compare.sh --quick`
# (loopback only, one round) must print the table and write the JSON and both
# PNG plots. Checks that they exist and are well formed, never the figures.
# Usage: tests/testbed/compare_smoke_test.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
trap 'exit 130' INT TERM
log=$out/stdout.txt
"$here/../../bench/compare/compare.sh" --quick --build "$build" --out "$out" | tee "$log"

grep -q "latency 64 B one-way p50" "$log" || { echo "FAIL: no latency row in the table"; exit 1; }
grep -q "1 MiB goodput, 1% loss" "$log" || { echo "FAIL: no loss row in the table"; exit 1; }
python3 - "$out/compare.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
rows = {r["measurement"]: r for r in d["rows"]}
for name in ("latency 64 B one-way p50", "1 MiB bandwidth", "1 MiB goodput, 1% loss"):
    assert name in rows, f"row {name!r} missing"
    assert rows[name]["values"].get("stellar", 0) > 0, f"no stellar figure in {name!r}"
    assert rows[name]["values"].get("roce", 0) > 0, f"no roce figure in {name!r}"
assert rows["latency 64 B one-way p50"]["values"].get("sockperf", 0) > 0, "no sockperf figure"
EOF
for png in latency goodput_loss; do
  [[ $(head -c 8 "$out/$png.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || { echo "FAIL: $png.png is not a PNG"; exit 1; }
done
echo "ok: table, JSON and plots"
