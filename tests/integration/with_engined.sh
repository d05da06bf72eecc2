#!/bin/sh
# Runs a test program with every context in the daemon placement: starts
# stellar-engined on a private socket, runs the program with
# STELLAR_ENGINE=daemon, stops the daemon. Fails if the program fails or the
# daemon died during the run (its log is shown then).
#   with_engined.sh PATH/TO/stellar-engined PROGRAM [ARGS...]
set -u
engined=$1
shift
dir=$(mktemp -d /tmp/stellar-with-engined.XXXXXX)
sock=$dir/engined.sock
"$engined" --socket "$sock" --foreground --wait adaptive >"$dir/log" 2>&1 &
daemon=$!
i=0
while [ ! -S "$sock" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
if [ ! -S "$sock" ]; then
  echo "with_engined.sh: stellar-engined did not come up in 10 s; its log:" >&2
  cat "$dir/log" >&2
  kill "$daemon" 2>/dev/null
  rm -rf "$dir"
  exit 1
fi
STELLAR_ENGINE=daemon STELLAR_ENGINED_SOCKET=$sock "$@"
rc=$?
if ! kill -0 "$daemon" 2>/dev/null; then
  echo "with_engined.sh: stellar-engined died during the run" >&2
  rc=1
fi
kill "$daemon" 2>/dev/null
# A clean stop exits 0; the sanitizer build's leak check at exit does not.
if ! wait "$daemon"; then
  echo "with_engined.sh: stellar-engined did not exit cleanly on SIGTERM" >&2
  rc=1
fi
if [ $rc -ne 0 ]; then
  echo "---- stellar-engined log (last 40 lines) ----" >&2
  tail -n 40 "$dir/log" >&2
fi
rm -rf "$dir"
exit $rc
