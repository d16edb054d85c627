#!/usr/bin/env bash
# Runs critest v1.36.0 (the cri-tools conformance suite) against a Cubelet of
# its own: builds stand-ins for critest's test images (busybox-static plus a
# small static stand-in for nginx/httpd/nonewprivs, hack/critest/), pushes
# them to the local registry under the upstream repository paths, builds
# Cubelet and starts it with its own socket, state dirs, containerd
# namespace and bridge (the e2e harness, e2e/src/bin/critest-run.rs), whose
# hosts.toml mirrors registry.k8s.io, k8s.gcr.io and gcr.io to that registry.
# After the suite it audits leaks and removes everything it made.
#
# Prints SKIP and exits 0 when the critest binary is absent.
#
# Usage: hack/critest.sh [critest args, e.g. --ginkgo.focus=UserNamespaces]
# Env: CRITEST (default: critest on PATH, else ../shared/tools/critest-v1.36.0
#      from the repo root),
#      CRITEST_LOG (critest's full output, default ${CUBELET_TEST_ROOT}/critest.log)
#      CRITEST_DROP_IN (a config drop-in for the daemon, e.g. one with
#      `runtime: {sandbox: pause}` to run the suite in pause mode)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CRITEST="${CRITEST:-$(command -v critest || echo "${REPO_ROOT}/../shared/tools/critest-v1.36.0")}"
CRITEST_LOG="${CRITEST_LOG:-${CUBELET_TEST_ROOT}/critest.log}"
if [[ ! -x "$CRITEST" ]]; then
    echo "SKIP: critest not found at ${CRITEST}"
    exit 0
fi
need_bin cc gcc
need_bin python3 python3
need_bin ipcmk util-linux
[[ -x "$BUSYBOX_BIN" ]] || die "$BUSYBOX_BIN not found; install it: apt-get install -y busybox-static"

"${HACK_DIR}/containerd.sh" status >/dev/null 2>&1 || "${HACK_DIR}/containerd.sh" start
"${HACK_DIR}/registry.sh" status >/dev/null 2>&1 || "${HACK_DIR}/registry.sh" start
"${HACK_DIR}/test-images.sh"

work="$(mktemp -d /tmp/cubelet-critest-images.XXXXXX)"
trap 'rm -rf "$work"' EXIT
log "building the stand-in binary"
cc -static -O2 -Wall -o "$work/standin" "${HACK_DIR}/critest/standin.c"
log "pushing critest's stand-in images to ${REGISTRY_ADDR}"
python3 "${HACK_DIR}/critest/images.py" "$REGISTRY_ADDR" "$BUSYBOX_BIN" "$work/standin"

cd "$REPO_ROOT"
log "building cubelet, cubelet-pause and critest-run"
cargo build -q -p cubelet
[[ -x "$PAUSE_BIN" ]] || "${HACK_DIR}/build-pause.sh" >/dev/null
cargo build -q -p cubelet-e2e --bin critest-run
target_dir="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"
mkdir -p "$(dirname "$CRITEST_LOG")"
log "running $(basename "$CRITEST") (full output in ${CRITEST_LOG})"
drop_in=()
[[ -n "${CRITEST_DROP_IN:-}" ]] && drop_in=(--drop-in "$CRITEST_DROP_IN")
"${target_dir}/debug/critest-run" --critest "$CRITEST" --output "$CRITEST_LOG" "${drop_in[@]}" -- "$@"
