#!/bin/sh
# Cubelet uninstaller, run on every node by the pre-delete hook Jobs.
#
# Points kubelet back at its previous runtime (removes the drop-in), stops
# and disables the cubelet unit, removes what install.sh installed and, when
# asked, Cubelet's state. Every step tolerates "already done", so a re-run
# (e.g. after the kubelet restart re-created this pod) finishes the job.
# Containers started by Cubelet keep running (KillMode=process): drain the
# node first.
#
# Environment (set by templates/uninstall-job.yaml): CUBELET_BIN_DIR,
# CUBELET_CONFIG_DIR, CUBELET_SYSTEMD_DIR, KUBELET_SERVICE, KUBELET_DROPIN,
# CUBELET_PURGE_STATE (true|false), CUBELET_ROOT_DIR, CUBELET_STATE_DIR.
set -eu

log() { printf 'cubelet-uninstaller: %s\n' "$*"; }
on_host() { nsenter --target 1 --mount --uts --ipc --net --pid -- "$@"; }

remove() {
	if on_host test -e "$1"; then
		on_host rm -f "$1"
		log "removed $1"
	fi
}

# purge DIR: remove a state directory, refusing anything that is not a
# dedicated absolute path.
purge() {
	case "$1" in
	/ | /run | /var | /var/lib | /etc | /opt | "" | [!/]*)
		log "refusing to purge '$1'"
		return 1
		;;
	esac
	if on_host test -e "$1"; then
		on_host rm -rf --one-file-system "$1"
		log "purged $1"
	fi
}

if on_host test -e "$KUBELET_DROPIN"; then
	remove "$KUBELET_DROPIN"
	on_host systemctl daemon-reload
	log "restarting $KUBELET_SERVICE on its previous runtime"
	on_host systemctl restart "$KUBELET_SERVICE"
fi

if on_host test -e "$CUBELET_SYSTEMD_DIR/cubelet.service"; then
	log "systemctl disable --now cubelet"
	on_host systemctl disable --now cubelet || true
fi
remove "$CUBELET_SYSTEMD_DIR/cubelet.service"
on_host systemctl daemon-reload
on_host systemctl reset-failed cubelet 2>/dev/null || true

remove "$CUBELET_BIN_DIR/cubelet"
remove "$CUBELET_BIN_DIR/cubelet-pause"
remove "$CUBELET_CONFIG_DIR/config.yaml"
on_host rmdir "$CUBELET_BIN_DIR" "$CUBELET_CONFIG_DIR" 2>/dev/null || true

if [ "$CUBELET_PURGE_STATE" = true ]; then
	purge "$CUBELET_ROOT_DIR"
	purge "$CUBELET_STATE_DIR"
fi
log "done"
