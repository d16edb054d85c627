#!/usr/bin/env bash
# Undoes hack/up.sh: stops the Cubelet it runs, removes what that Cubelet
# made (`cubelet uninstall`: its containerd namespace and objects, mounts,
# bridge, nft table, /var/lib/cubelet, /run/cubelet), stops the containerd
# and registry up.sh started (if it started them) and removes the files and
# directories up.sh wrote (/etc/crictl.yaml only if up.sh wrote it and it is
# unchanged). Debian packages up.sh installed are named, not removed.
# Idempotent: a second run finds nothing to do.
#
# Usage: hack/down.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

[[ $EUID -eq 0 ]] || die "run as root"
UP_STATE="${UP_STATE:-/run/cubelet-up}"
if [[ ! -d "$UP_STATE" ]]; then
    log "nothing to do: no $UP_STATE (hack/up.sh has not run, or down.sh already did)"
    exit 0
fi
made() { grep -E "^$1( |$)" "$UP_STATE/made" 2>/dev/null || true; }

stop_pidfile cubelet "$UP_STATE/cubelet.pid"

# With containerd still up: Cubelet's containerd objects go first.
bin="$UP_STATE/bin/cubelet"
[[ -x "$bin" ]] || bin="$REPO_ROOT/target/release/cubelet"
if [[ -x "$bin" ]]; then
    "$bin" uninstall --config "$UP_STATE/config.yaml" || die "cubelet uninstall failed (see above); re-run hack/down.sh"
else
    log "no cubelet binary to run 'cubelet uninstall' with"
fi

if [[ -n "$(made registry)" ]]; then
    "$HACK_DIR/registry.sh" stop
fi
if [[ -n "$(made containerd)" ]]; then
    stop_pidfile containerd "$UP_STATE/containerd.pid"
    # containerd's root, when up.sh's containerd created it.
    for dir in $(made dir | cut -d' ' -f2); do
        case "$dir" in
        /var/lib/containerd)
            if awk '{print $5}' /proc/self/mountinfo | grep -q "^${dir}/"; then
                log "keeping $dir: something is still mounted under it"
            else
                rm -rf --one-file-system "$dir"
                log "removed $dir"
            fi
            ;;
        esac
    done
fi

if line="$(made crictl)" && [[ -n "$line" ]] && [[ -f /etc/crictl.yaml ]]; then
    if [[ "$(sha256sum /etc/crictl.yaml | cut -d' ' -f1)" == "$(cut -d' ' -f2 <<<"$line")" ]]; then
        rm -f /etc/crictl.yaml
        log "removed /etc/crictl.yaml"
    else
        log "keeping /etc/crictl.yaml: changed since hack/up.sh wrote it"
    fi
fi

if pkgs="$(made package | cut -d' ' -f2-)" && [[ -n "$pkgs" ]]; then
    log "hack/up.sh installed these Debian packages; they stay: ${pkgs//$'\n'/ } (apt purge them if unwanted)"
fi
rm -rf "$UP_STATE"
log "down: host as before hack/up.sh"
