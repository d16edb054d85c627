#!/usr/bin/env bash
# The Debian package, end to end: builds it (release; an existing
# target/release is reused), installs it with apt, starts the installed
# daemon by hand (systemd is not PID 1 on this machine, so the package does
# not enable the unit) against the host's containerd (Debian's, started by
# hand on its default socket if it is not running, and stopped after),
# drives it with crictl using examples/ (skipped, saying so, without crictl
# or the test registry), purges the package and audits the host
# (hack/leak-audit.sh --host): nothing of Cubelet's may be left.
#
# Prints the .deb's size and the time from `apt install` to CRI served, then
# `package: N passed, N failed`.
#
# Usage: hack/test-package.sh
# Env: CRICTL (default: crictl on PATH, else /usr/local/bin/crictl)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

[[ $EUID -eq 0 ]] || die "run as root"
cargo deb --version >/dev/null 2>&1 || die "no cargo-deb: run hack/deps.sh"
if dpkg-query -W -f='${Status}' cubelet 2>/dev/null | grep -q installed; then
    die "a cubelet package is installed here: apt purge cubelet first"
fi
[[ ! -e /run/cubelet && ! -e /var/lib/cubelet ]] \
    || die "/run/cubelet or /var/lib/cubelet exists (hack/up.sh running? hack/down.sh first)"

HOST_CONTAINERD=/run/containerd/containerd.sock
SOCKET=/run/cubelet/cubelet.sock
CRICTL="${CRICTL:-$(command -v crictl || echo /usr/local/bin/crictl)}"
work="$(mktemp -d)"
passed=0
failed=0
ok() { passed=$((passed + 1)); log "ok: $*"; }
fail() { failed=$((failed + 1)); log "FAIL: $*"; }
daemon_pid=""
started_containerd=false
made_dirs=()

cleanup() {
    local rc=$?
    if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    if dpkg-query -W -f='${Status}' cubelet 2>/dev/null | grep -q installed; then
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq cubelet >/dev/null 2>&1 || true
    fi
    if $started_containerd; then
        echo "$containerd_pid" >"$work/containerd.pid"
        stop_pidfile containerd "$work/containerd.pid"
        for d in "${made_dirs[@]}"; do
            awk '{print $5}' /proc/self/mountinfo | grep -q "^${d}/" || rm -rf --one-file-system "$d"
        done
    fi
    rm -rf "$work" /tmp/cubelet-example-logs
    exit "$rc"
}
trap cleanup EXIT

# The package's unit is the Helm chart's but for the binary's path.
if diff <(grep -v '^#' charts/cubelet/files/cubelet.service | sed 's#/opt/cubelet/bin/cubelet#/usr/bin/cubelet#') \
    <(grep -v '^#' packaging/deb/cubelet.service) >"$work/unit.diff"; then
    ok "packaging/deb/cubelet.service matches the chart's unit"
else
    fail "packaging/deb/cubelet.service differs from charts/cubelet/files/cubelet.service:"
    cat "$work/unit.diff" >&2
fi

log "building the package (release)"
cargo build --release --locked -p cubelet
PAUSE_BIN="$REPO_ROOT/target/cubelet-pause" "$HACK_DIR/build-pause.sh" >/dev/null
rm -f target/debian/cubelet_*.deb
cargo deb --locked -p cubelet --no-build --strip
deb="$(ls target/debian/cubelet_*.deb)"
deb_size="$(stat -c %s "$deb")"
log "$deb: $((deb_size / 1024)) KiB"
dpkg-deb --info "$deb" | sed -n '/Package:/,$p' | grep -E '^ (Package|Version|Depends|Installed-Size):' >&2
contents="$(dpkg-deb --contents "$deb" | awk '{print $6}')"
for f in ./usr/bin/cubelet ./usr/bin/cubelet-pause ./lib/systemd/system/cubelet.service \
    ./etc/cubelet/config.yaml ./etc/cubelet/config.d/; do
    if grep -qxF "$f" <<<"$contents"; then ok "package holds $f"; else fail "package lacks $f"; fi
done

# The host's containerd, as the package's config expects.
if ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1; then
    log "using the running containerd on $HOST_CONTAINERD"
else
    # /run/containerd is shared (containerd 1.6 keeps every instance's shim
    # sockets there, the private test containerd's too): only the root goes.
    [[ -e /var/lib/containerd ]] || made_dirs+=(/var/lib/containerd)
    log "starting Debian's containerd by hand on $HOST_CONTAINERD"
    setsid containerd >"$work/containerd.log" 2>&1 </dev/null &
    containerd_pid=$!
    started_containerd=true
    for _ in $(seq 1 100); do
        ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1 && break
        sleep 0.1
    done
    ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1 || die "containerd did not answer (see $work/containerd.log)"
fi

log "apt-get install $deb"
t0=$(date +%s.%N)
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "./$deb" >"$work/install.log" 2>&1 \
    || { cat "$work/install.log" >&2; die "apt-get install failed"; }
t_installed=$(date +%s.%N)
grep -q "systemd is not PID 1" "$work/install.log" && log "postinst: systemd is not PID 1 here, unit not enabled (as expected)"
if [[ "$(cubelet --version)" == "cubelet $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml)" ]]; then
    ok "cubelet --version: $(cubelet --version)"
else
    fail "cubelet --version says '$(cubelet --version)'"
fi
if dpkg-query -W -f='${Conffiles}' cubelet | grep -q '/etc/cubelet/config.yaml'; then
    ok "/etc/cubelet/config.yaml is a conffile"
else
    fail "/etc/cubelet/config.yaml is not a conffile"
fi
if cubelet --check-config >"$work/check.log" 2>&1; then ok "cubelet --check-config accepts the shipped config"; else
    fail "cubelet --check-config: $(cat "$work/check.log")"
fi
# The local test registry is plain HTTP: an operator's hosts.toml, which
# purge must remove with the rest of /etc/cubelet.
mkdir -p "/etc/cubelet/certs.d/${REGISTRY_ADDR}"
printf 'server = "http://%s"\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
    "$REGISTRY_ADDR" "$REGISTRY_ADDR" >"/etc/cubelet/certs.d/${REGISTRY_ADDR}/hosts.toml"

log "starting the installed cubelet by hand (as the unit would)"
setsid /usr/bin/cubelet --config /etc/cubelet/config.yaml >"$work/cubelet.log" 2>&1 </dev/null &
daemon_pid=$!
served=false
for _ in $(seq 1 600); do
    kill -0 "$daemon_pid" 2>/dev/null || break
    if [[ -S "$SOCKET" ]] && curl -fsS -o /dev/null http://127.0.0.1:9385/readyz 2>/dev/null; then
        served=true
        break
    fi
    sleep 0.1
done
t_served=$(date +%s.%N)
if $served; then
    serve_s=$(awk -v a="$t0" -v b="$t_served" 'BEGIN{printf "%.1f", b-a}')
    install_s=$(awk -v a="$t0" -v b="$t_installed" 'BEGIN{printf "%.1f", b-a}')
    ok "CRI served ${serve_s} s after apt install began (install ${install_s} s)"
else
    tail -n 20 "$work/cubelet.log" >&2
    fail "the installed cubelet did not serve within 60 s"
fi

# crictl against the installed daemon, with the examples.
printf 'runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 60\n' "$SOCKET" "$SOCKET" >"$work/crictl.yaml"
cri() { "$CRICTL" --config "$work/crictl.yaml" "$@"; }
if ! $served; then
    :
elif [[ ! -x "$CRICTL" ]]; then
    log "SKIP crictl runp/create/start/exec/logs/stopp/rmp: no crictl ($CRICTL); install, purge and audit still run"
elif ! curl -fsS -o /dev/null "http://${REGISTRY_ADDR}/v2/" 2>/dev/null; then
    log "SKIP crictl runp/create/start/exec/logs/stopp/rmp: no test registry at ${REGISTRY_ADDR} (hack/registry.sh start; hack/test-images.sh)"
else
    if cri pull "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["image"]["image"])' examples/container.json)" >/dev/null; then
        ok "crictl pull"
    else fail "crictl pull"; fi
    if pod=$(cri runp examples/pod.json) && [[ -n "$pod" ]]; then ok "crictl runp ($pod)"; else fail "crictl runp"; pod=""; fi
    if [[ -n "$pod" ]]; then
        if ctr_id=$(cri create "$pod" examples/container.json examples/pod.json) && [[ -n "$ctr_id" ]]; then
            ok "crictl create"
            if cri start "$ctr_id" >/dev/null; then ok "crictl start"; else fail "crictl start"; fi
            if [[ "$(cri exec "$ctr_id" echo exec-ok)" == exec-ok ]]; then ok "crictl exec"; else fail "crictl exec"; fi
            logs=""
            for _ in $(seq 1 50); do
                logs="$(cri logs "$ctr_id" 2>&1 || true)"
                [[ "$logs" == *"hello from cubelet"* ]] && break
                sleep 0.1
            done
            if [[ "$logs" == *"hello from cubelet"* ]]; then ok "crictl logs"; else fail "crictl logs: $logs"; fi
        else
            fail "crictl create"
        fi
        if cri stopp "$pod" >/dev/null; then ok "crictl stopp"; else fail "crictl stopp"; fi
        if cri rmp "$pod" >/dev/null; then ok "crictl rmp"; else fail "crictl rmp"; fi
    fi
fi

log "stopping the installed cubelet"
kill -TERM "$daemon_pid" 2>/dev/null || true
wait "$daemon_pid" 2>/dev/null || true
daemon_pid=""

log "apt-get purge cubelet"
if DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq cubelet >"$work/purge.log" 2>&1; then
    ok "apt-get purge"
    grep -vE '^\(Reading database' "$work/purge.log" | sed 's/^/    /' >&2 || true
else
    cat "$work/purge.log" >&2
    fail "apt-get purge"
fi
rm -rf /tmp/cubelet-example-logs
if "$HACK_DIR/leak-audit.sh" --host; then ok "leak audit after purge: nothing of Cubelet's"; else fail "leak audit after purge"; fi

log "summary: .deb $((deb_size / 1024)) KiB; install to serving ${serve_s:-n/a} s"
echo "package: ${passed} passed, ${failed} failed"
((failed == 0))
