#!/usr/bin/env bash
# expect_exit.sh RC TEXT COMMAND [ARGS...]: passes when COMMAND exits with RC and its stderr holds
# TEXT (a fixed string) — the exit-code convention of integration/common/cli.h, checked per case.
set -u
want_rc=$1; want_text=$2; shift 2
err=$(timeout 60 "$@" 2>&1 >/dev/null); rc=$?
if [ "$rc" -ne "$want_rc" ]; then echo "FAIL: exit $rc, expected $want_rc: $*"; echo "$err"; exit 1; fi
if ! grep -qF -- "$want_text" <<<"$err"; then echo "FAIL: stderr lacks '$want_text': $*"; echo "$err"; exit 1; fi
echo "ok: exit $rc, '$want_text'"
