#!/usr/bin/env bash
# Counts what tests could have leaked on this host: network namespace pins,
# veths of Cubelet's bridge providers, mounts and sandbox directories under the
# test roots, IP leases and containerd objects in test namespaces. Prints one
# line per kind and exits 1 if anything is left.
#
# A live Cubelet's warm-pool shells (pinned namespaces and veths made ahead
# of any pod, docs/warm-pools.md) are its working state, not leaks: the ids
# that each live agent lists (`cubelet ctl shells` on its admin socket,
# /run/cubelet/admin.sock and $LEAK_AUDIT_ADMIN_SOCKETS, space-separated) are
# left out of the namespace-pin and veth counts.
#
# --host also audits what an installed Cubelet (the Debian package, or
# hack/up.sh) would leave: its files, unit, bridge cubelet0, nft table, mounts
# and state under /run/cubelet and /var/lib/cubelet, its containerd namespace
# k8s.cubelet.io in the host's containerd, its processes and shims.
#
# Usage: hack/leak-audit.sh [--host]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
host=false
[[ "${1:-}" == "--host" ]] && host=true

leaks=0
count() { # NAME COUNT DETAIL
    printf 'leak-audit: %-22s %s\n' "$1" "$2"
    if [[ "$2" != 0 ]]; then
        leaks=$((leaks + 1))
        [[ -n "${3:-}" ]] && printf '%s\n' "$3" | sed 's/^/    /'
    fi
    return 0
}

# Warm-pool shells of live agents: excluded below.
shells=""
cubelet_bin=""
for b in "$REPO_ROOT/target/release/cubelet" "$REPO_ROOT/target/debug/cubelet" /usr/bin/cubelet; do
    [[ -x "$b" ]] && { cubelet_bin="$b"; break; }
done
if [[ -n "$cubelet_bin" ]]; then
    for sock in /run/cubelet/admin.sock ${LEAK_AUDIT_ADMIN_SOCKETS:-}; do
        [[ -S "$sock" ]] || continue
        if ids=$("$cubelet_bin" ctl --socket "$sock" shells 2>/dev/null); then
            shells+="$ids"$'\n'
            log "live agent at $sock: $(printf '%s' "$ids" | grep -c . || true) warm-pool shells are not leaks"
        fi
    done
fi
not_shell() { # keep lines that name none of the live shells (by id, or veth cb+prefix)
    local line id keep
    while IFS= read -r line; do
        [[ -n "$line" ]] || continue
        keep=true
        while IFS= read -r id; do
            [[ -n "$id" ]] || continue
            if [[ "$line" == *"$id"* || "$line" == "cb${id:0:11}" ]]; then keep=false; break; fi
        done <<<"$shells"
        $keep && printf '%s\n' "$line"
    done
    return 0
}

# Namespace pins (ours live under state dirs as <dir>/netns/<id> and, for
# sandboxes without an infra process, <dir>/podns/<id>/{ipc,uts}).
pins=$(grep -E ' nsfs ' /proc/self/mountinfo | awk '{print $5}' | grep -E 'cubelet' | not_shell || true)
count "namespace pins" "$(printf '%s' "$pins" | grep -c . || true)" "$pins"
# Host veth ends named by the bridge provider (cb + id prefix), and test bridges.
veths=$(ip -o link show type veth 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^cb' | not_shell || true)
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
done 2>/dev/null)
count "shim processes" "$(printf '%s' "$shims" | grep -c . || true)" "$shims"
# iptables rules left by CNI plugins (portmap) in the host's nat table.
cni_rules=$(iptables-save -t nat 2>/dev/null | grep -E 'CNI-' || true)
count "CNI iptables rules" "$(printf '%s' "$cni_rules" | grep -c . || true)" "$cni_rules"
if $host; then
    # What an installed Cubelet makes (the package's files, hack/up.sh's state).
    files=$(for f in /usr/bin/cubelet /usr/bin/cubelet-pause /lib/systemd/system/cubelet.service \
        /usr/lib/systemd/system/cubelet.service /etc/systemd/system/multi-user.target.wants/cubelet.service \
        /etc/cubelet /var/lib/cubelet /run/cubelet /run/cubelet-up /usr/share/doc/cubelet; do
        if [[ -e "$f" || -L "$f" ]]; then echo "$f"; fi
    done)
    count "installed files" "$(printf '%s' "$files" | grep -c . || true)" "$files"
    pkg=$(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' cubelet 2>/dev/null | grep -v '^un' || true)
    count "dpkg package" "$(printf '%s' "$pkg" | grep -c . || true)" "$pkg"
    bridge=$(ip -o link show dev cubelet0 2>/dev/null || true)
    count "bridge cubelet0" "$(printf '%s' "$bridge" | grep -c . || true)" "$bridge"
    table=$(nft list tables 2>/dev/null | grep -E '^table ip cubelet_cubelet0$' || true)
    count "nft table" "$(printf '%s' "$table" | grep -c . || true)" "$table"
    hmounts=$(awk '{print $5}' /proc/self/mountinfo | grep -E '^(/run|/var/lib)/cubelet(/|$)' || true)
    count "host mounts" "$(printf '%s' "$hmounts" | grep -c . || true)" "$hmounts"
    if [[ -S /run/containerd/containerd.sock ]]; then
        ns=$("$CTR_BIN" --address /run/containerd/containerd.sock namespaces ls -q 2>/dev/null | grep -x 'k8s.cubelet.io' || true)
        count "host containerd ns" "$(printf '%s' "$ns" | grep -c . || true)" "$ns"
    fi
    procs=$(for c in /proc/[0-9]*/cmdline; do
        tr '\0' ' ' <"$c" 2>/dev/null | grep -E '^(/usr/bin/cubelet |[^ ]*containerd-shim[^ ]* .*-namespace k8s\.cubelet\.io)' || true
    done 2>/dev/null)
    count "processes" "$(printf '%s' "$procs" | grep -c . || true)" "$procs"
fi
if ((leaks)); then
    log "leaks found in $leaks kinds"
    exit 1
fi
log "no leaks"
