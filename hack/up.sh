#!/usr/bin/env bash
# Sets up and runs Cubelet for real on this machine: installs packages,
# builds Cubelet (release) and the static cubelet-pause, starts a private
# containerd and a local registry (with test images), writes a config and
# /etc/crictl.yaml, then runs Cubelet in the foreground serving CRI on
# $CUBELET_SOCKET. Ctrl-C stops Cubelet (containers keep running); stop the
# services with `hack/containerd.sh stop; hack/registry.sh stop`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

CUBELET_SOCKET="${CUBELET_SOCKET:-/run/cubelet/cubelet.sock}"
CUBELET_CONFIG_DIR="${CUBELET_CONFIG_DIR:-/etc/cubelet}"
CUBELET_CONFIG="${CUBELET_CONFIG:-${CUBELET_CONFIG_DIR}/config.yaml}"

"$HACK_DIR/deps.sh"
log "building cubelet (release)"
cargo build --release -p cubelet
PAUSE_BIN="$("$HACK_DIR/build-pause.sh" | tail -n1)"
"$HACK_DIR/containerd.sh" start
"$HACK_DIR/registry.sh" start
"$HACK_DIR/test-images.sh"

mkdir -p "$CUBELET_CONFIG_DIR/certs.d/${REGISTRY_ADDR}"
cat >"$CUBELET_CONFIG_DIR/certs.d/${REGISTRY_ADDR}/hosts.toml" <<TOML
server = "http://${REGISTRY_ADDR}"
[host."http://${REGISTRY_ADDR}"]
  capabilities = ["pull", "resolve"]
TOML
if [[ ! -f "$CUBELET_CONFIG" ]]; then
    log "writing $CUBELET_CONFIG"
    cat >"$CUBELET_CONFIG" <<YAML
socket: ${CUBELET_SOCKET}
containerd:
  address: ${CUBELET_TEST_CONTAINERD}
  root: ${CONTAINERD_ROOT}
images:
  pause_binary: ${PAUSE_BIN}
  registry_config_dir: ${CUBELET_CONFIG_DIR}/certs.d
runtime:
  handlers:
    runc: { runtime_type: io.containerd.runc.v2, binary: ${RUNC_BIN}, root: ${CONTAINERD_RUNC_ROOT} }
YAML
else
    log "keeping existing $CUBELET_CONFIG"
fi
cat >/etc/crictl.yaml <<YAML
runtime-endpoint: unix://${CUBELET_SOCKET}
image-endpoint: unix://${CUBELET_SOCKET}
timeout: 30
YAML
if ! command -v crictl >/dev/null 2>&1; then
    # Debian 12 packages neither crictl nor kubelet: say where they come from.
    log "no crictl on PATH (Debian does not package it). Get crictl from the"
    log "  cri-tools project's release tarballs (kubernetes-sigs/cri-tools), or"
    log "  build it: go install sigs.k8s.io/cri-tools/cmd/crictl@latest"
    log "  /etc/crictl.yaml (written above) points it at ${CUBELET_SOCKET}."
    log "a kubelet: the Kubernetes release binaries or the project's apt repository;"
    log "  run it with containerRuntimeEndpoint: unix://${CUBELET_SOCKET} and"
    log "  --containerd=${CUBELET_TEST_CONTAINERD} --containerd-namespace=k8s.cubelet.io"
    log "  (docs/clients.md)."
fi
log "starting cubelet; CRI on ${CUBELET_SOCKET}, metrics on http://127.0.0.1:9385/metrics"
exec "$REPO_ROOT/target/release/cubelet" --config "$CUBELET_CONFIG"
