#!/bin/sh
# Cubelet uninstaller, run on every node by the pre-delete hook Jobs.
#
# Points kubelet back at its previous runtime (removes the drop-in), removes
# Cubelet's pods through Cubelet (their netns, mounts, cgroups and
# containers go with them), stops and disables the cubelet unit, removes
# what install.sh installed and, when asked, Cubelet's state.
#
# With kubelet on Cubelet this pod runs on Cubelet, and the work takes
# Cubelet away from under it. So the pod only checks and hands over: it
# waits until the node is drained (no pod other than a DaemonSet's, a
# static pod or these Jobs' on Cubelet: their containers would be removed
# with Cubelet), marks the chart's installer pods retired (install.sh reads
# /run/cubelet-uninstall/retired/<pod uid> and does not reinstall when
# kubelet starts it again on the previous runtime), copies this script to
# the host and runs it there as the transient unit cubelet-uninstall.service
# (`uninstall.sh host`), which does the work. Kubelet, back on its previous
# runtime, starts this Job's pod again there; that run waits for the unit
# to finish and exits with its result. Every step tolerates "already done".
#
# Environment (set by templates/uninstall-job.yaml): CUBELET_BIN_DIR,
# CUBELET_CONFIG_DIR, CUBELET_SYSTEMD_DIR, KUBELET_SERVICE, KUBELET_DROPIN,
# CUBELET_PURGE_STATE (true|false), CUBELET_ROOT_DIR, CUBELET_STATE_DIR,
# CUBELET_SOCKET, CUBELET_BRIDGE (empty unless network.provider is bridge),
# POD_NAMESPACE.
set -eu

WORK=/run/cubelet-uninstall
UNIT=cubelet-uninstall
CUBELET_ENDPOINT="unix://${CUBELET_SOCKET:-/run/cubelet/cubelet.sock}"
PREVIOUS_ENDPOINT="$CUBELET_CONFIG_DIR/kubelet-previous-endpoint"

log() { printf 'cubelet-uninstaller: %s\n' "$*"; }
# On the host (the unit) too: there it enters the namespaces it is in.
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

have_crictl() { on_host sh -c 'command -v crictl' >/dev/null 2>&1; }

# host: the work, on the host (cubelet-uninstall.service).
host() {
	if on_host test -e "$KUBELET_DROPIN"; then
		remove "$KUBELET_DROPIN"
		on_host systemctl daemon-reload
		log "restarting $KUBELET_SERVICE on its previous runtime"
		on_host systemctl restart "$KUBELET_SERVICE"
	fi
	if on_host systemctl is-active -q cubelet && have_crictl; then
		n=0
		for id in $(on_host crictl -r "$CUBELET_ENDPOINT" pods -q); do
			on_host crictl -r "$CUBELET_ENDPOINT" stopp "$id" >/dev/null || true
			on_host crictl -r "$CUBELET_ENDPOINT" rmp "$id" >/dev/null || true
			n=$((n + 1))
		done
		log "removed $n pod sandboxes from Cubelet"
	fi
	if on_host test -e "$CUBELET_SYSTEMD_DIR/cubelet.service"; then
		log "systemctl disable --now cubelet"
		on_host systemctl disable --now cubelet || true
	fi
	# Cubelet's namespace mount points (state_dir/netns, podns) outlive it.
	for m in $(on_host awk -v d="$CUBELET_STATE_DIR/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
		on_host umount "$m" && log "unmounted $m"
	done
	remove "$CUBELET_SYSTEMD_DIR/cubelet.service"
	on_host systemctl daemon-reload
	on_host systemctl reset-failed cubelet 2>/dev/null || true

	remove "$CUBELET_BIN_DIR/cubelet"
	remove "$CUBELET_BIN_DIR/cubelet-pause"
	remove "$CUBELET_CONFIG_DIR/config.yaml"
	remove "$PREVIOUS_ENDPOINT"
	remove "$CUBELET_CONFIG_DIR/restart-pending"
	on_host rmdir "$CUBELET_BIN_DIR" 2>/dev/null || true
	on_host rmdir "$CUBELET_CONFIG_DIR" 2>/dev/null || true
	# The DaemonSet's hostPath (DirectoryOrCreate) made the bin dir's parent
	# too when it is Cubelet's own (/opt/cubelet).
	case "$CUBELET_BIN_DIR" in */cubelet/*) on_host rmdir "${CUBELET_BIN_DIR%/*}" 2>/dev/null || true ;; esac
	# Cubelet's bridge (network.provider bridge) and its nftables table
	# (ip cubelet_<bridge, non-alphanumerics as _>) outlive it.
	if [ -n "${CUBELET_BRIDGE:-}" ]; then
		if on_host ip link show "$CUBELET_BRIDGE" >/dev/null 2>&1; then
			on_host ip link delete "$CUBELET_BRIDGE" && log "deleted bridge $CUBELET_BRIDGE"
		fi
		table="cubelet_$(printf '%s' "$CUBELET_BRIDGE" | tr -c 'A-Za-z0-9' '_')"
		if on_host nft list table ip "$table" >/dev/null 2>&1; then
			on_host nft delete table ip "$table" && log "deleted nftables table ip $table"
		fi
	fi

	if [ "$CUBELET_PURGE_STATE" = true ]; then
		purge "$CUBELET_ROOT_DIR"
		purge "$CUBELET_STATE_DIR"
	fi
	on_host touch "$WORK/done"
	log "done"
}

if [ "${1:-}" = host ]; then
	host
	exit 0
fi

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

# undrained: the pods of UNDRAINED_AWK on Cubelet.
undrained() {
	# A failed listing must not read as "no pods".
	json=$(on_host crictl -r "$CUBELET_ENDPOINT" pods --state ready -o json) || return 1
	printf '%s\n' "$json" | awk -v own="${POD_NAMESPACE:-}" "$UNDRAINED_AWK"
}

# wait_unit: wait for the host's unit and exit with its result.
wait_unit() {
	while on_host systemctl is-active -q "$UNIT"; do sleep 2; done
	if on_host test -e "$WORK/done"; then
		on_host journalctl -u "$UNIT" -o cat --no-pager 2>/dev/null | sed 's/^/host: /' || true
		on_host rm -rf "$WORK"
		log "done"
		exit 0
	fi
	on_host journalctl -u "$UNIT" -o cat --no-pager 2>/dev/null || true
	log "$UNIT.service failed"
	on_host systemctl reset-failed "$UNIT" 2>/dev/null || true
	on_host rm -f "$WORK/started"
	exit 1
}

# A previous run (this pod, before kubelet moved) started the unit.
if on_host test -e "$WORK/started"; then
	log "waiting for $UNIT.service on the host"
	wait_unit
fi

if on_host test -e "$KUBELET_DROPIN" && on_host systemctl is-active -q cubelet; then
	if ! have_crictl; then
		log "crictl is not on the host's PATH: cannot check that the node is drained (install cri-tools)"
		exit 1
	fi
	waited=60
	while :; do
		if ! busy=$(undrained); then
			log "could not list the pods on Cubelet; retrying"
			sleep 5
			continue
		fi
		busy=$(printf '%s' "$busy" | tr '\n' ' ')
		[ -z "$busy" ] && break
		if [ "$waited" -ge 60 ]; then
			log "not moving kubelet off Cubelet: pods other than DaemonSet and static pods run on it: ${busy}- drain the node first (kubectl drain <node> --ignore-daemonsets); waiting"
			waited=0
		fi
		sleep 5
		waited=$((waited + 5))
	done
	for uid in $(on_host crictl -r "$CUBELET_ENDPOINT" pods --label app.kubernetes.io/component=installer \
		${POD_NAMESPACE:+--namespace "$POD_NAMESPACE"} -o json | sed -n 's/^ *"uid": *"\([^"]*\)".*/\1/p'); do
		on_host mkdir -p "$WORK/retired/$uid"
		log "retired installer pod $uid"
	done
fi

on_host mkdir -p "$WORK"
on_host rm -f "$WORK/done"
on_host sh -c 'cat >"$1"' sh "$WORK/uninstall.sh" <"$0"
on_host touch "$WORK/started"
log "running the uninstall on the host as $UNIT.service"
on_host systemctl reset-failed "$UNIT" 2>/dev/null || true
on_host systemd-run --unit "$UNIT" --description "Cubelet uninstall (cubelet Helm chart)" \
	--setenv "CUBELET_BIN_DIR=$CUBELET_BIN_DIR" --setenv "CUBELET_CONFIG_DIR=$CUBELET_CONFIG_DIR" \
	--setenv "CUBELET_SYSTEMD_DIR=$CUBELET_SYSTEMD_DIR" --setenv "KUBELET_SERVICE=$KUBELET_SERVICE" \
	--setenv "KUBELET_DROPIN=$KUBELET_DROPIN" --setenv "CUBELET_PURGE_STATE=$CUBELET_PURGE_STATE" \
	--setenv "CUBELET_ROOT_DIR=$CUBELET_ROOT_DIR" --setenv "CUBELET_STATE_DIR=$CUBELET_STATE_DIR" \
	--setenv "CUBELET_SOCKET=${CUBELET_SOCKET:-/run/cubelet/cubelet.sock}" \
	--setenv "CUBELET_BRIDGE=${CUBELET_BRIDGE:-}" \
	--setenv "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
	/bin/sh "$WORK/uninstall.sh" host
wait_unit
