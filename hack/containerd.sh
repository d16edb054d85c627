#!/usr/bin/env bash
# Start, stop or query a PRIVATE containerd for Cubelet's tests. It has its own
# config, root, state dir, socket and runc root; the host's default containerd
# (/run/containerd/containerd.sock) is never used or touched.
#
# Note: containerd 1.6 keeps shim sockets under /run/containerd/s whatever its
# state dir is; they are named by a hash of the address, so they do not clash
# with the host's containerd.
#
# Usage: hack/containerd.sh start|stop|status
# Env: CONTAINERD_ROOT CONTAINERD_STATE CUBELET_TEST_CONTAINERD CONTAINERD_CONFIG
#      CONTAINERD_PID_FILE CONTAINERD_LOG CONTAINERD_RUNC_ROOT CONTAINERD_CNI_CONF_DIR
#      CONTAINERD_BIN CTR_BIN RUNC_BIN PAUSE_IMAGE (see hack/lib.sh for defaults)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

write_config() {
    mkdir -p "$(dirname "$CONTAINERD_CONFIG")" "$CONTAINERD_ROOT" "$CONTAINERD_STATE" \
        "$CONTAINERD_RUNC_ROOT" "$CONTAINERD_CNI_CONF_DIR"
    log "writing ${CONTAINERD_CONFIG}"
    cat >"${CONTAINERD_CONFIG}.tmp" <<TOML
version = 2
root = "${CONTAINERD_ROOT}"
state = "${CONTAINERD_STATE}"

[grpc]
  address = "${CUBELET_TEST_CONTAINERD}"

[ttrpc]
  address = "${CUBELET_TEST_CONTAINERD}.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "${PAUSE_IMAGE}"
  # root lacks CAP_SYS_RESOURCE here: without this, runc cannot lower the
  # pause container's oom_score_adj and every RunPodSandbox fails.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "${RUNC_BIN}"
        Root = "${CONTAINERD_RUNC_ROOT}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    conf_dir = "${CONTAINERD_CNI_CONF_DIR}"
    # Debian's containernetworking-plugins live here, not in /opt/cni/bin.
    bin_dir = "/usr/lib/cni"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "${CUBELET_TEST_ROOT}/containerd-certs.d"

[plugins."io.containerd.runtime.v1.linux"]
  runtime_root = "${CONTAINERD_RUNC_ROOT}"
TOML
    mv "${CONTAINERD_CONFIG}.tmp" "$CONTAINERD_CONFIG"
    # The private CRI plugin pulls from the local plain-HTTP registry.
    mkdir -p "${CUBELET_TEST_ROOT}/containerd-certs.d/${REGISTRY_ADDR}"
    cat >"${CUBELET_TEST_ROOT}/containerd-certs.d/${REGISTRY_ADDR}/hosts.toml" <<TOML
server = "http://${REGISTRY_ADDR}"
[host."http://${REGISTRY_ADDR}"]
  capabilities = ["pull", "resolve", "push"]
TOML
}

answers() {
    "$CTR_BIN" --address "$CUBELET_TEST_CONTAINERD" version >/dev/null 2>&1
}

start() {
    need_bin "$CONTAINERD_BIN" containerd
    need_bin "$CTR_BIN" containerd
    [[ -x "$RUNC_BIN" ]] || die "$RUNC_BIN not found; install it: apt-get install -y runc"
    if pid_alive "$CONTAINERD_PID_FILE" && answers; then
        log "containerd already running (pid $(cat "$CONTAINERD_PID_FILE")) at ${CUBELET_TEST_CONTAINERD}"
        return 0
    fi
    if pid_alive "$CONTAINERD_PID_FILE"; then
        stop_pidfile containerd "$CONTAINERD_PID_FILE"
    fi
    write_config
    mkdir -p "$(dirname "$CONTAINERD_LOG")" "$(dirname "$CONTAINERD_PID_FILE")"
    log "starting ${CONTAINERD_BIN} --config ${CONTAINERD_CONFIG} (log ${CONTAINERD_LOG})"
    nohup "$CONTAINERD_BIN" --config "$CONTAINERD_CONFIG" >>"$CONTAINERD_LOG" 2>&1 </dev/null &
    echo $! >"$CONTAINERD_PID_FILE"
    local i
    for i in $(seq 1 100); do
        if answers; then
            log "containerd running (pid $(cat "$CONTAINERD_PID_FILE")) at ${CUBELET_TEST_CONTAINERD}"
            return 0
        fi
        pid_alive "$CONTAINERD_PID_FILE" || { tail -n 20 "$CONTAINERD_LOG" >&2; die "containerd exited"; }
        sleep 0.2
    done
    tail -n 20 "$CONTAINERD_LOG" >&2
    die "containerd did not answer on ${CUBELET_TEST_CONTAINERD} within 20 s"
}

status() {
    if pid_alive "$CONTAINERD_PID_FILE" && answers; then
        log "containerd running (pid $(cat "$CONTAINERD_PID_FILE")) at ${CUBELET_TEST_CONTAINERD}"
        "$CTR_BIN" --address "$CUBELET_TEST_CONTAINERD" version
    else
        log "containerd not running"
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop_pidfile containerd "$CONTAINERD_PID_FILE" ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
