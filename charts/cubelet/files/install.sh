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
set -eu

HOST_ROOT=${HOST_ROOT:-/host}
CONFIG_SRC=${CONFIG_SRC:-/scripts}

log() { printf 'cubelet-installer: %s\n' "$*"; }
on_host() { nsenter --target 1 --mount --uts --ipc --net --pid -- "$@"; }

changed=0
# install_file SRC HOST_PATH MODE: write only when the content differs. A
# rename replaces the file, so a running binary is never rewritten in place.
install_file() {
	dst="$HOST_ROOT$2"
	if [ -f "$dst" ] && cmp -s "$1" "$dst"; then
		log "unchanged $2"
		return 0
	fi
	mkdir -p "$(dirname "$dst")"
	cp "$1" "$dst.tmp.$$"
	chmod "$3" "$dst.tmp.$$"
	mv -f "$dst.tmp.$$" "$dst"
	log "installed $2"
	changed=1
}

ready() { wget -q -T 2 -O /dev/null "$CUBELET_READYZ_URL" 2>/dev/null; }

install_file "$CUBELET_IMAGE_BIN_DIR/cubelet" "$CUBELET_BIN_DIR/cubelet" 0755
install_file "$CUBELET_IMAGE_BIN_DIR/cubelet-pause" "$CUBELET_BIN_DIR/cubelet-pause" 0755
install_file "$CONFIG_SRC/config.yaml" "$CUBELET_CONFIG_DIR/config.yaml" 0644
install_file "$CONFIG_SRC/cubelet.service" "$CUBELET_SYSTEMD_DIR/cubelet.service" 0644

log "systemctl daemon-reload on the host"
on_host systemctl daemon-reload
if [ "$changed" = 1 ]; then
	log "systemctl enable cubelet && systemctl restart cubelet"
	on_host systemctl enable cubelet
	on_host systemctl restart cubelet
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
	install_file "$CONFIG_SRC/kubelet-runtime.conf" "$KUBELET_DROPIN" 0644
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
trap 'exit 0' TERM INT
while :; do
	sleep 3600 &
	wait $! || true
done
