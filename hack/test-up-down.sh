#!/usr/bin/env bash
# hack/up.sh then hack/down.sh leaves the host as it was: the same network
# links, nft tables, mounts, enabled units and files under /etc. Runs up.sh
# in the background until Cubelet serves CRI (its /readyz answers and the
# socket exists), then down.sh, then compares snapshots taken before and
# after. Prints `up-down: 1 passed, 0 failed` or the differences.
#
# Names of the test harness's own objects (cubelet-e2e*, cubelet-test*,
# test bridges cbe2e/cbt/cbsmoke) are left out of the snapshots: other test
# runs on the same machine may come and go meanwhile.
#
# Usage: hack/test-up-down.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

[[ $EUID -eq 0 ]] || die "run as root"
UP_STATE="${UP_STATE:-/run/cubelet-up}"
[[ ! -e "$UP_STATE" ]] || die "$UP_STATE exists: hack/up.sh is in use here (hack/down.sh first)"
work="$(mktemp -d)"
up_pid=""
cleanup() {
    local rc=$?
    if [[ -n "$up_pid" ]] && kill -0 "$up_pid" 2>/dev/null; then
        "$HACK_DIR/down.sh" || true
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

ignore='cubelet-e2e|cubelet-test|cbe2e|cbt[0-9]|cbsmoke|cubelet-bench|/run/cubelet-test'
snapshot() { # DIR
    mkdir -p "$1"
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort >"$1/links"
    nft list tables | sort >"$1/nft"
    awk '{print $5}' /proc/self/mountinfo | grep -vE "$ignore" | sort >"$1/mounts"
    find /etc/systemd/system -type l 2>/dev/null | sort >"$1/units"
    find /etc -xdev \( -type f -o -type l \) -printf '%p %s\n' 2>/dev/null | sort >"$1/etc"
    for f in "$1"/*; do grep -vE "$ignore" "$f" >"$f.tmp" || true; mv "$f.tmp" "$f"; done
}

snapshot "$work/before"
log "hack/up.sh in the background (log: $work/up.log)"
start=$(date +%s.%N)
"$HACK_DIR/up.sh" >"$work/up.log" 2>&1 &
up_pid=$!
served=false
for _ in $(seq 1 1800); do
    if ! kill -0 "$up_pid" 2>/dev/null; then
        cat "$work/up.log" >&2
        die "hack/up.sh exited before Cubelet served"
    fi
    if [[ -S /run/cubelet/cubelet.sock ]] && curl -fsS -o /dev/null http://127.0.0.1:9385/readyz 2>/dev/null; then
        served=true
        break
    fi
    sleep 1
done
$served || { tail -n 30 "$work/up.log" >&2; die "Cubelet did not serve within 30 minutes"; }
log "serving after $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}') s (build included)"
# Something to remove: the warm pool's shells (netns pins, veths) are made
# by now or soon; give them a moment so down.sh has real work.
sleep 3
found="$(awk '{print $5}' /proc/self/mountinfo | grep -c '^/run/cubelet/' || true)"
log "while up: bridge $(ip -o link show cubelet0 >/dev/null 2>&1 && echo present || echo absent), ${found} mounts under /run/cubelet"

"$HACK_DIR/down.sh"
wait "$up_pid" 2>/dev/null || true
up_pid=""
"$HACK_DIR/down.sh" >/dev/null 2>&1 # idempotent: a second run has nothing to do
snapshot "$work/after"

failed=0
for kind in links nft mounts units etc; do
    if ! diff -u "$work/before/$kind" "$work/after/$kind" >"$work/$kind.diff"; then
        log "differs after up/down: $kind"
        sed 's/^/    /' "$work/$kind.diff" >&2
        failed=1
    fi
done
if ((failed)); then
    echo "up-down: 0 passed, 1 failed"
    exit 1
fi
log "links, nft tables, mounts, enabled units and files under /etc as before"
echo "up-down: 1 passed, 0 failed"
