#!/usr/bin/env bash
# Build the static cubelet-pause binary and copy it to a stable path.
# `-C target-feature=+crt-static` yields a static-pie binary with glibc here;
# plain `-C link-args=-static` does not work.
#
# Usage: hack/build-pause.sh
# Env: PAUSE_BIN (output path, default target/cubelet-pause), CARGO (default cargo)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CARGO="${CARGO:-cargo}"
cd "$REPO_ROOT"
log "building cubelet-pause (release, crt-static)"
"$CARGO" rustc --release -p cubelet-pause --bin cubelet-pause -- -C target-feature=+crt-static -C strip=symbols
target_dir="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"
mkdir -p "$(dirname "$PAUSE_BIN")"
install -m 0755 "${target_dir}/release/cubelet-pause" "${PAUSE_BIN}.tmp"
mv "${PAUSE_BIN}.tmp" "$PAUSE_BIN"
if command -v file >/dev/null 2>&1; then log "$(file -b "$PAUSE_BIN")"; fi
log "cubelet-pause at ${PAUSE_BIN}"
echo "$PAUSE_BIN"
