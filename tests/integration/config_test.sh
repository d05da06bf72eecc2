#!/bin/bash
# One configuration place (docs/configuration.md): the table `stellar config`
# prints and the documentation's table name the same variables; every tuning
# constant the documentation lists is in the file it names; no source outside
# src/core/config.cpp reads the environment; a malformed value fails with a
# message that names the variable.
set -euo pipefail
cli="$1"; pingpong="$2"; root="$3"
doc="$root/docs/configuration.md"
known=$("$cli" config --json | python3 -c 'import json, sys; print("\n".join(v["name"] for v in json.load(sys.stdin)))')
documented=$(grep -oE '^\| `[A-Z_]+`' "$doc" | tr -d '|` ')
# Here-strings, not echo | grep -q: grep -q exits at its first match, and
# with pipefail the echo's SIGPIPE would fail the check at random.
for name in $known; do grep -qx "$name" <<< "$documented" || { echo "docs/configuration.md does not list $name"; exit 1; }; done
for name in $documented; do grep -qx "$name" <<< "$known" || { echo "docs/configuration.md lists $name, which the code does not read"; exit 1; }; done
echo "$(echo "$known" | wc -l) variables, documented alike"

# Every tuning constant the documentation lists is where it says.
constants=0
while IFS='|' read -r _ names _ _ _ file _; do
  file=$(echo "$file" | tr -d '` ')
  [[ $file == */* && -f "$root/$file" ]] || { echo "docs/configuration.md names a missing file: '$file'"; exit 1; }
  for name in $(echo "$names" | tr -d '` ' | tr ',' ' '); do
    grep -q "\b${name##*::}\b" "$root/$file" || { echo "docs/configuration.md: ${name} is not in $file"; exit 1; }
    constants=$((constants + 1))
  done
done < <(sed -n '/^## Tuning constants/,$p' "$doc" | grep -E '^\| `[a-zA-Z_:]+`')
[[ $constants -ge 20 ]] || { echo "only $constants constants found in docs/configuration.md"; exit 1; }
echo "$constants tuning constants, each in the file the documentation names"

stray=$(grep -rn 'getenv *(' "$root/src" "$root/offload" --include='*.cpp' --include='*.hpp' | grep -v '^[^:]*src/core/config\.cpp:' || true)
[[ -z $stray ]] || { echo "the environment is read outside src/core/config.cpp:"; echo "$stray"; exit 1; }

STELLAR_FAULT_DROP=1.5 "$cli" config | grep -A1 '^STELLAR_FAULT_DROP' | grep -q '1.5' || { echo "stellar config does not show the value in effect"; exit 1; }
for bad in STELLAR_FAULT_DROP=1.5 STELLAR_FAULT_SEED=seven STELLAR_FAULT_DUP=-0.1 'STELLAR_FAULT_SEED= -1' 'STELLAR_FAULT_SEED=5 ' \
           STELLAR_FAULT_REORDER=0,5 STELLAR_FAULT_SEED=0x STELLAR_PATHS=0 STELLAR_PATHS=257 STELLAR_PATH_POLICY=fastest STELLAR_FOLLOW_ADDRESS=2 STELLAR_PATH_MTU_DISCOVERY=yes; do
  name=${bad%%=*}
  if out=$(env "$bad" timeout 20 "$pingpong" -p 1 --wait_client 1 2>&1); then echo "$bad: the server started"; exit 1; fi
  echo "$out" | grep -q "$name" || { echo "$bad: the error does not name the variable: $out"; exit 1; }
  echo "$bad refused: $(echo "$out" | grep -o "$name.*" | head -1)"
done
for good in STELLAR_FAULT_SEED=0x10 STELLAR_FAULT_SEED=010 STELLAR_FAULT_DROP=0.5 STELLAR_PATHS=1 STELLAR_PATH_POLICY=reps STELLAR_FOLLOW_ADDRESS=0 STELLAR_PATH_MTU_DISCOVERY=0; do
  out=$(env "$good" timeout 20 "$pingpong" -p 1 --wait_client 1 2>&1 || true)
  echo "$out" | grep -q "no client connected" || { echo "$good: expected the server to start and wait: $out"; exit 1; }
done
echo "well-formed values accepted"
out=$(STELLAR_LOG_LEVEL=chatty timeout 20 "$pingpong" -p 1 --wait_client 1 2>&1 || true)
echo "$out" | grep -q "STELLAR_LOG_LEVEL='chatty' is not a level" || { echo "an unknown log level went unmentioned: $out"; exit 1; }
echo "unknown log level reported"
