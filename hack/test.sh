#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run` execs this): installs
# packages, checks formatting and lints, builds, starts a private containerd
# and registry with test images, runs every test (unit, root, e2e, chart
# checks, the Debian package, up/down), stops the services and audits the
# host for leaks.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"
# CI builds each crate once: incremental state would only take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

"$HACK_DIR/deps.sh"

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# Non-test code (the daemon, its crates, the test harness library) must
# not unwrap or expect: errors are typed and handled.
cargo clippy --workspace --lib --bins -- -D warnings -D clippy::unwrap_used -D clippy::expect_used
log "cargo doc (rustdoc warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
log "MSRV (rust-version)"
"$HACK_DIR/check-msrv.sh"

log "cargo deny (licenses, bans, sources)"
cargo deny --locked check licenses bans sources
# Advisories from a local copy of the RustSec database (deny.toml's
# db-path, $CARGO_HOME/advisory-dbs), never fetched here: `cargo deny
# fetch` fills it where the network allows. See docs/security.md,
# "Supply chain".
advisory_dbs="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
if compgen -G "$advisory_dbs/*/crates" >/dev/null; then
    log "cargo deny advisories (local database under $advisory_dbs, no fetch)"
    cargo deny --locked check --disable-fetch advisories
else
    log "SKIP cargo deny advisories: no local advisory database under $advisory_dbs (run \`cargo deny fetch\` where the network allows)"
fi

log "building"
# With the test-only failpoint hook (e2e/tests/{faults,recovery}.rs use it);
# the later `cargo test --workspace` keeps it on through the e2e crate's
# dev-dependency on cubelet, so the daemon it may rebuild has it too.
cargo build --workspace --features cubelet/failpoints
"$HACK_DIR/build-pause.sh" >/dev/null

started=()
cleanup() {
    local rc=$?
    for svc in "${started[@]}"; do "$HACK_DIR/$svc.sh" stop || true; done
    exit "$rc"
}
trap cleanup EXIT
# Stop at the end only what this run started: on a developer machine the
# services may already be running for other work.
for svc in containerd registry; do
    if ! "$HACK_DIR/$svc.sh" status >/dev/null 2>&1; then
        "$HACK_DIR/$svc.sh" start
        started+=("$svc")
    fi
done
"$HACK_DIR/test-images.sh"

log "chart checks"
"$HACK_DIR/check-chart.sh"
log "crate graph (docs/DESIGN.md against cargo metadata)"
python3 "$HACK_DIR/check-crate-graph.py"
"$HACK_DIR/build-installer-image.sh" debug >/dev/null

log "cargo test"
cargo test --workspace --no-fail-fast -- --test-threads="${TEST_THREADS:-2}"
# The workspace run has the failpoint hook on (see "building"); the default
# build's refusal to start when failpoints are asked for is tested here.
log "cargo test -p cubelet failpoint (default features)"
cargo test -p cubelet --lib failpoint

# The Debian package end to end, and hack/up.sh + hack/down.sh leaving the
# host as it was. Both use one release build of the daemon (the costliest
# step here, reused when target/release is current); they run Debian's
# containerd by hand on its default socket, beside the private one.
log "package: build, install, crictl, purge, audit (hack/test-package.sh)"
"$HACK_DIR/test-package.sh"
log "hack/up.sh then hack/down.sh leave the host as it was (hack/test-up-down.sh)"
"$HACK_DIR/test-up-down.sh"

# Kubernetes' own node conformance suite (test/e2e_node, [NodeConformance]):
# its pod and container lifecycle specs, a kubelet v1.28.7 of the harness's
# on a Cubelet of its own, through a control plane on 127.0.0.1
# (docs/node-e2e.md). The binaries are built by hand outside the
# repository; without them it prints one SKIP line. It runs alone: two
# kubelets on one host remove each other's pod log directories.
log "node conformance, CI subset on Cubelet (hack/node-e2e.sh)"
"$HACK_DIR/node-e2e.sh" --runtime cubelet --subset ci

log "disk: target/ is $(du -sh target | cut -f1), $(df -h --output=avail . | tail -1 | tr -d ' ') free"
log "leak audit"
"$HACK_DIR/leak-audit.sh"

# ---------------------------------------------------------------- guest
# The suite above runs on this host (cgroup v1 hybrid, no systemd). This
# step runs the node shape Kubernetes now requires: a Debian 12 guest under
# qemu with systemd as PID 1 and pure cgroup v2, Cubelet as a systemd
# service with the systemd cgroup driver, and the cgroups, cri and kubelet
# e2e tests inside (hack/vm.sh test, docs/guest.md). About 7 minutes with a
# cached guest image (/var/cache/cubelet-vm), plus about 6 to build it when
# its recipe changed. CUBELET_VM=0 leaves it out (say so in a report).
if [[ "${CUBELET_VM:-1}" == 1 ]]; then
    log "guest: Debian 12, systemd, cgroup v2 (hack/vm.sh test)"
    "$HACK_DIR/vm.sh" test
else
    log "SKIP guest (Debian 12, systemd, cgroup v2): CUBELET_VM=0"
fi
