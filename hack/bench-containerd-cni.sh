#!/usr/bin/env bash
# Gives the private containerd's CRI plugin (hack/containerd.sh) a pod
# network for cri-bench, and takes it away again. Its CNI conf dir is empty
# by default, so RunPodSandbox there fails until a conflist exists.
#
#   up    writes ${CONTAINERD_CNI_CONF_DIR}/90-cubelet-bench.conflist: what
#         containerd's own sample config gives a user (bridge with gateway
#         and masquerade, host-local IPAM, portmap), on bridge cbtbench,
#         10.203.78.0/24, IPAM state under the test state dir. Refuses if
#         another conflist is there (another suite's network would be used).
#   down  removes the conflist, the bridge, the IPAM state and, if there
#         were none before `up`, the CNI chains of the nat table.
#
# Usage: hack/bench-containerd-cni.sh up|down|status
# Env: BENCH_CNI_MASQ (true|false, default true) and hack/lib.sh's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CONF="${CONTAINERD_CNI_CONF_DIR}/90-cubelet-bench.conflist"
BRIDGE=cbtbench
SUBNET=10.203.78.0/24
IPAM_DIR="${CUBELET_TEST_STATE}/cni-ipam-bench"
# Whether the nat table had CNI chains before `up` (then `down` keeps them).
MARK="${CUBELET_TEST_STATE}/bench-cni.chains-before"
MASQ="${BENCH_CNI_MASQ:-true}"

cni_nat() { iptables-save -t nat 2>/dev/null | grep -E 'CNI-' || true; }

up() {
    mkdir -p "$CONTAINERD_CNI_CONF_DIR" "$CUBELET_TEST_STATE"
    local other
    other=$(find "$CONTAINERD_CNI_CONF_DIR" -maxdepth 1 -name '*.conf*' ! -path "$CONF" | head -n1)
    [[ -z "$other" ]] || die "$other is there: containerd would use the first config; remove it or wait for its suite"
    if [[ ! -f "$MARK" ]]; then
        if [[ -n "$(cni_nat)" ]]; then echo yes >"$MARK"; else echo no >"$MARK"; fi
    fi
    log "writing $CONF (bridge $BRIDGE, $SUBNET, ipMasq $MASQ)"
    cat >"${CONF}.tmp" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "cubelet-bench",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${BRIDGE}",
      "isGateway": true,
      "ipMasq": ${MASQ},
      "promiscMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "${SUBNET}" }]],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dataDir": "${IPAM_DIR}"
      }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}
JSON
    mv "${CONF}.tmp" "$CONF"
    # The CRI plugin notices the file within a moment (it watches the dir).
    sleep 1
}

down() {
    if [[ -f "$CONF" ]]; then log "removing $CONF"; rm -f "$CONF"; fi
    if [[ -e "/sys/class/net/${BRIDGE}" ]]; then log "deleting bridge $BRIDGE"; ip link del "$BRIDGE"; fi
    rm -rf "$IPAM_DIR"
    local before
    before="$(cat "$MARK" 2>/dev/null || echo unknown)"
    if [[ "$before" == unknown ]]; then
        # No `up` recorded (already down, or never up): whatever CNI chains
        # the nat table has are someone else's.
        log "no record of an up: leaving the nat table's CNI chains alone"
    elif [[ "$before" == no ]]; then
        local rules chains
        rules=$(cni_nat | sed -n 's/^-A //p')
        chains=$(cni_nat | sed -n 's/^:\([^ ]*\) .*/\1/p')
        if [[ -n "$rules$chains" ]]; then log "removing the CNI chains of the nat table"; fi
        # Each rule as iptables-save printed it (quoted comments kept whole).
        while IFS= read -r rule; do
            [[ -n "$rule" ]] || continue
            eval "iptables -t nat -D $rule"
        done <<<"$rules"
        while IFS= read -r chain; do
            [[ -n "$chain" ]] || continue
            iptables -t nat -X "$chain"
        done <<<"$chains"
    else
        log "keeping the nat table's CNI chains: they were there before up"
    fi
    rm -f "$MARK"
}

# Exits 0 when the network is up (its conf is written), 1 when down, as the
# services' status commands do: hack/density.py brings it up on a 1.
status() {
    local up=0
    if [[ -f "$CONF" ]]; then log "up: $CONF"; else log "down"; up=1; fi
    if [[ -e "/sys/class/net/${BRIDGE}" ]]; then log "bridge $BRIDGE exists"; fi
    local n
    n=$(cni_nat | grep -c . || true)
    log "nat table: $n CNI lines"
    return "$up"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
