#!/usr/bin/env bash
# The cubelet chart end to end on a real node (issue 37): a one-node
# cluster whose node is the systemd/cgroup v2 guest of hack/vm.sh, real helm
# (hack/helm.sh) installing charts/cubelet with kubelet.switchRuntime=true,
# a 10-pod Deployment moved onto Cubelet and back, an upgrade, faults, and
# helm uninstall down to an audit of the node. See docs/guest.md.
#
# The control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) runs on the HOST, on loopback ports: emulated (TCG) in
# the guest it would take the guest's two vCPUs from the kubelet and
# Cubelet under test. The guest's kubelet reaches the API server at
# 10.0.2.100:6443, a qemu guestfwd to the host's loopback
# (hack/vm/netfwd.py pipe); the API server reaches the kubelet (logs, exec,
# port-forward) through an HTTP CONNECT egress proxy on a unix socket
# (hack/vm/netfwd.py connect-proxy) that splices kubelet's port to a qemu
# hostfwd. The guest keeps restrict=on: it reaches nothing else.
#
# Usage: hack/vm/helm-test.sh [all]     the whole sequence (hack/vm.sh helm)
#        hack/vm/helm-test.sh up        control plane + guest node, left up
#        hack/vm/helm-test.sh STEP...   run steps against an `up` cluster
#        hack/vm/helm-test.sh env       print the KUBECONFIG to export
#        hack/vm/helm-test.sh down [DIR]  stop everything (logs to DIR)
# Steps: workload install upgrade fault-installer fault-reboot uninstall
#
# Binaries (built by hand outside the repository; the test is SKIPPED with
# a line saying which is missing): CUBELET_ETCD_BIN (local-etcd or etcd on
# PATH), KUBE_APISERVER_BIN, KUBE_CONTROLLER_MANAGER_BIN,
# KUBE_SCHEDULER_BIN, KUBECTL_BIN (kube-apiserver ... kubectl on PATH), the
# kubelet and crictl of hack/vm.sh (CUBELET_KUBELET_BIN, CRICTL_BIN), the
# Cubelet build (CUBELET_BIN, default target/debug/cubelet) and
# target/cubelet-pause.
# Env: CUBELET_VM_HELM_RUN (run dir, default /var/tmp/cubelet-vm-helm),
#      CUBELET_VM_OUT (logs of a failed run), CUBELET_VM_HELM_STEPS (the
#      steps of `all`), and hack/vm.sh's.
set -euo pipefail
# shellcheck disable=SC2317 # steps and checks run indirectly (run_step, wait_for)
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

VM="${HACK_DIR}/vm.sh"
RUN="${CUBELET_VM_HELM_RUN:-/var/tmp/cubelet-vm-helm}"
OUT_BASE="${CUBELET_VM_OUT:-${REPO_ROOT}/target/vm-out}"
TARGET_DIR="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"
STEPS="${CUBELET_VM_HELM_STEPS:-workload install upgrade fault-installer fault-reboot uninstall}"
export CUBELET_VM_STATE="${CUBELET_VM_STATE:-/var/tmp/cubelet-vm}"
export CUBELET_VM_MEM="${CUBELET_VM_MEM:-3072}"
NODE=cubelet-vm
NS=cubelet-system          # the chart's release namespace
APP_NS=cubelet-test-helm   # the workload's
RELEASE=cubelet
REPLICAS=10
GUEST_API=10.0.2.100:6443
CUBELET_SOCK=/run/cubelet/cubelet.sock
CONTAINERD_SOCK=/run/containerd/containerd.sock
INSTALLER_REPO=127.0.0.1:5000/cubelet-installer
V1_TAG=test-v1
V2_TAG=test-v2
V2_VERSION=0.2.0-helm-upgrade

now() { date +%s; }
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# find_bin VAR NAME...: the binary named by $VAR, else the first NAME on PATH.
find_bin() {
    local var="$1" name
    shift
    if [[ -n "${!var:-}" ]]; then
        [[ -x "${!var}" ]] && echo "${!var}"
        return 0
    fi
    for name in "$@"; do
        # type -P: a file on PATH, never this script's kubectl/helm functions.
        if type -P "$name" >/dev/null; then
            type -P "$name"
            return 0
        fi
    done
}

binaries() {
    ETCD="$(find_bin CUBELET_ETCD_BIN local-etcd etcd)"
    APISERVER="$(find_bin KUBE_APISERVER_BIN kube-apiserver)"
    KCM="$(find_bin KUBE_CONTROLLER_MANAGER_BIN kube-controller-manager)"
    SCHED="$(find_bin KUBE_SCHEDULER_BIN kube-scheduler)"
    KUBECTL="$(find_bin KUBECTL_BIN kubectl)"
    KUBELET="$(find_bin CUBELET_KUBELET_BIN kubelet-v1.28.7 kubelet)"
    CRICTL="$(find_bin CRICTL_BIN crictl)"
    CUBELET="${CUBELET_BIN:-${TARGET_DIR}/debug/cubelet}"
    local missing=()
    [[ -n "$ETCD" ]] || missing+=("etcd (CUBELET_ETCD_BIN, local-etcd or etcd on PATH)")
    [[ -n "$APISERVER" ]] || missing+=("kube-apiserver (KUBE_APISERVER_BIN)")
    [[ -n "$KCM" ]] || missing+=("kube-controller-manager (KUBE_CONTROLLER_MANAGER_BIN)")
    [[ -n "$SCHED" ]] || missing+=("kube-scheduler (KUBE_SCHEDULER_BIN)")
    [[ -n "$KUBECTL" ]] || missing+=("kubectl (KUBECTL_BIN)")
    [[ -n "$KUBELET" ]] || missing+=("kubelet (CUBELET_KUBELET_BIN, kubelet-v1.28.7)")
    [[ -n "$CRICTL" ]] || missing+=("crictl (CRICTL_BIN)")
    [[ -x "$CUBELET" ]] || missing+=("${CUBELET} (cargo build -p cubelet)")
    [[ -x "$PAUSE_BIN" ]] || missing+=("${PAUSE_BIN} (hack/build-pause.sh)")
    if ((${#missing[@]})); then
        log "SKIP helm guest test: missing ${missing[*]}"
        exit 0
    fi
    export CUBELET_KUBELET_BIN="$KUBELET" CRICTL_BIN="$CRICTL"
}

kubectl() { "$KUBECTL" --kubeconfig "${RUN}/admin.conf" "$@"; }
guest() { "$VM" run "$@"; }
helm() { "$HELM" --kubeconfig "${RUN}/admin.conf" "$@"; }

# --- PKI and kubeconfigs -------------------------------------------------

# cert NAME CN O [SAN]: a key and a certificate signed by the run's CA.
cert() {
    local name="$1" cn="$2" o="$3" san="${4:-}" ext="${RUN}/pki/${1}.ext"
    local subj="/CN=${cn}"
    [[ -n "$o" ]] && subj="/O=${o}${subj}"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >"$ext"
    [[ -n "$san" ]] && echo "subjectAltName=${san}" >>"$ext"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "${RUN}/pki/${name}.key" -subj "$subj" -out "${RUN}/pki/${name}.csr" 2>/dev/null
    openssl x509 -req -in "${RUN}/pki/${name}.csr" -CA "${RUN}/pki/ca.crt" -CAkey "${RUN}/pki/ca.key" \
        -CAcreateserial -days 2 -extfile "$ext" -out "${RUN}/pki/${name}.crt" 2>/dev/null
}

# kubeconfig FILE SERVER CERT: a kubeconfig with embedded credentials.
kubeconfig() {
    local b64="base64 -w0"
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: cubelet-vm
  cluster:
    server: https://$2
    certificate-authority-data: $($b64 "${RUN}/pki/ca.crt")
users:
- name: $3
  user:
    client-certificate-data: $($b64 "${RUN}/pki/$3.crt")
    client-key-data: $($b64 "${RUN}/pki/$3.key")
contexts:
- name: cubelet-vm
  context: {cluster: cubelet-vm, user: $3}
current-context: cubelet-vm
EOF
}

pki() {
    mkdir -p "${RUN}/pki" "${RUN}/node/pki"
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 2 \
        -subj /CN=cubelet-vm-ca -keyout "${RUN}/pki/ca.key" -out "${RUN}/pki/ca.crt" 2>/dev/null
    cert apiserver kube-apiserver "" "IP:127.0.0.1,IP:10.0.2.100,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    cert admin kubernetes-admin system:masters
    cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
    cert "node" "system:node:${NODE}" system:nodes
    openssl genrsa -out "${RUN}/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "${RUN}/pki/sa.key" -pubout -out "${RUN}/pki/sa.pub" 2>/dev/null
    kubeconfig "${RUN}/admin.conf" "127.0.0.1:${API_PORT}" admin
    chmod 0600 "${RUN}/admin.conf"
    kubeconfig "${RUN}/node/kubelet.conf" "$GUEST_API" node
    cp "${RUN}/pki/ca.crt" "${RUN}/node/pki/ca.crt"
}

# --- control plane on the host -------------------------------------------

# spawn NAME BIN ARGS...: start a control-plane process in its own session.
spawn() {
    local name="$1"
    shift
    setsid "$@" >"${RUN}/${name}.log" 2>&1 </dev/null &
    echo $! >"${RUN}/${name}.pid"
}

control_plane_up() {
    local etcd_port peer_port kfwd
    etcd_port="$(free_port)"
    peer_port="$(free_port)"
    API_PORT="$(free_port)"
    kfwd="$(free_port)"
    printf '%s\n' "$API_PORT" >"${RUN}/api_port"
    printf '%s\n' "$kfwd" >"${RUN}/kubelet_fwd_port"
    pki
    local etcd_args=(--data-dir "${RUN}/etcd" --listen-client-urls "http://127.0.0.1:${etcd_port}"
        --listen-peer-urls "http://127.0.0.1:${peer_port}")
    if [[ "$(basename "$ETCD")" != local-etcd ]]; then
        etcd_args+=(--advertise-client-urls "http://127.0.0.1:${etcd_port}"
            --initial-advertise-peer-urls "http://127.0.0.1:${peer_port}"
            --initial-cluster "default=http://127.0.0.1:${peer_port}" --log-level warn)
    fi
    spawn etcd "$ETCD" "${etcd_args[@]}"
    spawn egress /usr/bin/python3 "${HACK_DIR}/vm/netfwd.py" connect-proxy "${RUN}/egress.sock" "10250:${kfwd}"
    cat >"${RUN}/egress.yaml" <<EOF
apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: ${RUN}/egress.sock
EOF
    local p="${RUN}/pki"
    spawn kube-apiserver "$APISERVER" --etcd-servers "http://127.0.0.1:${etcd_port}" \
        --bind-address 127.0.0.1 --secure-port "$API_PORT" --advertise-address 10.0.2.100 \
        --tls-cert-file "${p}/apiserver.crt" --tls-private-key-file "${p}/apiserver.key" \
        --client-ca-file "${p}/ca.crt" \
        --kubelet-client-certificate "${p}/apiserver-kubelet-client.crt" \
        --kubelet-client-key "${p}/apiserver-kubelet-client.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "${p}/sa.pub" --service-account-signing-key-file "${p}/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 --authorization-mode Node,RBAC \
        --enable-admission-plugins NodeRestriction --allow-privileged=true \
        --egress-selector-config-file "${RUN}/egress.yaml" --endpoint-reconciler-type none \
        --profiling=false
    local t0
    t0="$(now)"
    until kubectl get --raw /readyz >/dev/null 2>&1; do
        (($(now) - t0 < 180)) || die "kube-apiserver not ready in 180 s (${RUN}/kube-apiserver.log)"
        pid_alive "${RUN}/kube-apiserver.pid" || die "kube-apiserver exited: $(tail -n 5 "${RUN}/kube-apiserver.log")"
        sleep 1
    done
    spawn kube-controller-manager "$KCM" --kubeconfig "${RUN}/admin.conf" \
        --authentication-kubeconfig "${RUN}/admin.conf" --authorization-kubeconfig "${RUN}/admin.conf" \
        --bind-address 127.0.0.1 --secure-port "$(free_port)" --leader-elect=false \
        --service-account-private-key-file "${p}/sa.key" --root-ca-file "${p}/ca.crt" \
        --use-service-account-credentials=true --cluster-signing-cert-file "${p}/ca.crt" \
        --cluster-signing-key-file "${p}/ca.key" --profiling=false
    spawn kube-scheduler "$SCHED" --kubeconfig "${RUN}/admin.conf" \
        --authentication-kubeconfig "${RUN}/admin.conf" --authorization-kubeconfig "${RUN}/admin.conf" \
        --bind-address 127.0.0.1 --secure-port "$(free_port)" --leader-elect=false --profiling=false
}

control_plane_down() {
    local name
    for name in kube-scheduler kube-controller-manager kube-apiserver egress etcd; do
        if pid_alive "${RUN}/${name}.pid"; then stop_pidfile "$name" "${RUN}/${name}.pid" 2>/dev/null; fi
    done
}

# --- the guest node --------------------------------------------------------

node_up() {
    local kfwd api
    kfwd="$(cat "${RUN}/kubelet_fwd_port")"
    api="$(cat "${RUN}/api_port")"
    # No e2e test binaries are needed in this guest.
    mkdir -p "${RUN}/no-e2e"
    CUBELET_VM_E2E_DIR="${RUN}/no-e2e" \
        CUBELET_VM_NET_EXTRA=",hostfwd=tcp:127.0.0.1:${kfwd}-:10250,guestfwd=tcp:${GUEST_API}-cmd:/usr/bin/python3 ${HACK_DIR}/vm/netfwd.py pipe 127.0.0.1 ${api}" \
        "$VM" boot
}

step_node() {
    # Through the control share: hack/vm.sh run's own ssh calls read stdin.
    tar -C "${RUN}/node" -cf "${CUBELET_VM_STATE}/ctl/node.tar" kubelet.conf pki
    guest "'${HACK_DIR}/vm/helm-node.sh' setup /mnt/bin </mnt/vmctl/node.tar"
    guest "'${HACK_DIR}/vm/helm-node.sh' push '${TARGET_DIR}/vm-helm/installer-${V1_TAG}' cubelet-installer ${V1_TAG}
        '${HACK_DIR}/vm/helm-node.sh' push '${TARGET_DIR}/vm-helm/installer-${V2_TAG}' cubelet-installer ${V2_TAG}
        '${HACK_DIR}/vm/helm-node.sh' start-kubelet"
    wait_for 300 "node ${NODE} registered" kubectl get node "$NODE"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
}

# wait_for SECONDS WHAT CMD...: retry CMD (quietly) until it succeeds.
wait_for() {
    local limit="$1" what="$2" t0
    shift 2
    t0="$(now)"
    until "$@" >/dev/null 2>&1; do
        (($(now) - t0 < limit)) || die "${what}: not within ${limit} s"
        sleep 3
    done
}

# --- checks ----------------------------------------------------------------

# kubelet_endpoint: the runtime endpoint of the guest's running kubelet.
kubelet_endpoint() {
    guest 'tr "\0" "\n" </proc/$(pidof kubelet)/cmdline | sed -n "s/^--container-runtime-endpoint=//p" | tail -n 1'
}
kubelet_on() { [[ "$(kubelet_endpoint 2>/dev/null)" == "unix://$1" ]]; }

# pods_on SOCKET [NAMESPACE]: ready pod sandboxes on that runtime.
pods_on() {
    guest "crictl -r unix://$1 pods --state ready ${2:+--namespace $2} -q" | grep -c . || true
}

# no_pods_on SOCKET: no pod sandbox at all (any state) on that runtime.
no_pods_on() { [[ "$(guest "crictl -r unix://$1 pods -q" | grep -c .)" == 0 ]]; }

deployment_ready() {
    [[ "$(kubectl -n "$APP_NS" get deploy web -o jsonpath='{.status.readyReplicas}')" == "$REPLICAS" ]] \
        && [[ "$(kubectl -n "$APP_NS" get deploy web -o jsonpath='{.status.updatedReplicas}')" == "$REPLICAS" ]] \
        && [[ "$(kubectl -n "$APP_NS" get pods -l app=web --no-headers | grep -c .)" == "$REPLICAS" ]]
}

# containers_state: "pod container-id restarts" of the workload, sorted.
containers_state() {
    kubectl -n "$APP_NS" get pods -l app=web -o jsonpath='{range .items[*]}{.metadata.name} {.status.containerStatuses[0].containerID} {.status.containerStatuses[0].restartCount}{"\n"}{end}' | sort
}

# streaming_checks: kubectl logs, exec and port-forward through Cubelet.
streaming_checks() {
    local pod out port pf
    pod="$(kubectl -n "$APP_NS" get pods -o jsonpath='{.items[0].metadata.name}')"
    out="$(kubectl -n "$APP_NS" logs "$pod")"
    [[ "$out" == *"web ${pod} serving"* ]] || die "kubectl logs ${pod}: ${out}"
    out="$(kubectl -n "$APP_NS" exec "$pod" -- cat /www/index.html)"
    [[ "$out" == "$pod" ]] || die "kubectl exec ${pod}: ${out}"
    port="$(free_port)"
    kubectl -n "$APP_NS" port-forward "pod/${pod}" "${port}:8080" >"${RUN}/port-forward.log" 2>&1 &
    pf=$!
    out=""
    for _ in $(seq 1 30); do
        out="$(curl -fsS "http://127.0.0.1:${port}/" 2>/dev/null || true)"
        [[ -n "$out" ]] && break
        sleep 1
    done
    kill "$pf" 2>/dev/null || true
    wait "$pf" 2>/dev/null || true
    [[ "$out" == "$pod" ]] || die "kubectl port-forward ${pod}: got '${out}' ($(cat "${RUN}/port-forward.log"))"
    log "logs, exec and port-forward of ${pod} answered"
}

helm_install_args() {
    printf '%s\n' --namespace "$NS" --create-namespace \
        --set "image.repository=${INSTALLER_REPO}" --set "image.tag=$1" \
        --set kubelet.switchRuntime=true --set config.runtime.cgroup_driver=systemd \
        --set install.readyTimeoutSeconds=600 --set uninstall.timeoutSeconds=600
}

installer_pod() {
    kubectl -n "$NS" get pods -l app.kubernetes.io/component=installer \
        -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | head -n 1
}
# installer_ready [SOCKET]: the DaemonSet rolled out, its one pod Ready, and
# (with SOCKET) its sandbox ready on that runtime.
installer_ready() {
    [[ "$(kubectl -n "$NS" get ds "$RELEASE" -o jsonpath='{.status.numberReady}/{.status.updatedNumberScheduled}/{.status.desiredNumberScheduled}')" == 1/1/1 ]] || return 1
    [[ "$(kubectl -n "$NS" get pods -l app.kubernetes.io/component=installer -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{end}')" == True ]] || return 1
    [[ -z "${1:-}" || "$(pods_on "$1" "$NS")" == 1 ]]
}

# --- steps -----------------------------------------------------------------

step_workload() {
    kubectl create namespace "$APP_NS" >/dev/null
    kubectl apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: ${APP_NS}}
spec:
  replicas: ${REPLICAS}
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: 2
      containers:
      - name: web
        image: 127.0.0.1:5000/busybox:test
        command: ["sh", "-c", "mkdir -p /www && hostname >/www/index.html && echo web \$(hostname) serving && exec httpd -f -p 8080 -h /www"]
        ports: [{containerPort: 8080}]
EOF
    wait_for 600 "deployment web ${REPLICAS}/${REPLICAS} on containerd" deployment_ready
    local n
    n="$(pods_on "$CONTAINERD_SOCK" "$APP_NS")"
    [[ "$n" == "$REPLICAS" ]] || die "containerd holds ${n} of the workload's pods, want ${REPLICAS}"
    log "${REPLICAS} pods running on containerd"
}

step_install() {
    step_install_switch
    step_install_pods
}

# The first half of install: refused while undrained, then switched.
step_install_switch() {
    local t0
    t0="$(now)"
    # shellcheck disable=SC2046
    helm install "$RELEASE" "${REPO_ROOT}/charts/cubelet" $(helm_install_args "$V1_TAG") >/dev/null
    # The workload is not drained: the installer installs Cubelet and
    # refuses to switch kubelet, saying why.
    wait_for 600 "the installer's refusal to switch an undrained node" \
        sh -c "'$KUBECTL' --kubeconfig '${RUN}/admin.conf' -n $NS logs -l app.kubernetes.io/component=installer --tail=-1 | grep -q 'drain the node'"
    log "installer refused to switch: $(kubectl -n "$NS" logs -l app.kubernetes.io/component=installer --tail=-1 | grep 'drain the node' | head -n 1)"
    kubelet_on "$CONTAINERD_SOCK" || die "kubelet switched before the node was drained"
    local drained
    drained="$(now)"
    kubectl drain "$NODE" --ignore-daemonsets --delete-emptydir-data --timeout=600s >"${RUN}/drain.log" 2>&1 \
        || die "kubectl drain: $(tail -n 3 "${RUN}/drain.log")"
    log "drained in $(($(now) - drained)) s"
    wait_for 600 "kubelet on Cubelet" kubelet_on "$CUBELET_SOCK"
    wait_for 600 "installer pod ready on Cubelet" installer_ready "$CUBELET_SOCK"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
    log "install to node Ready on Cubelet: $(($(now) - t0)) s"
    wait_for 300 "containerd emptied of kubelet's sandboxes" no_pods_on "$CONTAINERD_SOCK"
    log "containerd holds no pod sandbox"
}

# The second half of install: the workload comes back, on Cubelet.
step_install_pods() {
    local t0 n
    kubectl uncordon "$NODE" >/dev/null
    t0="$(now)"
    wait_for 900 "deployment web ${REPLICAS}/${REPLICAS} on Cubelet" deployment_ready
    log "${REPLICAS} pods Ready on Cubelet $(($(now) - t0)) s after uncordon"
    n="$(pods_on "$CUBELET_SOCK" "$APP_NS")"
    [[ "$n" == "$REPLICAS" ]] || die "Cubelet holds ${n} of the workload's pods, want ${REPLICAS}"
    [[ "$(pods_on "$CUBELET_SOCK" "$NS")" == 1 ]] || die "the installer pod $(installer_pod) is not on Cubelet"
    streaming_checks
    containers_state >"${RUN}/state-after-install"
}

# cubelet_version: RuntimeVersion of the Cubelet serving in the guest.
cubelet_version() {
    guest "crictl -r unix://${CUBELET_SOCK} version" 2>/dev/null | sed -n 's/^RuntimeVersion: *//p'
}
cubelet_version_is() { [[ "$(cubelet_version)" == "$1" ]]; }
cubelet_pid() { guest 'systemctl show -p MainPID --value cubelet'; }

# installer_on TAG: the installer pod runs the image TAG, Ready on Cubelet.
installer_on() {
    [[ "$(kubectl -n "$NS" get pods -l app.kubernetes.io/component=installer -o jsonpath='{.items[*].spec.containers[0].image}')" == "${INSTALLER_REPO}:$1" ]] \
        && installer_ready "$CUBELET_SOCK"
}

# same_containers BEFORE: the workload's pods, container IDs and restart
# counts are those of BEFORE (containers_state output).
same_containers() {
    local after
    after="$(containers_state)"
    [[ "$after" == "$1" ]] || die "the workload's containers changed:
$(diff <(echo "$1") <(echo "$after") || true)"
    log "${REPLICAS} pods kept their container IDs and restart counts"
}

# new_pod_on_cubelet: a new pod starts (on whatever Cubelet now runs).
new_pod_on_cubelet() {
    kubectl -n "$APP_NS" run probe --image=127.0.0.1:5000/busybox:test --restart=Never \
        --command -- sleep 3600 >/dev/null
    kubectl -n "$APP_NS" wait --for=condition=Ready pod/probe --timeout=300s >/dev/null
    guest "crictl -r unix://${CUBELET_SOCK} pods --name probe --state ready -q" | grep -q . \
        || die "pod probe is not on Cubelet"
    kubectl -n "$APP_NS" delete pod probe --wait=true >/dev/null
}

step_upgrade() {
    local before pid t0
    before="$(containers_state)"
    pid="$(cubelet_pid)"
    t0="$(now)"
    # shellcheck disable=SC2046
    helm upgrade "$RELEASE" "${REPO_ROOT}/charts/cubelet" $(helm_install_args "$V2_TAG") >/dev/null
    wait_for 900 "installer ${V2_TAG} Ready on Cubelet" installer_on "$V2_TAG"
    wait_for 300 "Cubelet ${V2_VERSION} serving" cubelet_version_is "$V2_VERSION"
    log "upgrade roll (helm upgrade to the new installer Ready, Cubelet ${V2_VERSION} serving): $(($(now) - t0)) s"
    [[ "$(cubelet_pid)" != "$pid" ]] || die "cubelet.service kept its process (pid ${pid}): not restarted"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
    wait_for 300 "deployment web ${REPLICAS}/${REPLICAS}" deployment_ready
    same_containers "$before"
    t0="$(now)"
    new_pod_on_cubelet
    log "a new pod ran on Cubelet ${V2_VERSION} ($(($(now) - t0)) s)"
}

# The installer killed mid-install: a roll back to the first build, the new
# installer pod force-deleted as soon as it has copied the binary (before
# it restarts cubelet); the DaemonSet's next pod must finish the job.
step_fault_installer() {
    local before pod t0 tag version
    # To the other build than the one installed (the first, after upgrade).
    if [[ "$(kubectl -n "$NS" get ds "$RELEASE" -o jsonpath='{.spec.template.spec.containers[0].image}')" == "${INSTALLER_REPO}:${V1_TAG}" ]]; then
        tag="$V2_TAG" version="$V2_VERSION"
    else
        tag="$V1_TAG" version="$("$CUBELET" --version | awk '{print $2}')"
    fi
    before="$(containers_state)"
    t0="$(now)"
    # shellcheck disable=SC2046
    helm upgrade "$RELEASE" "${REPO_ROOT}/charts/cubelet" $(helm_install_args "$tag") >/dev/null
    local deadline=$(($(now) + 900))
    pod=""
    while (($(now) < deadline)); do
        pod="$(kubectl -n "$NS" get pods -l app.kubernetes.io/component=installer -o jsonpath='{range .items[*]}{.metadata.name} {.spec.containers[0].image}{"\n"}{end}' \
            | awk -v img="${INSTALLER_REPO}:${tag}" '$2 == img {print $1}')"
        if [[ -n "$pod" ]] && kubectl -n "$NS" logs "$pod" 2>/dev/null | grep -q "installed ${CUBELET_BIN_DIR:-/opt/cubelet/bin}/cubelet$"; then
            break
        fi
        pod=""
        sleep 0.5
    done
    [[ -n "$pod" ]] || die "no installer pod of ${tag} copied the binary within 900 s"
    local last
    last="$(kubectl -n "$NS" logs "$pod" 2>/dev/null | tail -n 1)"
    kubectl -n "$NS" delete pod "$pod" --grace-period=0 --force >/dev/null 2>&1
    log "killed installer ${pod} mid-install, its log ending: ${last}"
    wait_for 900 "a new installer ${tag} Ready on Cubelet" installer_on "$tag"
    wait_for 300 "Cubelet ${version} serving" cubelet_version_is "$version"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
    log "killed mid-install to installed and Ready: $(($(now) - t0)) s; $(kubectl -n "$NS" logs -l app.kubernetes.io/component=installer --tail=-1 | grep -m1 'earlier installer' || echo 'the restart was not pending (the kill came after it)')"
    wait_for 300 "deployment web ${REPLICAS}/${REPLICAS}" deployment_ready
    same_containers "$before"
}

# The guest rebooted with Cubelet installed.
step_fault_reboot() {
    local t0 counts
    t0="$(now)"
    "$VM" reboot
    # The node's registry is not a unit; pods re-created later pull from it.
    guest "'${HACK_DIR}/registry.sh' start >/dev/null"
    wait_for 600 "kubelet on Cubelet after the reboot" kubelet_on "$CUBELET_SOCK"
    wait_for 900 "${REPLICAS} pods Ready on Cubelet after the reboot" workload_on_cubelet
    wait_for 600 "installer Ready on Cubelet after the reboot" installer_ready "$CUBELET_SOCK"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
    log "reboot to ${REPLICAS} pods Ready on Cubelet: $(($(now) - t0)) s"
    # The sandboxes of before the reboot are dead; kubelet keeps the last
    # one of each pod (with its exited container, for `logs --previous`).
    # Nothing of theirs may hold a veth or a netns: those are the ready
    # sandboxes' (but the hostNetwork installer's) and the warm shells'.
    counts="$(guest "echo \$(crictl -r unix://${CUBELET_SOCK} pods --state ready -q | wc -l) \$(crictl -r unix://${CUBELET_SOCK} pods -q | wc -l) \$(ip -o link show master cubelet0 | wc -l) \$(ls /run/cubelet/netns | wc -l) \$(/opt/cubelet/bin/cubelet ctl shells | wc -l)")"
    local ready all links netns shells
    read -r ready all links netns shells <<<"$counts"
    log "after the reboot: ${ready} ready sandboxes (${all} with the dead ones), ${links} veths on cubelet0, ${netns} netns, ${shells} warm shells"
    local want=$((ready - 1 + shells))
    ((links == want && netns == want)) || die "leak after the reboot: ${links} veths and ${netns} netns for ${ready} ready sandboxes (1 hostNetwork) and ${shells} shells"
}

workload_on_cubelet() { deployment_ready && [[ "$(pods_on "$CUBELET_SOCK" "$APP_NS")" == "$REPLICAS" ]]; }

step_uninstall() {
    local t0
    t0="$(now)"
    kubectl drain "$NODE" --ignore-daemonsets --delete-emptydir-data --timeout=600s >"${RUN}/drain.log" 2>&1 \
        || die "kubectl drain: $(tail -n 3 "${RUN}/drain.log")"
    log "drained in $(($(now) - t0)) s"
    t0="$(now)"
    helm uninstall "$RELEASE" --namespace "$NS" --wait --timeout 15m >/dev/null
    log "helm uninstall (pre-delete Job) took $(($(now) - t0)) s"
    wait_for 300 "kubelet on containerd" kubelet_on "$CONTAINERD_SOCK"
    kubectl wait --for=condition=Ready "node/${NODE}" --timeout=300s >/dev/null
    log "uninstall to node Ready on containerd: $(($(now) - t0)) s"
    kubectl uncordon "$NODE" >/dev/null
    t0="$(now)"
    wait_for 900 "deployment web ${REPLICAS}/${REPLICAS} back on containerd" deployment_ready
    log "${REPLICAS} pods Ready on containerd $(($(now) - t0)) s after uncordon"
    local n
    n="$(pods_on "$CONTAINERD_SOCK" "$APP_NS")"
    [[ "$n" == "$REPLICAS" ]] || die "containerd holds ${n} of the workload's pods, want ${REPLICAS}"
    streaming_checks
    guest "'${HACK_DIR}/vm/helm-node.sh' audit keep-state" | tee "${RUN}/audit.txt" >&2 \
        || die "the node audit found Cubelet leftovers"
}

# --- driver ----------------------------------------------------------------

SUMMARY=()
# run_step NAME FUNC: run a step, print its result and duration.
run_step() {
    local name="$1" t0 rc=0
    t0="$(now)"
    log "step: ${name}"
    # Not `(...) || rc=$?`: errexit is off in a subshell on the left of ||.
    set +e
    (
        set -e
        "$2"
    )
    rc=$?
    set -e
    local line
    line="$(printf '%-18s %-4s %5d s' "$name" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" "$(($(now) - t0))")"
    SUMMARY+=("$line")
    log "step: ${line}"
    return "$rc"
}

# build_images: the installer image of the Cubelet under test (v1) and of a
# second build reporting V2_VERSION (crates/cri's CUBELET_BUILD_VERSION),
# for the upgrade. The second build goes through the same target dir and
# is then undone by a plain build (cargo rebuilds cubelet-cri and cubelet
# only, both times).
# The second build is kept with the hash of the first it was made beside
# (cubelet-v2.base) and reused while that first build is the one tested.
build_images() {
    local v2="${TARGET_DIR}/vm-helm/cubelet-v2" base
    mkdir -p "${TARGET_DIR}/vm-helm"
    base="$(sha256sum "$CUBELET" | cut -d' ' -f1)"
    if [[ ! -x "$v2" || "$(cat "${v2}.base" 2>/dev/null)" != "$base" ]]; then
        (cd "$REPO_ROOT" && CUBELET_BUILD_VERSION="$V2_VERSION" nice cargo build -q -p cubelet)
        cp "${TARGET_DIR}/debug/cubelet" "$v2"
        (cd "$REPO_ROOT" && nice cargo build -q -p cubelet)
        sha256sum "$CUBELET" | cut -d' ' -f1 >"${v2}.base"
    fi
    CUBELET_BIN="$CUBELET" OUT="${TARGET_DIR}/vm-helm/installer-${V1_TAG}" \
        "${HACK_DIR}/build-installer-image.sh" debug >/dev/null
    CUBELET_BIN="${TARGET_DIR}/vm-helm/cubelet-v2" OUT="${TARGET_DIR}/vm-helm/installer-${V2_TAG}" \
        "${HACK_DIR}/build-installer-image.sh" debug >/dev/null
}

up() {
    binaries
    rm -rf "$RUN"
    mkdir -p "$RUN"
    HELM="$("${HACK_DIR}/helm.sh")"
    run_step "installer images" build_images
    run_step "control plane" control_plane_up
    run_step "boot" node_up
    run_step "node on containerd" step_node
}

down() {
    local keep="${1:-}"
    if [[ -n "$keep" ]]; then
        mkdir -p "$keep"
        guest "journalctl -u kubelet --no-pager -o short-monotonic >/mnt/vmctl/out/kubelet.journal 2>&1;
            journalctl -u cubelet --no-pager -o short-monotonic >/mnt/vmctl/out/cubelet.journal 2>&1;
            crictl -r unix://${CONTAINERD_SOCK} pods >/mnt/vmctl/out/pods-containerd.txt 2>&1;
            crictl -r unix://${CUBELET_SOCK} pods >/mnt/vmctl/out/pods-cubelet.txt 2>&1; true" 2>/dev/null || true
        if [[ -f "${RUN}/admin.conf" ]]; then
            kubectl get all,events -A -o wide >"${keep}/cluster.txt" 2>&1 || true
        fi
        cp -a "${RUN}"/*.log "$keep/" 2>/dev/null || true
    fi
    "$VM" stop "$keep" || true
    control_plane_down
    rm -rf "$RUN"
}

all() {
    local t0 rc=0 dir step
    t0="$(now)"
    up || rc=$?
    if ((rc == 0)); then
        for step in $STEPS; do
            run_step "$step" "step_${step//-/_}" || { rc=$?; break; }
        done
    fi
    if ((rc != 0)); then
        dir="${OUT_BASE}/helm-$(date -u +%Y%m%dT%H%M%SZ)"
        down "$dir"
        log "FAILED; console log, journals and control-plane logs in ${dir}"
    else
        down
    fi
    log "summary ($(($(now) - t0)) s in all):"
    printf '  %s\n' "${SUMMARY[@]}" >&2
    return "$rc"
}

main() {
    case "${1:-all}" in
        all) binaries; HELM="$("${HACK_DIR}/helm.sh")"; all ;;
        up) up ;;
        env) echo "export KUBECONFIG=${RUN}/admin.conf" ;;
        down) binaries; down "${2:-}" ;;
        *)
            binaries
            HELM="$("${HACK_DIR}/helm.sh")"
            local step
            for step in "$@"; do run_step "$step" "step_${step//-/_}"; done
            ;;
    esac
}

main "$@"; exit
