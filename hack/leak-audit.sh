#!/usr/bin/env bash
# Counts what tests could have leaked on this host: network namespace pins,
# veths of Cubelet's bridge providers, mounts and sandbox directories under the
# test roots, IP leases and containerd objects in test namespaces. Prints one
# line per kind and exits 1 if anything is left.
#
# Usage: hack/leak-audit.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

leaks=0
count() { # NAME COUNT DETAIL
    printf 'leak-audit: %-22s %s\n' "$1" "$2"
    if [[ "$2" != 0 ]]; then
        leaks=$((leaks + 1))
        [[ -n "${3:-}" ]] && printf '%s\n' "$3" | sed 's/^/    /'
    fi
    return 0
}

# Namespace pins (ours live under state dirs as <dir>/netns/<id> and, for
# sandboxes without an infra process, <dir>/podns/<id>/{ipc,uts}).
pins=$(grep -E ' nsfs ' /proc/self/mountinfo | awk '{print $5}' | grep -E 'cubelet' || true)
count "namespace pins" "$(printf '%s' "$pins" | grep -c . || true)" "$pins"
# Host veth ends named by the bridge provider (cb + id prefix), and test bridges.
veths=$(ip -o link show type veth 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^cb' || true)
count "veths" "$(printf '%s' "$veths" | grep -c . || true)" "$veths"
bridges=$(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^(cbe2e|cbt|cbsmoke)' || true)
count "test bridges" "$(printf '%s' "$bridges" | grep -c . || true)" "$bridges"
# Mounts under test roots (shm, scratch, netns, rootfs).
mounts=$(awk '{print $5}' /proc/self/mountinfo | grep -E '^(/run|/var/lib|/tmp)/cubelet-(e2e|smoke|storage-test|net-test)' || true)
count "mounts" "$(printf '%s' "$mounts" | grep -c . || true)" "$mounts"
# Sandbox directories left in e2e roots.
dirs=$(find /var/lib -maxdepth 3 -path '/var/lib/cubelet-e2e*/sandboxes/*' 2>/dev/null || true)
count "sandbox dirs" "$(printf '%s' "$dirs" | grep -c . || true)" "$dirs"
# containerd objects in test namespaces of the private containerd.
if [[ -S "$CUBELET_TEST_CONTAINERD" ]]; then
    objs=""
    for ns in $("$CTR_BIN" --address "$CUBELET_TEST_CONTAINERD" namespaces ls -q 2>/dev/null | grep -E '^cubelet-(e2e|test)' || true); do
        c=$("$CTR_BIN" --address "$CUBELET_TEST_CONTAINERD" -n "$ns" containers ls -q 2>/dev/null || true)
        t=$("$CTR_BIN" --address "$CUBELET_TEST_CONTAINERD" -n "$ns" tasks ls -q 2>/dev/null || true)
        [[ -n "$c$t" ]] && objs+="$ns: containers=[${c//$'\n'/ }] tasks=[${t//$'\n'/ }]"$'\n'
    done
    count "containerd objects" "$(printf '%s' "$objs" | grep -c . || true)" "$objs"
fi
# nft tables of test bridges.
tables=$(nft list tables 2>/dev/null | grep -E 'cubelet.*(cbe2e|cbt|cbsmoke)' || true)
count "nft tables" "$(printf '%s' "$tables" | grep -c . || true)" "$tables"
# containerd shims of test namespaces: every test daemon is gone by now, so
# any shim still serving a cubelet-e2e-* / cubelet-test-* namespace is one
# containerd forgot (matched by the shim's -namespace argument).
shims=$(for c in /proc/[0-9]*/cmdline; do
    tr '\0' ' ' <"$c" 2>/dev/null | grep -E '^[^ ]*containerd-shim[^ ]* .*-namespace (cubelet-e2e-|cubelet-test-)' || true
done)
count "shim processes" "$(printf '%s' "$shims" | grep -c . || true)" "$shims"
# iptables rules left by CNI plugins (portmap) in the host's nat table.
cni_rules=$(iptables-save -t nat 2>/dev/null | grep -E 'CNI-' || true)
count "CNI iptables rules" "$(printf '%s' "$cni_rules" | grep -c . || true)" "$cni_rules"
if ((leaks)); then
    log "leaks found in $leaks kinds"
    exit 1
fi
log "no leaks"
