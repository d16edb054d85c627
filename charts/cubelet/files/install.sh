#!/bin/sh
# Cubelet installer, run by the cubelet DaemonSet on every node.
#
# Copies cubelet and cubelet-pause from this image to the host, writes the
# config and the systemd unit, (re)starts the unit in the host's namespaces,
# waits for /readyz, optionally points kubelet at Cubelet, then sleeps.
# Idempotent: files are replaced only when their content changed, and the
# unit is restarted only then (KillMode=process: containers keep running).
#
# Environment (set by templates/daemonset.yaml):
#   HOST_ROOT              where the host paths below are mounted (/host)
#   CUBELET_IMAGE_BIN_DIR  directory of cubelet and cubelet-pause in this image
#   CUBELET_BIN_DIR, CUBELET_CONFIG_DIR, CUBELET_SYSTEMD_DIR   host paths
#   CUBELET_READYZ_URL, CUBELET_READY_TIMEOUT
#   KUBELET_SWITCH_RUNTIME (true|false), KUBELET_SERVICE, KUBELET_DROPIN
#   CUBELET_SOCKET (config.socket), POD_UID, POD_NAMESPACE (downward API)
#
# The runtime switch (kubelet.switchRuntime=true) needs a drained node:
# kubelet restarted onto another runtime no longer sees the pods of the old
# one and starts them again, while the old copies keep running (twice the
# memory, hostPort clashes, two writers on a volume). So before it writes
# the drop-in, the installer lists the pod sandboxes on kubelet's current
# runtime (crictl on the host, as kubeadm's cri-tools install it) and, while
# any pod other than a DaemonSet's or a static pod runs there, it does not
# switch: it logs which pods and "drain the node first" every minute and
# keeps waiting (Cubelet itself is installed and running meanwhile). Once
# kubelet is on Cubelet, the installer pod kubelet starts there removes the
# sandboxes kubelet left on the previous runtime: the DaemonSet and static
# pods' old copies, which kubelet has just started again on Cubelet.
set -eu

HOST_ROOT=${HOST_ROOT:-/host}
CONFIG_SRC=${CONFIG_SRC:-/scripts}

log() { printf 'cubelet-installer: %s\n' "$*"; }
on_host() { nsenter --target 1 --mount --uts --ipc --net --pid -- "$@"; }

# restart-pending (host, in the config dir) is written before the first
# file changes and removed once cubelet has restarted onto them: an
# installer killed in between (files new, unit not restarted) leaves it,
# and the next one restarts the unit although every file is unchanged.
PENDING="$HOST_ROOT$CUBELET_CONFIG_DIR/restart-pending"
changed=0
if [ -e "$PENDING" ]; then
	log "an earlier installer stopped before restarting cubelet: restarting it"
	changed=1
fi
# install_file SRC HOST_PATH MODE: write only when the content differs. A
# rename replaces the file, so a running binary is never rewritten in place.
install_file() {
	dst="$HOST_ROOT$2"
	if [ -f "$dst" ] && cmp -s "$1" "$dst"; then
		log "unchanged $2"
		return 0
	fi
	if [ "${marking:-}" = 1 ] && [ ! -e "$PENDING" ]; then
		mkdir -p "$(dirname "$PENDING")"
		: >"$PENDING"
	fi
	mkdir -p "$(dirname "$dst")"
	cp "$1" "$dst.tmp.$$"
	chmod "$3" "$dst.tmp.$$"
	mv -f "$dst.tmp.$$" "$dst"
	log "installed $2"
	changed=1
}

# Not wget -T: Debian's static busybox 1.35 dies of SIGSEGV on it.
ready() { timeout 2 wget -q -O /dev/null "$CUBELET_READYZ_URL" 2>/dev/null; }

sleep_forever() {
	trap 'exit 0' TERM INT
	while :; do
		sleep 3600 &
		wait $! || true
	done
}

# Written on the host by uninstall.sh: the installer pods helm uninstall
# retired. Such a pod, started again by kubelet on the previous runtime
# once uninstall.sh has switched kubelet back, must not install Cubelet
# again while helm waits to delete the DaemonSet.
RETIRED_DIR=/run/cubelet-uninstall/retired
PREVIOUS_ENDPOINT="$CUBELET_CONFIG_DIR/kubelet-previous-endpoint"
CUBELET_ENDPOINT="unix://${CUBELET_SOCKET:-/run/cubelet/cubelet.sock}"

if [ -n "${POD_UID:-}" ] && on_host test -e "$RETIRED_DIR/$POD_UID"; then
	log "helm uninstall retired this installer pod ($POD_UID): not installing; sleeping until it is deleted"
	sleep_forever
fi

# kubelet_endpoint: the runtime endpoint of the running kubelet (its last
# --container-runtime-endpoint; kubelet's default without one).
kubelet_endpoint() {
	ep=""
	for pid in $(pidof kubelet); do
		ep=$(tr '\0' '\n' <"/proc/$pid/cmdline" | sed -n 's/^--container-runtime-endpoint=//p' | tail -n 1)
	done
	case "$ep" in
	"") echo unix:///run/containerd/containerd.sock ;;
	/*) echo "unix://$ep" ;;
	*) echo "$ep" ;;
	esac
}

# undrained_awk: reads `crictl pods -o json`; prints "namespace/name" of each
# sandbox that is neither a DaemonSet's (label pod-template-generation) nor
# a static pod (annotation kubernetes.io/config.source=file) nor one of this
# chart's uninstall Job pods in namespace `own`. One crictl call: each one
# costs seconds on a busy node.
UNDRAINED_AWK='
function val(s) { s = $0; sub(/^[^:]*:[ ]*/, "", s); gsub(/[",]/, "", s); return s }
function flush() { if (id != "" && !ds && !static && !(job && ns == own)) print ns "/" name; id = "" }
block == "" && /"id":/ { flush(); id = val(); ns = ""; name = ""; ds = 0; static = 0; job = 0; next }
/"(metadata|labels|annotations)": *\{/ { block = $0; next }
block != "" && /^[ ]*}/ { block = ""; next }
block ~ /metadata/ && /"name":/ { name = val() }
block ~ /metadata/ && /"namespace":/ { ns = val() }
block ~ /labels/ && /"pod-template-generation":/ { ds = 1 }
block ~ /labels/ && /"app.kubernetes.io\/component": *"uninstall"/ { job = 1 }
block ~ /annotations/ && /"kubernetes.io\/config.source": *"file"/ { static = 1 }
END { flush() }'

# undrained ENDPOINT: the pods of UNDRAINED_AWK on that runtime.
undrained() {
	# A failed listing must not read as "no pods".
	json=$(on_host crictl -r "$1" pods --state ready -o json) || return 1
	printf '%s\n' "$json" | awk -v own="${POD_NAMESPACE:-}" "$UNDRAINED_AWK"
}

# wait_drained ENDPOINT: return once undrained ENDPOINT is empty.
wait_drained() {
	if ! on_host sh -c 'command -v crictl' >/dev/null 2>&1; then
		log "crictl is not on the host's PATH: cannot check that the node is drained (install cri-tools)"
		return 1
	fi
	waited=60
	while :; do
		if ! busy=$(undrained "$1"); then
			log "could not list the pods on $1; retrying"
			sleep 5
			continue
		fi
		busy=$(printf '%s' "$busy" | tr '\n' ' ')
		[ -z "$busy" ] && return 0
		if [ "$waited" -ge 60 ]; then
			log "not switching kubelet from $1 to $CUBELET_ENDPOINT: pods other than DaemonSet and static pods run there: ${busy}- drain the node first (kubectl drain <node> --ignore-daemonsets); waiting"
			waited=0
		fi
		sleep 5
		waited=$((waited + 5))
	done
}

# remove_sandboxes ENDPOINT: stop and remove every pod sandbox there.
remove_sandboxes() {
	n=0
	for id in $(on_host crictl -r "$1" pods -q); do
		on_host crictl -r "$1" stopp "$id" >/dev/null || true
		on_host crictl -r "$1" rmp "$id" >/dev/null || true
		n=$((n + 1))
	done
	[ "$n" = 0 ] || log "removed $n pod sandboxes kubelet left on $1"
}

marking=1
install_file "$CUBELET_IMAGE_BIN_DIR/cubelet" "$CUBELET_BIN_DIR/cubelet" 0755
install_file "$CUBELET_IMAGE_BIN_DIR/cubelet-pause" "$CUBELET_BIN_DIR/cubelet-pause" 0755
install_file "$CONFIG_SRC/config.yaml" "$CUBELET_CONFIG_DIR/config.yaml" 0644
install_file "$CONFIG_SRC/cubelet.service" "$CUBELET_SYSTEMD_DIR/cubelet.service" 0644
marking=0

log "systemctl daemon-reload on the host"
on_host systemctl daemon-reload
if [ "$changed" = 1 ]; then
	log "systemctl enable cubelet && systemctl restart cubelet"
	on_host systemctl enable cubelet
	on_host systemctl restart cubelet
	rm -f "$PENDING"
else
	log "systemctl enable --now cubelet"
	on_host systemctl enable --now cubelet
fi

log "waiting up to ${CUBELET_READY_TIMEOUT}s for $CUBELET_READYZ_URL"
waited=0
until ready; do
	if [ "$waited" -ge "$CUBELET_READY_TIMEOUT" ]; then
		log "cubelet not ready after ${waited}s"
		on_host systemctl status cubelet --no-pager || true
		on_host journalctl -u cubelet -n 50 --no-pager || true
		exit 1
	fi
	sleep 2
	waited=$((waited + 2))
done
log "cubelet is ready"

# kubelet runtime switch. Restarting kubelet onto another runtime hides this
# pod from it: kubelet starts a fresh installer pod under the new runtime,
# which finds everything in place; this one exits.
changed=0
if [ "$KUBELET_SWITCH_RUNTIME" = true ]; then
	current=$(kubelet_endpoint)
	if [ "$current" != "$CUBELET_ENDPOINT" ]; then
		wait_drained "$current"
		printf '%s\n' "$current" >"$HOST_ROOT$PREVIOUS_ENDPOINT"
	fi
	install_file "$CONFIG_SRC/kubelet-runtime.conf" "$KUBELET_DROPIN" 0644
	if [ "$changed" = 0 ] && [ "$current" != "$CUBELET_ENDPOINT" ]; then
		# The drop-in is in place but kubelet runs the old command line:
		# restart it (e.g. an installer killed between the two).
		changed=1
	fi
	if [ "$changed" = 0 ] && [ -f "$HOST_ROOT$PREVIOUS_ENDPOINT" ]; then
		remove_sandboxes "$(cat "$HOST_ROOT$PREVIOUS_ENDPOINT")"
	fi
elif [ -f "$HOST_ROOT$KUBELET_DROPIN" ]; then
	rm -f "$HOST_ROOT$KUBELET_DROPIN"
	log "removed $KUBELET_DROPIN"
	changed=1
fi
if [ "$changed" = 1 ]; then
	log "restarting $KUBELET_SERVICE with its new runtime endpoint"
	on_host systemctl daemon-reload
	on_host systemctl restart "$KUBELET_SERVICE"
	log "kubelet restarted; this pod exits and is re-created under the new runtime"
	exit 0
fi

log "installed; sleeping"
sleep_forever
