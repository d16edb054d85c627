#!/usr/bin/env bash
# Runs INSIDE the test guest for hack/vm/helm-test.sh (hack/vm.sh helm).
#
#   helm-node.sh setup BIN_DIR     make the guest a kubeadm-style worker on
#       containerd: kubelet at /usr/bin/kubelet run by kubelet.service with
#       kubeadm's 10-kubeadm.conf drop-in, /var/lib/kubelet/config.yaml and
#       kubeadm-flags.env (the runtime endpoint: containerd), crictl, a CNI
#       bridge for containerd's pods; the local registry with the test
#       images. The certificates and kubeconfigs come on stdin as a tar of
#       /etc/kubernetes (made on the host). Cubelet's files baked into the
#       guest image for hack/vm.sh test are removed: the node starts without
#       Cubelet, as a node the chart is installed on does.
#   helm-node.sh push LAYOUT REPO TAG   push an OCI layout to the registry
#   helm-node.sh start-kubelet     enable and start kubelet
#   helm-node.sh audit [keep-state]     list what Cubelet left on the node;
#       exits 1 if anything (state dirs excepted with keep-state)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

CONTAINERD_SOCK=/run/containerd/containerd.sock

setup() {
    local bin="$1"
    systemctl is-active -q containerd || die "containerd.service is not active"
    # Cubelet files of the image (hack/vm.sh test's): not on this node.
    systemctl disable --now cubelet.service >/dev/null 2>&1 || true
    rm -f /etc/systemd/system/cubelet.service /etc/cubelet/config.yaml
    rm -rf /opt/cubelet

    mkdir -p /etc/kubernetes
    tar -C /etc/kubernetes -xf -
    install -m 0755 "${bin}/kubelet" /usr/bin/kubelet
    install -m 0755 "${bin}/crictl" /usr/bin/crictl
    printf 'runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 30\n' \
        "$CONTAINERD_SOCK" "$CONTAINERD_SOCK" >/etc/crictl.yaml

    # kubelet.service and 10-kubeadm.conf as the kubeadm packages ship them.
    cat >/etc/systemd/system/kubelet.service <<'UNIT'
[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
UNIT
    mkdir -p /etc/systemd/system/kubelet.service.d /var/lib/kubelet /etc/kubernetes/manifests
    cat >/etc/systemd/system/kubelet.service.d/10-kubeadm.conf <<'UNIT'
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
UNIT
    echo "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix://${CONTAINERD_SOCK} --pod-infra-container-image=127.0.0.1:5000/pause:test\"" \
        >/var/lib/kubelet/kubeadm-flags.env
    # The guest's disk is small and emulated: no image GC or eviction on
    # disk pressure during the run.
    cat >/var/lib/kubelet/config.yaml <<'CFG'
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization: {mode: Webhook}
clusterDNS: [10.96.0.10]
clusterDomain: cluster.local
staticPodPath: /etc/kubernetes/manifests
rotateCertificates: false
failSwapOn: false
runtimeRequestTimeout: 4m
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
CFG

    # containerd's pod network: a CNI bridge as a CNI add-on would write.
    mkdir -p /etc/cni/net.d
    cat >/etc/cni/net.d/10-containerd-net.conflist <<'CNI'
{"cniVersion": "1.0.0", "name": "containerd-net", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "promiscMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI
    systemctl daemon-reload
    systemctl restart containerd
    # The node's image registry (images never come from outside).
    PAUSE_BIN="${bin}/cubelet-pause" "${HACK_DIR}/registry.sh" start >/dev/null
    PAUSE_BIN="${bin}/cubelet-pause" "${HACK_DIR}/test-images.sh" >/dev/null 2>&1 \
        || die "hack/test-images.sh failed"
}

# audit [keep-state]: everything of Cubelet's on the node.
audit() {
    local keep="${1:-}" found=0 f
    report() { echo "LEFT: $*"; found=1; }
    systemctl list-units --all --no-legend 'cubelet*' | grep -q . && report "units: $(systemctl list-units --all --no-legend 'cubelet*' | tr '\n' ';')"
    for f in /etc/systemd/system/cubelet.service /opt/cubelet /etc/cubelet/config.yaml \
        /etc/systemd/system/kubelet.service.d/99-cubelet-runtime.conf /etc/systemd/system/multi-user.target.wants/cubelet.service; do
        [[ -e "$f" ]] && report "file $f"
    done
    if [[ "$keep" != keep-state ]]; then
        for f in /var/lib/cubelet /run/cubelet; do [[ -e "$f" ]] && report "state $f"; done
    fi
    pgrep -a -x cubelet && report "cubelet process"
    ip -o link show cubelet0 >/dev/null 2>&1 && report "bridge cubelet0"
    # Cubelet's veths are cb<12 hex>; containerd's pods' netns (cni-*) are
    # not Cubelet's.
    local links
    links="$(ip -o link | awk -F': ' '{print $2}' | grep -E '^(cb[0-9a-f]{12}|cubelet)' | tr '\n' ' ' || true)"
    [[ -n "$links" ]] && report "links: ${links}"
    # shellcheck disable=SC2010 # netns names are plain
    [[ -d /run/netns ]] && ls /run/netns | grep -vq '^cni-' && report "netns files: $(ls /run/netns | grep -v '^cni-' | tr '\n' ' ')"
    nft list tables 2>/dev/null | grep -i cubelet && report "nft tables"
    grep -E 'cubelet' /proc/mounts && report "mounts"
    [[ -n "$(find /sys/fs/cgroup -maxdepth 3 -name '*cubelet*' 2>/dev/null)" ]] \
        && report "cgroups: $(find /sys/fs/cgroup -maxdepth 3 -name '*cubelet*' | tr '\n' ' ')"
    local ns
    ns="$(ctr namespaces ls -q 2>/dev/null | grep cubelet || true)"
    if [[ -n "$ns" ]]; then
        local c t
        c="$(ctr -n "$ns" containers ls -q | wc -l)"
        t="$(ctr -n "$ns" tasks ls -q | wc -l)"
        ((c + t == 0)) || report "containerd namespace ${ns}: ${c} containers, ${t} tasks"
    fi
    pgrep -af 'containerd-shim.*k8s.cubelet' && report "shims of Cubelet's namespace"
    ((found == 0)) && echo "audit: nothing of Cubelet left${keep:+ (state kept)}"
    return "$found"
}

case "${1:-}" in
    setup) setup "$2" ;;
    push) python3 "${HACK_DIR}/vm/push-oci.py" "$2" 127.0.0.1:5000 "$3" "$4" ;;
    start-kubelet) systemctl enable --now kubelet.service >/dev/null 2>&1 ;;
    audit) audit "${2:-}" ;;
    *) die "usage: $0 setup BIN_DIR | push LAYOUT REPO TAG | start-kubelet | audit [keep-state]" ;;
esac
