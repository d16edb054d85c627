#!/usr/bin/env bash
# Common defaults for Cubelet's test-infrastructure scripts. Source it; every
# path can be overridden from the environment.
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${HACK_DIR}/.." && pwd)"

# Private containerd (never the host's default one).
CUBELET_TEST_ROOT="${CUBELET_TEST_ROOT:-/var/lib/cubelet-test}"
CUBELET_TEST_STATE="${CUBELET_TEST_STATE:-/run/cubelet-test}"
CONTAINERD_ROOT="${CONTAINERD_ROOT:-${CUBELET_TEST_ROOT}/containerd}"
CONTAINERD_STATE="${CONTAINERD_STATE:-${CUBELET_TEST_STATE}/containerd}"
CUBELET_TEST_CONTAINERD="${CUBELET_TEST_CONTAINERD:-${CONTAINERD_STATE}/containerd.sock}"
CONTAINERD_CONFIG="${CONTAINERD_CONFIG:-${CUBELET_TEST_ROOT}/containerd-config.toml}"
CONTAINERD_PID_FILE="${CONTAINERD_PID_FILE:-${CUBELET_TEST_STATE}/containerd.pid}"
CONTAINERD_LOG="${CONTAINERD_LOG:-${CUBELET_TEST_ROOT}/containerd.log}"
CONTAINERD_RUNC_ROOT="${CONTAINERD_RUNC_ROOT:-${CUBELET_TEST_STATE}/runc}"
CONTAINERD_CNI_CONF_DIR="${CONTAINERD_CNI_CONF_DIR:-${CUBELET_TEST_ROOT}/cni-conf}"
CONTAINERD_BIN="${CONTAINERD_BIN:-containerd}"
CTR_BIN="${CTR_BIN:-ctr}"
RUNC_BIN="${RUNC_BIN:-/usr/sbin/runc}"

# Private registry.
REGISTRY_ADDR="${REGISTRY_ADDR:-127.0.0.1:5000}"
REGISTRY_ROOT="${REGISTRY_ROOT:-${CUBELET_TEST_ROOT}/registry}"
REGISTRY_CONFIG="${REGISTRY_CONFIG:-${CUBELET_TEST_ROOT}/registry-config.yml}"
REGISTRY_PID_FILE="${REGISTRY_PID_FILE:-${CUBELET_TEST_STATE}/registry.pid}"
REGISTRY_LOG="${REGISTRY_LOG:-${CUBELET_TEST_ROOT}/registry.log}"
REGISTRY_BIN="${REGISTRY_BIN:-docker-registry}"

# Test images.
BUSYBOX_BIN="${BUSYBOX_BIN:-/bin/busybox}"
PAUSE_BIN="${PAUSE_BIN:-${REPO_ROOT}/target/cubelet-pause}"
PAUSE_IMAGE="${PAUSE_IMAGE:-${REGISTRY_ADDR}/pause:test}"

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# need_bin BINARY PACKAGE: fail with an install hint if BINARY is missing.
need_bin() {
    command -v "$1" >/dev/null 2>&1 || die "$1 not found; install it: apt-get install -y $2"
}

# pid_alive PIDFILE: true if the pid file names a live process.
pid_alive() {
    [[ -f "$1" ]] || return 1
    local pid
    pid="$(cat "$1")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

# stop_pidfile NAME PIDFILE: SIGTERM the process, wait up to 20 s, then SIGKILL.
stop_pidfile() {
    local name="$1" pidfile="$2" pid i
    if ! pid_alive "$pidfile"; then
        log "${name} not running"
        rm -f "$pidfile"
        return 0
    fi
    pid="$(cat "$pidfile")"
    log "stopping ${name} (pid ${pid})"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 200); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "${name} did not exit after SIGTERM, sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    rm -f "$pidfile"
    log "${name} stopped"
}
