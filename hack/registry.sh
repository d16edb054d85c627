#!/usr/bin/env bash
# Start or stop a private Docker registry (Debian docker-registry) on
# 127.0.0.1:5000, plain HTTP, with its own storage dir and config.
#
# Usage: hack/registry.sh start|stop|status
# Env: REGISTRY_ADDR REGISTRY_ROOT REGISTRY_CONFIG REGISTRY_PID_FILE REGISTRY_LOG
#      REGISTRY_BIN (see hack/lib.sh for defaults)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

answers() {
    curl -fsS -o /dev/null "http://${REGISTRY_ADDR}/v2/" 2>/dev/null
}

start() {
    need_bin "$REGISTRY_BIN" docker-registry
    need_bin curl curl
    if pid_alive "$REGISTRY_PID_FILE" && answers; then
        log "registry already running (pid $(cat "$REGISTRY_PID_FILE")) at http://${REGISTRY_ADDR}"
        return 0
    fi
    if pid_alive "$REGISTRY_PID_FILE"; then
        stop_pidfile registry "$REGISTRY_PID_FILE"
    fi
    mkdir -p "$REGISTRY_ROOT" "$(dirname "$REGISTRY_CONFIG")" "$(dirname "$REGISTRY_PID_FILE")" \
        "$(dirname "$REGISTRY_LOG")"
    log "writing ${REGISTRY_CONFIG}"
    cat >"${REGISTRY_CONFIG}.tmp" <<YAML
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: ${REGISTRY_ROOT}
  delete:
    enabled: true
http:
  addr: ${REGISTRY_ADDR}
YAML
    mv "${REGISTRY_CONFIG}.tmp" "$REGISTRY_CONFIG"
    log "starting ${REGISTRY_BIN} serve ${REGISTRY_CONFIG} (log ${REGISTRY_LOG})"
    nohup "$REGISTRY_BIN" serve "$REGISTRY_CONFIG" >>"$REGISTRY_LOG" 2>&1 </dev/null &
    echo $! >"$REGISTRY_PID_FILE"
    local i
    for i in $(seq 1 100); do
        if answers; then
            log "registry running (pid $(cat "$REGISTRY_PID_FILE")) at http://${REGISTRY_ADDR}"
            return 0
        fi
        pid_alive "$REGISTRY_PID_FILE" || { tail -n 20 "$REGISTRY_LOG" >&2; die "registry exited"; }
        sleep 0.2
    done
    tail -n 20 "$REGISTRY_LOG" >&2
    die "registry did not answer on http://${REGISTRY_ADDR}/v2/ within 20 s"
}

case "${1:-}" in
    start) start ;;
    stop) stop_pidfile registry "$REGISTRY_PID_FILE" ;;
    status)
        if pid_alive "$REGISTRY_PID_FILE" && answers; then
            log "registry running (pid $(cat "$REGISTRY_PID_FILE")) at http://${REGISTRY_ADDR}"
        else
            log "registry not running"; exit 1
        fi ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
