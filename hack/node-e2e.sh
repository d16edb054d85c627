#!/usr/bin/env bash
# Runs Kubernetes' node conformance suite (test/e2e_node of v1.28.7, its
# [NodeConformance] specs) on this machine, against a Cubelet of its own and,
# for comparison, against containerd's CRI plugin (a containerd of the run's
# own, started by hack/containerd.sh with its own root, state, socket and
# config), with the same kubelet, control plane and images.
#
# For each runtime: a control plane on 127.0.0.1 (hack/cluster.sh, with a
# bearer token for the suite), a kubelet registered as node cubelet-node-e2e
# (healthz on 127.0.0.1:10248; its API on 10250 and 10255 of 10.203.80.1, an
# address of a bridge without ports, cbtnodeip, of the run's, as the API
# server refuses to proxy to loopback addresses), then a prebuilt
# e2e_node.test with --start-services=false --prepull-images=false. The
# images the suite names (registry.k8s.io/e2e-test-images/...) are stand-ins
# built from Debian's busybox-static, a small static server
# (hack/critest/standin.c) and the agnhost binary given, pushed to the local
# registry (hack/registry.sh), which both runtimes' hosts.toml mirror
# registry.k8s.io (and gcr.io, k8s.gcr.io, invalid.registry.k8s.io) to.
# Cubelet runs under with-cubelet (e2e/src/bin/with-cubelet.rs: its own
# socket, state, containerd namespace and bridge in the shared private
# containerd, a leak audit, a teardown); the run's containerd gets a CNI
# bridge (cbtnode, 10.203.79.0/24).
#
# Results per runtime in $NODE_E2E_OUT/<runtime>/: junit_01.xml (one
# testcase per spec), e2e.log (the suite's output), kubelet.log, cubelet.log
# (Cubelet's run) and summary.txt. The last lines printed are one per
# runtime:
#   node-e2e <runtime>: N passed, N failed, N skipped (junit: <path>)
# then, with both runtimes, the specs that pass on containerd and fail on
# Cubelet (compare.txt). Afterwards everything this made is gone: kubelet's
# dirs, mounts, cgroups (/kubepods) and sysctls, the pods' log dirs, the
# node, the cluster, the run's containerd with its pods, images and CNI
# bridge, the kubelet address; hack/leak-audit.sh must then pass.
#
# Prints SKIP and exits 0 when e2e_node.test, kubelet, agnhost or the
# control plane binaries are absent. Needs root.
#
# Usage: hack/node-e2e.sh [--runtime cubelet|containerd|both] [--subset lifecycle|ci|conformance]
#                         [--focus REGEX] [--skip REGEX] [--agnhost PATH] [--procs N]
#                         [-- e2e_node.test args]
#   --subset lifecycle    (default) the pod and container lifecycle specs (52), about 35 min a runtime
#   --subset ci           lifecycle without the probe specs that wait 4 min each (48)
#   --subset conformance  every [NodeConformance] spec this node can run (211; about 90 min a
#                         runtime, 40 min with --procs 4)
#   --focus / --skip      replace the subset's regular expressions
#   --procs N             run the specs in N parallel ginkgo processes, as the
#                         project's own node e2e jobs do (the [Serial] specs are
#                         skipped in every subset); needs the ginkgo v2 CLI
#                         (GINKGO, or ginkgo on PATH; built from the same tree's
#                         vendor/github.com/onsi/ginkgo/v2/ginkgo)
# Env: E2E_NODE_TEST (default: e2e_node.test on PATH), KUBELET_BIN (default:
#      kubelet-v1.28.7 on PATH, else ../shared/tools/kubelet-v1.28.7), AGNHOST
#      (default: agnhost on PATH), NODE_E2E_OUT (default
#      ${CUBELET_TEST_ROOT}/node-e2e), NODE_E2E_PROCS (--procs), GINKGO,
#      NODE_E2E_DROP_IN (a config drop-in for Cubelet), CLUSTER_BIN_DIR
#      (hack/cluster.sh)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

NODE=cubelet-node-e2e
# kubelet's own address. The API server's node proxy (the suite reads
# kubelet's /configz through it) refuses loopback addresses, and kubelet a
# loopback --node-ip: kubelet listens on an address of a portless bridge of
# this script's, reachable from this host only, with client certificates of
# the cluster's CA and the API server's authorization (no anonymous access).
NODE_IP=10.203.80.1
NODE_IF=cbtnodeip
NODE_E2E_OUT="${NODE_E2E_OUT:-${CUBELET_TEST_ROOT}/node-e2e}"
WORK="${NODE_E2E_WORK:-/var/lib/cubelet-node-e2e}"
# containerd for the comparison: one of the run's own (hack/containerd.sh
# with its own root, state, socket, hosts.toml and CNI conf dir), so that
# the run never touches the shared one's pods and images, and leaves nothing
# in it.
CTRD_ENV=(CUBELET_TEST_ROOT="${WORK}/containerd" CUBELET_TEST_STATE=/run/cubelet-node-e2e)
CTRD_SOCK=/run/cubelet-node-e2e/containerd/containerd.sock
CTRD_ROOT="${WORK}/containerd"
CNI_CONF="${CTRD_ROOT}/cni-conf/10-cubelet-node-e2e.conflist"
CNI_BRIDGE=cbtnode
CNI_SUBNET=10.203.79.0/24
CNI_IPAM="${CUBELET_TEST_STATE}/cni-ipam-node-e2e"
MIRRORED=(registry.k8s.io k8s.gcr.io gcr.io invalid.registry.k8s.io)
KUBELET_PORTS=(10250 10255 10248)
KUBELET_SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops
    kernel/keys/root_maxkeys kernel/keys/root_maxbytes)
# Paths kubelet makes outside its root dir whatever its flags.
KUBELET_HOST_PATHS=(/var/log/pods /var/log/containers /var/lib/kubelet)
CGROUP_CONTROLLERS=(cpu cpuacct cpuset memory devices freezer blkio pids systemd hugetlb net_cls net_prio perf_event rdma misc unified)

# The subsets. Spec texts start with the container names, the labels come last.
LIFECYCLE_FOCUS='(Container Lifecycle Hook|Container Runtime|InitContainer|\[sig-node\] Pods |PrivilegedPod|Security Context|Probing container).*\[NodeConformance\]'
CONFORMANCE_FOCUS='\[NodeConformance\]'
# What this node cannot give, or the suite must not do to a shared host:
# kubelet restarts and reconfiguration (Serial, Disruptive), alpha
# features, AppArmor (disabled here), GPUs, flaky specs, and the two specs
# that pull a real image from gcr.io with credentials (outside network).
DEFAULT_SKIP='\[Flaky\]|\[Serial\]|\[Disruptive\]|\[NodeAlphaFeature:|\[Feature:|AppArmor|GPU|\[Benchmark\]|should be able to pull from private registry with (secret|credential provider)'

runtime=both
subset=lifecycle
focus=""
skip=""
agnhost="${AGNHOST:-$(command -v agnhost || true)}"
extra=()
one=""
procs="${NODE_E2E_PROCS:-1}"
while (($#)); do
    case "$1" in
        --runtime) runtime="$2"; shift 2 ;;
        --subset) subset="$2"; shift 2 ;;
        --focus) focus="$2"; shift 2 ;;
        --skip) skip="$2"; shift 2 ;;
        --agnhost) agnhost="$2"; shift 2 ;;
        --procs) procs="$2"; shift 2 ;;
        --one) one="$2"; shift 2 ;; # internal: one runtime, inside with-cubelet
        --) shift; extra=("$@"); break ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
case "$subset" in
    # The two [Slow] specs of the lifecycle files wait out kubelet's back-off (minutes).
    lifecycle) focus="${focus:-$LIFECYCLE_FOCUS}"; skip="${skip:-${DEFAULT_SKIP}|\[Slow\]}" ;;
    # CI's budget: without the probe specs that watch for 4 minutes that nothing restarts.
    ci) focus="${focus:-$LIFECYCLE_FOCUS}"; skip="${skip:-${DEFAULT_SKIP}|\[Slow\]|should \*not\* be restarted}" ;;
    conformance) focus="${focus:-$CONFORMANCE_FOCUS}" ;;
    *) die "--subset lifecycle|ci|conformance, not $subset" ;;
esac
skip="${skip:-$DEFAULT_SKIP}"
[[ "$procs" =~ ^[1-9][0-9]*$ ]] || die "--procs takes a positive number, not $procs"
case "$runtime" in
    both) runtimes=(containerd cubelet) ;;
    cubelet | containerd) runtimes=("$runtime") ;;
    *) die "--runtime cubelet|containerd|both, not $runtime" ;;
esac

E2E_NODE_TEST="${E2E_NODE_TEST:-$(command -v e2e_node.test || true)}"
KUBELET_BIN="${KUBELET_BIN:-$(command -v kubelet-v1.28.7 || echo "${REPO_ROOT}/../shared/tools/kubelet-v1.28.7")}"
KUBECTL="${KUBECTL:-$(command -v kubectl || true)}"
GINKGO="${GINKGO:-$(command -v ginkgo || true)}"
TARGET_DIR="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"

# ---------------------------------------------------------------------------
# Shared by both levels.

kc() { "$KUBECTL" --kubeconfig "$KUBECONFIG" "$@"; }

# The token the suite and the API server share (hack/cluster.sh CLUSTER_TOKEN).
token_file="${CUBELET_TEST_STATE}/node-e2e.token"

# ---------------------------------------------------------------------------
# One runtime: kubelet + the suite. Runs inside with-cubelet for Cubelet
# (CUBELET_SOCKET etc. in the environment), directly for containerd.

kubelet_config() { # FILE ENDPOINT DIR
    cat >"$1" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: ${NODE_IP}
port: 10250
readOnlyPort: 10255
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication: { anonymous: { enabled: false }, webhook: { enabled: true }, x509: { clientCAFile: ${CLUSTER_CA} } }
authorization: { mode: Webhook }
containerRuntimeEndpoint: unix://$2
imageServiceEndpoint: unix://$2
cgroupDriver: cgroupfs
cgroupRoot: /
cgroupsPerQOS: true
staticPodPath: $3/manifests
fileCheckFrequency: 10s
volumeStatsAggPeriod: 10s
serializeImagePulls: false
volumePluginDir: $3/volume-plugins
failSwapOn: false
makeIPTablesUtilChains: false
clusterDomain: cluster.local
# Pods resolve against their own loopback: nothing leaves the node.
clusterDNS: [127.0.0.1]
evictionPressureTransitionPeriod: 30s
# A shared, busy machine: no evictions in the middle of a spec.
evictionHard: { memory.available: "1Mi", nodefs.available: "0%", nodefs.inodesFree: "0%", imagefs.available: "0%" }
YAML
}

node_ready() {
    [[ "$(kc get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

# junit_counts FILE: "passed failed skipped" of a ginkgo junit report. The
# specs the focus left out are in the report too, as <skipped
# message="skipped">: not counted; a spec that skipped itself says why.
junit_counts() {
    python3 - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
p = f = s = 0
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    n = tc.get("name", "")
    if n.startswith(("[SynchronizedBeforeSuite]", "[SynchronizedAfterSuite]", "[ReportAfterSuite]")):
        continue
    sk = tc.find("skipped")
    if sk is not None:
        if sk.get("message") != "skipped":
            s += 1
    elif tc.find("failure") is not None or tc.find("error") is not None:
        f += 1
    else:
        p += 1
print(p, f, s)
PY
}

run_one() {
    local rt="$1" endpoint ctrd ns dir out rc=0
    if [[ "$rt" == cubelet ]]; then
        endpoint="$CUBELET_SOCKET"
        ctrd="$CUBELET_CONTAINERD"
        ns="$CUBELET_CONTAINERD_NAMESPACE"
    else
        endpoint="$CTRD_SOCK"
        ctrd="$CTRD_SOCK"
        ns=k8s.io
    fi
    dir="${WORK}/${rt}"
    out="${NODE_E2E_OUT}/${rt}"
    mkdir -p "$dir/root" "$dir/manifests" "$dir/volume-plugins" "$out"
    kubelet_config "$dir/kubelet.yaml" "$endpoint" "$dir"
    log "$rt: starting kubelet (log ${out}/kubelet.log)"
    nohup "$KUBELET_BIN" --config "$dir/kubelet.yaml" --kubeconfig "$KUBECONFIG" \
        --root-dir "$dir/root" --cert-dir "$dir/certs" --hostname-override "$NODE" \
        --node-ip "$NODE_IP" --containerd "$ctrd" --containerd-namespace "$ns" --v 2 \
        >"$out/kubelet.log" 2>&1 </dev/null &
    echo $! >"$dir/kubelet.pid"
    local i
    for i in $(seq 1 120); do
        node_ready && break
        pid_alive "$dir/kubelet.pid" || { tail -n 30 "$out/kubelet.log" >&2; die "$rt: kubelet exited"; }
        sleep 1
    done
    node_ready || { stop_kubelet "$dir"; die "$rt: node $NODE not Ready within 120 s"; }
    log "$rt: node $NODE Ready; running $(basename "$E2E_NODE_TEST") (output ${out}/e2e.log)"
    local args=(
        --start-services=false --prepull-images=false
        --host="$CLUSTER_SERVER" --bearer-token="$(cat "$token_file")"
        --node-name="$NODE" --dns-domain=cluster.local
        --container-runtime-endpoint="unix://${endpoint}" --image-service-endpoint="unix://${endpoint}"
        --report-dir="$out" --kubectl-path="$KUBECTL"
    )
    local run=("$E2E_NODE_TEST" "${args[@]}"
        --ginkgo.focus="$focus" --ginkgo.skip="$skip"
        --ginkgo.no-color --ginkgo.timeout=5h --ginkgo.v)
    if ((procs > 1)); then
        # The ginkgo CLI runs the binary N times and merges their reports
        # (one junit_01.xml still).
        run=("$GINKGO" --procs="$procs" --focus="$focus" --skip="$skip"
            --no-color --timeout=5h -v "$E2E_NODE_TEST" -- "${args[@]}")
    fi
    # The suite writes next to itself (kubelet-config, static pod files): its own dir.
    (cd "$dir" && "${run[@]}" "${extra[@]}") >"$out/e2e.log" 2>&1 || rc=$?
    grep -E '^\[FAIL\]|^(Ran|SUCCESS!|FAIL!) ' "$out/e2e.log" | sed "s/^/[$rt] /" || true
    # The framework deleted its namespaces; wait for kubelet to see the pods gone.
    for i in $(seq 1 180); do
        [[ -z "$(kc get pods -A --no-headers 2>/dev/null)" ]] && break
        sleep 1
    done
    if [[ -n "$(kc get pods -A --no-headers 2>/dev/null)" ]]; then
        log "$rt: pods left after 3 min, deleting them"
        kc get pods -A --no-headers 2>/dev/null >&2 || true
        kc delete pods -A --all --grace-period=0 --force >/dev/null 2>&1 || true
        sleep 5
    fi
    stop_kubelet "$dir"
    kc delete node "$NODE" --ignore-not-found >/dev/null
    # The daemon's log goes with its teardown: a copy stays with the results.
    [[ -n "${CUBELET_LOG:-}" && -f "$CUBELET_LOG" ]] && cp "$CUBELET_LOG" "$out/cubelet.log"
    if [[ -f "$out/junit_01.xml" ]]; then
        local counts
        read -r -a counts < <(junit_counts "$out/junit_01.xml")
        echo "node-e2e ${rt}: ${counts[0]} passed, ${counts[1]} failed, ${counts[2]} skipped (junit: ${out}/junit_01.xml)" \
            | tee "$out/summary.txt"
    else
        echo "node-e2e ${rt}: no junit report (suite exit ${rc}; see ${out}/e2e.log)" | tee "$out/summary.txt"
        rc=1
    fi
    return "$rc"
}

stop_kubelet() { # DIR
    local dir="$1" m
    stop_pidfile kubelet "$dir/kubelet.pid"
    # kubelet mounts its root dir onto itself, and the pods' volumes under it.
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$dir/" '$2 ~ "^"d {print $2}' /proc/self/mounts | sort -r)
}

if [[ -n "$one" ]]; then
    run_one "$one"
    exit $?
fi

# ---------------------------------------------------------------------------
# The whole run.

missing=()
[[ -n "$E2E_NODE_TEST" && -x "$E2E_NODE_TEST" ]] || missing+=("e2e_node.test (E2E_NODE_TEST or PATH)")
[[ -x "$KUBELET_BIN" ]] || missing+=("kubelet (KUBELET_BIN or kubelet-v1.28.7 on PATH)")
[[ -n "$agnhost" && -x "$agnhost" ]] || missing+=("agnhost (--agnhost, AGNHOST or PATH)")
[[ -n "$KUBECTL" && -x "$KUBECTL" ]] || missing+=("kubectl (KUBECTL or PATH)")
if ((procs > 1)) && [[ -z "$GINKGO" || ! -x "$GINKGO" ]]; then
    die "--procs ${procs} needs the ginkgo v2 CLI (GINKGO, or ginkgo on PATH)"
fi
if ! cp_missing="$("${HACK_DIR}/cluster.sh" have 2>&1)"; then
    missing+=("$cp_missing")
fi
if ((${#missing[@]})); then
    echo "SKIP: node e2e: not found: $(IFS=';'; echo "${missing[*]}")"
    exit 0
fi
[[ $EUID -eq 0 ]] || die "run as root: kubelet and the runtimes make namespaces, mounts and cgroups"
# PrivilegedPod's spec makes a dummy link in the pod: a kernel without the
# dummy driver fails it whatever the runtime.
if ! ip link add cbtdummyprobe type dummy 2>/dev/null; then
    log "this kernel has no dummy link driver: skipping PrivilegedPod's 'should enable privileged commands'"
    skip="${skip}|PrivilegedPod .*should enable privileged commands"
fi
ip link del cbtdummyprobe 2>/dev/null || true
need_bin python3 python3
need_bin cc gcc
need_bin openssl openssl
for p in "${KUBELET_PORTS[@]}"; do
    if ss -Hltn "sport = :${p}" | grep -q .; then die "port ${p} is taken: another kubelet runs here"; fi
done
[[ ! -e "/sys/class/net/${NODE_IF}" ]] || die "interface ${NODE_IF} exists: another run, or one that did not clean up"
if [[ -e "$WORK" ]]; then die "$WORK exists: another run, or one that did not clean up"; fi
if "${HACK_DIR}/cluster.sh" status >/dev/null 2>&1; then
    die "a cluster of hack/cluster.sh already runs: this suite needs its own (hack/cluster.sh stop)"
fi

"${HACK_DIR}/containerd.sh" status >/dev/null 2>&1 || "${HACK_DIR}/containerd.sh" start
"${HACK_DIR}/registry.sh" status >/dev/null 2>&1 || "${HACK_DIR}/registry.sh" start
[[ -x "$PAUSE_BIN" ]] || PAUSE_BIN="$PAUSE_BIN" "${HACK_DIR}/build-pause.sh" >/dev/null
"${HACK_DIR}/test-images.sh" 2>/dev/null # pause:test, containerd's sandbox image
mkdir -p "$WORK" "$NODE_E2E_OUT" "$CUBELET_TEST_STATE"
log "building the stand-in server and pushing the suite's images to ${REGISTRY_ADDR}"
cc -static -O2 -Wall -o "$WORK/standin" "${HACK_DIR}/critest/standin.c"
python3 "${HACK_DIR}/node-e2e/images.py" "$REGISTRY_ADDR" "$BUSYBOX_BIN" "$WORK/standin" "$agnhost" "$PAUSE_BIN"

# What the host had before, to put back.
declare -A sysctl_before=()
for k in "${KUBELET_SYSCTLS[@]}"; do
    [[ -r "/proc/sys/$k" ]] && sysctl_before[$k]="$(cat "/proc/sys/$k")"
done
host_paths_made=()
for p in "${KUBELET_HOST_PATHS[@]}"; do [[ -e "$p" ]] || host_paths_made+=("$p"); done
pod_logs_before="$(ls /var/log/pods 2>/dev/null || true)"
container_logs_before="$(ls /var/log/containers 2>/dev/null || true)"
cgroups_made=()
for c in "${CGROUP_CONTROLLERS[@]}"; do
    [[ -d "/sys/fs/cgroup/$c" && ! -e "/sys/fs/cgroup/$c/kubepods" ]] && cgroups_made+=("/sys/fs/cgroup/$c/kubepods")
done
cni_chains_before=no
iptables-save -t nat 2>/dev/null | grep -q 'CNI-' && cni_chains_before=yes
crictl_ctrd=(crictl --runtime-endpoint "unix://${CTRD_SOCK}" --image-endpoint "unix://${CTRD_SOCK}")

remove_cgroups() {
    local c
    for c in "${cgroups_made[@]}"; do
        [[ -d "$c" ]] || continue
        # Deepest first; a cgroup with a process left cannot go (reported).
        find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        [[ -d "$c" ]] && log "warning: $c could not be removed"
    done
    return 0
}

cni_down() {
    rm -f "$CNI_CONF"
    [[ -e "/sys/class/net/${CNI_BRIDGE}" ]] && ip link del "$CNI_BRIDGE"
    rm -rf "$CNI_IPAM"
    if [[ "$cni_chains_before" == no ]]; then
        local rule chain
        while IFS= read -r rule; do
            [[ -n "$rule" ]] && eval "iptables -t nat -D $rule"
        done < <(iptables-save -t nat 2>/dev/null | grep -E 'CNI-' | sed -n 's/^-A //p')
        while IFS= read -r chain; do
            [[ -n "$chain" ]] && iptables -t nat -X "$chain"
        done < <(iptables-save -t nat 2>/dev/null | grep -E 'CNI-' | sed -n 's/^:\([^ ]*\) .*/\1/p')
    fi
    return 0
}

containerd_cleanup() {
    local id m
    # Every pod of the run's containerd (kubelet's leftovers), then containerd.
    if [[ -S "$CTRD_SOCK" ]]; then
        for id in $("${crictl_ctrd[@]}" pods -q 2>/dev/null); do
            "${crictl_ctrd[@]}" stopp "$id" >/dev/null 2>&1 || true
            "${crictl_ctrd[@]}" rmp "$id" >/dev/null 2>&1 || log "warning: containerd pod $id not removed"
        done
    fi
    env "${CTRD_ENV[@]}" "${HACK_DIR}/containerd.sh" stop >/dev/null 2>&1 || true
    cni_down
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$CTRD_ROOT/" '$2 ~ "^"d {print $2}' /proc/self/mounts | sort -r)
    rm -rf "$CTRD_ROOT" /run/cubelet-node-e2e
}

cleanup() {
    local rc=$? k p e
    set +e
    [[ -f "${WORK}/containerd/kubelet.pid" ]] && stop_kubelet "${WORK}/containerd"
    [[ -f "${WORK}/cubelet/kubelet.pid" ]] && stop_kubelet "${WORK}/cubelet"
    [[ -e "$CTRD_ROOT" ]] && containerd_cleanup
    CLUSTER_TOKEN="" "${HACK_DIR}/cluster.sh" stop >/dev/null 2>&1
    [[ -e "/sys/class/net/${NODE_IF}" ]] && ip link del "$NODE_IF"
    remove_cgroups
    for k in "${!sysctl_before[@]}"; do
        echo "${sysctl_before[$k]}" >"/proc/sys/$k" 2>/dev/null || log "warning: could not restore $k"
    done
    # The pods' log dirs of this run (other suites' kubelets use the kl- namespaces).
    for e in $(ls /var/log/pods 2>/dev/null); do
        grep -qx "$e" <<<"$pod_logs_before" || [[ "$e" == kl-* ]] || rm -rf "/var/log/pods/$e"
    done
    for e in $(ls /var/log/containers 2>/dev/null); do
        grep -qx "$e" <<<"$container_logs_before" || [[ "$e" == *_kl-*_* ]] || rm -f "/var/log/containers/$e"
    done
    for p in "${host_paths_made[@]}"; do rm -rf "$p"; done
    rm -f "$token_file"
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM


(umask 077; head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$token_file")
if [[ ! -e "/sys/class/net/${NODE_IF}" ]]; then
    ip link add "$NODE_IF" type bridge
    ip addr add "${NODE_IP}/32" dev "$NODE_IF"
    ip link set "$NODE_IF" up
fi
CLUSTER_TOKEN="$(cat "$token_file")" CLUSTER_KUBELET_ADDRESS_TYPES=InternalIP "${HACK_DIR}/cluster.sh" start
eval "$("${HACK_DIR}/cluster.sh" env)"
export KUBECONFIG CLUSTER_SERVER CLUSTER_CA

self="${HACK_DIR}/node-e2e.sh"
pass_on=(--focus "$focus" --skip "$skip" --agnhost "$agnhost" --procs "$procs")
status=0
for rt in "${runtimes[@]}"; do
    rm -rf "${NODE_E2E_OUT:?}/${rt}"
    if [[ "$rt" == containerd ]]; then
        env "${CTRD_ENV[@]}" "${HACK_DIR}/containerd.sh" start
        for m in "${MIRRORED[@]}"; do
            mkdir -p "${CTRD_ROOT}/containerd-certs.d/${m}"
            printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
                "$REGISTRY_ADDR" "$REGISTRY_ADDR" >"${CTRD_ROOT}/containerd-certs.d/${m}/hosts.toml"
        done
        mkdir -p "$(dirname "$CNI_CONF")"
        cat >"$CNI_CONF" <<JSON
{"cniVersion": "0.4.0", "name": "cubelet-node-e2e", "plugins": [
  {"type": "bridge", "bridge": "${CNI_BRIDGE}", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "${CNI_SUBNET}"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "${CNI_IPAM}"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
        sleep 1
        "$self" --one containerd "${pass_on[@]}" -- "${extra[@]}" || status=1
        containerd_cleanup
    else
        log "building cubelet and with-cubelet"
        (cd "$REPO_ROOT" && cargo build -q -p cubelet && cargo build -q -p cubelet-e2e --bin with-cubelet)
        drop_in=()
        [[ -n "${NODE_E2E_DROP_IN:-}" ]] && drop_in=(--drop-in "$NODE_E2E_DROP_IN")
        "${TARGET_DIR}/debug/with-cubelet" "${drop_in[@]}" -- \
            "$self" --one cubelet "${pass_on[@]}" -- "${extra[@]}" || status=1
    fi
    remove_cgroups
done

if [[ ${#runtimes[@]} == 2 && -f "${NODE_E2E_OUT}/containerd/junit_01.xml" && -f "${NODE_E2E_OUT}/cubelet/junit_01.xml" ]]; then
    python3 - "${NODE_E2E_OUT}/containerd/junit_01.xml" "${NODE_E2E_OUT}/cubelet/junit_01.xml" <<'PY' | tee "${NODE_E2E_OUT}/compare.txt"
import sys, xml.etree.ElementTree as ET
def res(p):
    out = {}
    for tc in ET.parse(p).getroot().iter("testcase"):
        sk = tc.find("skipped")
        if sk is not None and sk.get("message") == "skipped":
            continue  # left out by the focus
        st = "skipped" if sk is not None else "failed" if (tc.find("failure") is not None or tc.find("error") is not None) else "passed"
        out[tc.get("name")] = st
    return out
c, k = res(sys.argv[1]), res(sys.argv[2])
worse = sorted(n for n, s in c.items() if s == "passed" and k.get(n) == "failed")
both = sorted(n for n, s in c.items() if s == "failed" and k.get(n) == "failed")
better = sorted(n for n, s in k.items() if s == "passed" and c.get(n) == "failed")
print(f"node-e2e: pass on containerd, fail on Cubelet: {len(worse)}")
for n in worse: print("  " + n)
print(f"node-e2e: fail on both: {len(both)}")
for n in both: print("  " + n)
print(f"node-e2e: pass on Cubelet, fail on containerd: {len(better)}")
for n in better: print("  " + n)
PY
fi
exit "$status"
