#!/usr/bin/env bash
# A throwaway Kubernetes control plane on 127.0.0.1 for the tests and
# benchmarks that need a real API server (node e2e, density): etcd,
# kube-apiserver, kube-controller-manager and kube-scheduler, with a CA and
# certificates made for the run and an admin kubeconfig. Nodes join with the
# admin kubeconfig (kubelets run by the caller).
#
# Usage: hack/cluster.sh start|stop|status|env|audit
#   env    prints `export KUBECONFIG=...` and the addresses, for eval
#   stop   stops the processes and removes every file the run made
#   audit  exits 1 if anything of a cluster (process, port, directory) is left
#
# Binaries (built by hand outside the repository, never part of it) are
# taken from CLUSTER_BIN_DIR, else PATH: an etcd (Debian's `etcd-server`,
# installed by hack/deps.sh, or a `local-etcd`
# with the same flags), kube-apiserver, kube-controller-manager,
# kube-scheduler. `start` exits 3 with one line naming what is missing, so
# callers can skip clearly (`hack/cluster.sh have` checks without starting).
#
# Env: CLUSTER_ROOT CLUSTER_STATE CLUSTER_ETCD_PORT CLUSTER_API_PORT
#      CLUSTER_SERVICE_CIDR CLUSTER_SCHEDULER (0: no scheduler)
#      CLUSTER_TOKEN (a bearer token the API server also accepts, as a member
#      of system:masters: the node e2e suite's --bearer-token; none by default)
#      CLUSTER_KUBELET_ADDRESS_TYPES (the node address types the API server
#      dials kubelets on, in order; default Hostname,InternalIP)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER_ROOT="${CLUSTER_ROOT:-${CUBELET_TEST_ROOT}/cluster}"
CLUSTER_STATE="${CLUSTER_STATE:-${CUBELET_TEST_STATE}/cluster}"
CLUSTER_ETCD_PORT="${CLUSTER_ETCD_PORT:-23790}"
CLUSTER_API_PORT="${CLUSTER_API_PORT:-16443}"
CLUSTER_CM_PORT="${CLUSTER_CM_PORT:-20257}"
CLUSTER_SCHED_PORT="${CLUSTER_SCHED_PORT:-20259}"
CLUSTER_SERVICE_CIDR="${CLUSTER_SERVICE_CIDR:-10.0.0.0/24}"
CLUSTER_SERVICE_IP="${CLUSTER_SERVICE_IP:-10.0.0.1}"
CLUSTER_SCHEDULER="${CLUSTER_SCHEDULER:-1}"
CLUSTER_TOKEN="${CLUSTER_TOKEN:-}"
CLUSTER_KUBELET_ADDRESS_TYPES="${CLUSTER_KUBELET_ADDRESS_TYPES:-Hostname,InternalIP}"
CERTS="${CLUSTER_ROOT}/pki"
KUBECONFIG_FILE="${CLUSTER_ROOT}/admin.kubeconfig"

# find_bin NAME...: the first of NAMEs in CLUSTER_BIN_DIR or on PATH.
find_bin() {
    local name
    for name in "$@"; do
        if [[ -n "${CLUSTER_BIN_DIR:-}" && -x "${CLUSTER_BIN_DIR}/${name}" ]]; then
            echo "${CLUSTER_BIN_DIR}/${name}"
            return 0
        fi
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

# resolve_bins: sets ETCD APISERVER CM SCHED, or prints what is missing and
# returns 3.
resolve_bins() {
    local missing=()
    ETCD="$(find_bin etcd local-etcd)" || missing+=("etcd (or local-etcd)")
    APISERVER="$(find_bin kube-apiserver)" || missing+=(kube-apiserver)
    CM="$(find_bin kube-controller-manager)" || missing+=(kube-controller-manager)
    SCHED=""
    if [[ "$CLUSTER_SCHEDULER" != 0 ]]; then
        SCHED="$(find_bin kube-scheduler)" || missing+=(kube-scheduler)
    fi
    if ((${#missing[@]})); then
        echo "control plane binaries not found (CLUSTER_BIN_DIR or PATH): ${missing[*]}" >&2
        return 3
    fi
}

make_certs() {
    mkdir -p "$CERTS"
    chmod 0700 "$CERTS"
    (
        cd "$CERTS"
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=cubelet-test-ca" \
            -keyout ca.key -out ca.crt 2>/dev/null
        # name CN O [SANs]: a key and a certificate signed by the CA.
        sign() {
            local name="$1" cn="$2" org="$3" sans="${4:-}" subj="/CN=$2"
            [[ -n "$org" ]] && subj="/O=${org}/CN=${cn}"
            openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "${name}.key" \
                -out "${name}.csr" 2>/dev/null
            if [[ -n "$sans" ]]; then
                printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" >"${name}.ext"
            else
                printf 'extendedKeyUsage=clientAuth\n' >"${name}.ext"
            fi
            openssl x509 -req -in "${name}.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
                -days 2 -extfile "${name}.ext" -out "${name}.crt" 2>/dev/null
            rm -f "${name}.csr" "${name}.ext"
        }
        sign apiserver kube-apiserver "" \
            "IP:127.0.0.1,IP:${CLUSTER_SERVICE_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
        sign admin admin system:masters
        sign apiserver-kubelet kube-apiserver-kubelet-client system:masters
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    )
}

write_kubeconfig() {
    local b64ca b64crt b64key
    b64ca="$(base64 -w0 "${CERTS}/ca.crt")"
    b64crt="$(base64 -w0 "${CERTS}/admin.crt")"
    b64key="$(base64 -w0 "${CERTS}/admin.key")"
    umask 077
    cat >"$KUBECONFIG_FILE" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: cubelet-test
  cluster:
    server: https://127.0.0.1:${CLUSTER_API_PORT}
    certificate-authority-data: ${b64ca}
users:
- name: admin
  user:
    client-certificate-data: ${b64crt}
    client-key-data: ${b64key}
contexts:
- name: cubelet-test
  context: {cluster: cubelet-test, user: admin}
current-context: cubelet-test
EOF
}

# spawn NAME CMD...: start CMD in the background with its own log and pid file.
spawn() {
    local name="$1"
    shift
    nohup "$@" >>"${CLUSTER_ROOT}/${name}.log" 2>&1 </dev/null &
    echo $! >"${CLUSTER_STATE}/${name}.pid"
}

# wait_for NAME SECONDS CMD...: wait until CMD succeeds, or fail with NAME's log.
wait_for() {
    local name="$1" secs="$2"
    shift 2
    for _ in $(seq 1 $((secs * 5))); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        if ! pid_alive "${CLUSTER_STATE}/${name}.pid"; then
            tail -n 30 "${CLUSTER_ROOT}/${name}.log" >&2
            die "${name} exited"
        fi
        sleep 0.2
    done
    tail -n 30 "${CLUSTER_ROOT}/${name}.log" >&2
    die "${name} not ready within ${secs} s"
}

api_ready() {
    curl -fsS --cacert "${CERTS}/ca.crt" --cert "${CERTS}/admin.crt" --key "${CERTS}/admin.key" \
        "https://127.0.0.1:${CLUSTER_API_PORT}/readyz"
}

running() {
    pid_alive "${CLUSTER_STATE}/kube-apiserver.pid" && api_ready
}

start() {
    need_bin openssl openssl
    need_bin curl curl
    resolve_bins || exit 3
    if running; then
        log "cluster already running at https://127.0.0.1:${CLUSTER_API_PORT}"
        return 0
    fi
    stop_all
    mkdir -p "$CLUSTER_ROOT" "$CLUSTER_STATE"
    make_certs
    write_kubeconfig
    local etcd_url="http://127.0.0.1:${CLUSTER_ETCD_PORT}"
    local peer_url="http://127.0.0.1:$((CLUSTER_ETCD_PORT + 1))"
    log "starting etcd (${ETCD}) on ${etcd_url}"
    if [[ "$(basename "$ETCD")" == etcd ]]; then
        spawn etcd "$ETCD" --data-dir "${CLUSTER_ROOT}/etcd" --name cubelet-test \
            --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
            --listen-peer-urls "$peer_url" --initial-advertise-peer-urls "$peer_url" \
            --initial-cluster "cubelet-test=${peer_url}" --log-level warn
    else
        spawn etcd "$ETCD" --data-dir "${CLUSTER_ROOT}/etcd" \
            --listen-client-urls "$etcd_url" --listen-peer-urls "$peer_url"
    fi
    wait_for etcd 30 curl -fsS "${etcd_url}/health"

    local token_args=()
    if [[ -n "$CLUSTER_TOKEN" ]]; then
        (umask 077; printf '%s,e2e-admin,e2e-admin,system:masters\n' "$CLUSTER_TOKEN" >"${CERTS}/tokens.csv")
        token_args=(--token-auth-file "${CERTS}/tokens.csv")
    fi
    log "starting kube-apiserver on https://127.0.0.1:${CLUSTER_API_PORT}"
    spawn kube-apiserver "$APISERVER" "${token_args[@]}" \
        --etcd-servers "$etcd_url" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
        --secure-port "$CLUSTER_API_PORT" \
        --tls-cert-file "${CERTS}/apiserver.crt" --tls-private-key-file "${CERTS}/apiserver.key" \
        --client-ca-file "${CERTS}/ca.crt" \
        --kubelet-client-certificate "${CERTS}/apiserver-kubelet.crt" \
        --kubelet-client-key "${CERTS}/apiserver-kubelet.key" \
        --kubelet-preferred-address-types "$CLUSTER_KUBELET_ADDRESS_TYPES" \
        --service-account-key-file "${CERTS}/sa.pub" \
        --service-account-signing-key-file "${CERTS}/sa.key" \
        --service-account-issuer https://kubernetes.default.svc \
        --service-cluster-ip-range "$CLUSTER_SERVICE_CIDR" \
        --authorization-mode Node,RBAC \
        --allow-privileged=true \
        --enable-priority-and-fairness=false \
        --profiling=false
    wait_for kube-apiserver 120 api_ready

    log "starting kube-controller-manager"
    spawn kube-controller-manager "$CM" \
        --kubeconfig "$KUBECONFIG_FILE" \
        --bind-address 127.0.0.1 --secure-port "$CLUSTER_CM_PORT" \
        --service-account-private-key-file "${CERTS}/sa.key" \
        --root-ca-file "${CERTS}/ca.crt" \
        --cluster-signing-cert-file "${CERTS}/ca.crt" \
        --cluster-signing-key-file "${CERTS}/ca.key" \
        --use-service-account-credentials=true \
        --service-cluster-ip-range "$CLUSTER_SERVICE_CIDR" \
        --leader-elect=false --profiling=false
    if [[ -n "$SCHED" ]]; then
        log "starting kube-scheduler"
        spawn kube-scheduler "$SCHED" \
            --kubeconfig "$KUBECONFIG_FILE" \
            --bind-address 127.0.0.1 --secure-port "$CLUSTER_SCHED_PORT" \
            --leader-elect=false --profiling=false
    fi
    wait_for kube-controller-manager 60 curl -fsSk "https://127.0.0.1:${CLUSTER_CM_PORT}/healthz"
    if [[ -n "$SCHED" ]]; then
        wait_for kube-scheduler 60 curl -fsSk "https://127.0.0.1:${CLUSTER_SCHED_PORT}/healthz"
    fi
    # The default service account is what pods need to be admitted.
    wait_for kube-controller-manager 60 default_sa
    log "cluster running at https://127.0.0.1:${CLUSTER_API_PORT}; KUBECONFIG=${KUBECONFIG_FILE}"
}

default_sa() {
    curl -fsS --cacert "${CERTS}/ca.crt" --cert "${CERTS}/admin.crt" --key "${CERTS}/admin.key" \
        "https://127.0.0.1:${CLUSTER_API_PORT}/api/v1/namespaces/default/serviceaccounts/default"
}

stop_all() {
    local name
    for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do
        if [[ -f "${CLUSTER_STATE}/${name}.pid" ]]; then
            stop_pidfile "$name" "${CLUSTER_STATE}/${name}.pid"
        fi
    done
}

stop() {
    stop_all
    rm -rf "$CLUSTER_ROOT" "$CLUSTER_STATE"
    log "cluster stopped and its files removed"
}

audit() {
    local left=0 port
    for port in "$CLUSTER_ETCD_PORT" "$((CLUSTER_ETCD_PORT + 1))" "$CLUSTER_API_PORT" \
        "$CLUSTER_CM_PORT" "$CLUSTER_SCHED_PORT"; do
        if ss -Hltn "sport = :${port}" | grep -q .; then
            log "leak: something listens on 127.0.0.1:${port}"
            left=1
        fi
    done
    if [[ -e "$CLUSTER_ROOT" || -e "$CLUSTER_STATE" ]]; then
        log "leak: ${CLUSTER_ROOT} or ${CLUSTER_STATE} remains"
        left=1
    fi
    return "$left"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    have) resolve_bins ;;
    status)
        if running; then
            log "cluster running at https://127.0.0.1:${CLUSTER_API_PORT}"
        else
            log "cluster not running"
            exit 1
        fi ;;
    env)
        echo "export KUBECONFIG=${KUBECONFIG_FILE}"
        echo "export CLUSTER_SERVER=https://127.0.0.1:${CLUSTER_API_PORT}"
        echo "export CLUSTER_CA=${CERTS}/ca.crt" ;;
    audit) audit ;;
    *) echo "usage: $0 start|stop|status|env|have|audit" >&2; exit 2 ;;
esac
