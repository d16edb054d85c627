#!/usr/bin/env bash
# Runs INSIDE the test guest (hack/vm.sh test starts it over ssh, from the
# repository shared read-only at its own path): checks the node (systemd
# PID 1, cgroup v2), installs the staged Cubelet binaries, starts the local
# registry with the test images, checks containerd, starts cubelet.service
# (systemd cgroup driver) and checks it answers, then runs the e2e test
# binaries. Prints each step with its duration; exits non-zero on the first
# failure.
#
# Usage: guest-test.sh BIN_DIR OUT_DIR
#   BIN_DIR  staged binaries: cubelet, cubelet-pause, e2e/<test>, [kubelet],
#            [crictl]
#   OUT_DIR  test logs (the host keeps them when the run fails)
# Env: CUBELET_VM_E2E  space-separated `test[:filter,filter...]` items, the
#      e2e test binaries to run and their name filters; default
#      "cgroups cri:pod_lifecycle,exec_sync kubelet". A test binary that was
#      not built (cgroups before it lands) is skipped with a line saying so;
#      kubelet is skipped when the host had no kubelet to share.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

BIN="${1:?usage: guest-test.sh BIN_DIR OUT_DIR}"
OUT="${2:?usage: guest-test.sh BIN_DIR OUT_DIR}"
E2E="${CUBELET_VM_E2E:-cgroups cri:pod_lifecycle,exec_sync kubelet}"
mkdir -p "$OUT"

# The node's own containerd (Debian's containerd.service), for the scripts
# and for the e2e harness.
export CUBELET_TEST_CONTAINERD=/run/containerd/containerd.sock
export CUBELET_BIN=/opt/cubelet/bin/cubelet
export CUBELET_PAUSE_BIN=/opt/cubelet/bin/cubelet-pause
export PAUSE_BIN="$CUBELET_PAUSE_BIN"
export CUBELET_E2E_CGROUP_DRIVER=systemd
# The guest runs emulated (TCG), about 4x slower than the host: the tests'
# waits stretch by this much (e2e/src/lib.rs `time_scale`).
export CUBELET_E2E_TIME_SCALE="${CUBELET_E2E_TIME_SCALE:-4}"
CRI_SOCKET=/run/cubelet/cubelet.sock

step_start=0
step() {
    step_start="$(date +%s)"
    log "step: $*"
}
done_step() { log "step: $* ($(($(date +%s) - step_start)) s)"; }

# Whatever happens, Cubelet's journal is kept with the test logs.
trap 'journalctl -u cubelet --no-pager -o short-monotonic >"$OUT/cubelet.journal" 2>&1 || true' EXIT

step "node"
[[ "$(cat /proc/1/comm)" == systemd ]] || die "PID 1 is $(cat /proc/1/comm), not systemd"
fs="$(stat -f -c %T /sys/fs/cgroup)"
[[ "$fs" == cgroup2fs ]] || die "/sys/fs/cgroup is ${fs}, not cgroup2fs (a pure cgroup v2 hierarchy)"
log "kernel $(uname -r), $(systemctl --version | head -n 1), cgroup controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
done_step "node: systemd PID 1, cgroup v2"

step "install Cubelet"
install -D -m 0755 "${BIN}/cubelet" /opt/cubelet/bin/cubelet
install -D -m 0755 "${BIN}/cubelet-pause" /opt/cubelet/bin/cubelet-pause
done_step "install Cubelet into /opt/cubelet/bin"

step "containerd"
for _ in $(seq 1 60); do
    systemctl is-active -q containerd && ctr --address "$CUBELET_TEST_CONTAINERD" version >/dev/null 2>&1 && break
    sleep 1
done
systemctl is-active -q containerd || { systemctl --no-pager status containerd >&2 || true; die "containerd.service not active"; }
ctr --address "$CUBELET_TEST_CONTAINERD" version >/dev/null || die "containerd does not answer on ${CUBELET_TEST_CONTAINERD}"
containerd config dump 2>/dev/null | grep -q 'SystemdCgroup = true' || die "containerd's runc does not use systemd cgroups"
done_step "containerd: active, answering, runc SystemdCgroup = true"

step "registry"
"${HACK_DIR}/registry.sh" start
done_step "registry on ${REGISTRY_ADDR}"
step "test images"
"${HACK_DIR}/test-images.sh" >"$OUT/test-images.log" 2>&1 || { tail -n 20 "$OUT/test-images.log" >&2; die "hack/test-images.sh failed"; }
done_step "test images pushed to ${REGISTRY_ADDR}"

step "cubelet.service"
"$CUBELET_BIN" --check-config --config /etc/cubelet/config.yaml | tee "$OUT/check-config.txt"
grep -q '^ *cgroup_driver: systemd' /etc/cubelet/config.yaml \
    || die "/etc/cubelet/config.yaml does not set runtime.cgroup_driver: systemd"
systemctl start cubelet || { systemctl --no-pager status cubelet >&2 || true; die "cubelet.service did not start"; }
systemctl is-active -q cubelet || die "cubelet.service not active"
log "cubelet.service active, cgroup $(systemctl show -P ControlGroup cubelet)"
curl -fsS http://127.0.0.1:9385/readyz >/dev/null || die "cubelet /readyz does not answer"
# One CRI call on the socket: RuntimeService/Version (an empty request is a
# 5-byte gRPC frame), over HTTP/2 as kubelet makes it.
printf '\0\0\0\0\0' | curl -fsS --http2-prior-knowledge --unix-socket "$CRI_SOCKET" \
    -H 'content-type: application/grpc' -H 'te: trailers' --data-binary @- \
    -o "$OUT/cri-version.bin" http://localhost/runtime.v1.RuntimeService/Version \
    || die "no answer to RuntimeService/Version on ${CRI_SOCKET}"
grep -aq cubelet "$OUT/cri-version.bin" || die "RuntimeService/Version on ${CRI_SOCKET} did not name cubelet"
if [[ -x "${BIN}/crictl" ]]; then
    printf 'runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 30\n' "$CRI_SOCKET" "$CRI_SOCKET" \
        >"$OUT/crictl.yaml"
    "${BIN}/crictl" --config "$OUT/crictl.yaml" version | tee "$OUT/crictl-version.txt"
fi
"$CUBELET_BIN" ctl flows | tee "$OUT/ctl-flows.txt"
done_step "cubelet.service: active, /readyz, CRI Version, admin API"

ran=0
for item in $E2E; do
    name="${item%%:*}"
    filters=()
    if [[ "$item" == *:* ]]; then IFS=, read -r -a filters <<<"${item#*:}"; fi
    exe="${BIN}/e2e/${name}"
    env_extra=()
    case "$name" in
        cgroups) env_extra=(CUBELET_E2E_SOCKET="$CRI_SOCKET") ;;
        kubelet)
            if [[ ! -x "${BIN}/kubelet" ]]; then
                log "SKIP e2e kubelet: the host had no kubelet to share (set CUBELET_KUBELET_BIN or put kubelet-v1.28.7 on PATH)"
                continue
            fi
            env_extra=(CUBELET_KUBELET_BIN="${BIN}/kubelet") ;;
    esac
    if [[ ! -x "$exe" ]]; then
        log "SKIP e2e ${name}: no test binary of that name was staged (not built yet?)"
        continue
    fi
    step "e2e ${name} ${filters[*]}"
    # As cargo runs them: from the package's directory, one test at a time.
    if ! (cd "${REPO_ROOT}/e2e" && env "${env_extra[@]}" timeout 1800 "$exe" "${filters[@]}" --test-threads=1) \
        >"$OUT/e2e-${name}.log" 2>&1; then
        tail -n 60 "$OUT/e2e-${name}.log" >&2
        die "e2e ${name} failed (log ${OUT}/e2e-${name}.log)"
    fi
    grep -E '^test result|passed|failed' "$OUT/e2e-${name}.log" | tail -n 3 >&2 || true
    # Everything a test needs is in the guest: a skipped test is a failure.
    if grep -q 'SKIP' "$OUT/e2e-${name}.log"; then
        grep 'SKIP' "$OUT/e2e-${name}.log" >&2
        die "e2e ${name} skipped tests inside the guest"
    fi
    ran=$((ran + 1))
    done_step "e2e ${name} ${filters[*]}"
done
((ran > 0)) || die "no e2e test binary ran"

systemctl is-active -q cubelet || die "cubelet.service not active after the tests"
log "guest tests passed: ${ran} e2e test binaries"
