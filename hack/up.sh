#!/usr/bin/env bash
# Builds Cubelet from this checkout and runs it in the foreground, serving CRI
# on /run/cubelet/cubelet.sock, against the host's containerd
# (/run/containerd/containerd.sock; started by hand if it is not running).
# Nothing else: no test tools, no registry, no enabled units, no file
# overwritten. hack/down.sh undoes everything it made.
#
# What it makes, each recorded in $UP_STATE (/run/cubelet-up) for down.sh:
#   $UP_STATE/{config.yaml,certs.d,bin/cubelet,bin/cubelet-pause}  its own config and binaries
#   /etc/crictl.yaml                 only if absent (pointing crictl at Cubelet)
#   a containerd process             only if none answers on the default socket
#   Debian packages it needs         only missing ones (containerd runc nftables
#                                    iproute2 protobuf-compiler); kept by down.sh
# and, while Cubelet runs, what Cubelet makes: /var/lib/cubelet, /run/cubelet,
# bridge cubelet0, nft table ip cubelet_cubelet0, mounts under /run/cubelet and
# its containerd namespace k8s.cubelet.io.
#
# Usage: hack/up.sh [--test-images]
#   --test-images  also start the private test registry on 127.0.0.1:5000 with
#                  the test images that examples/ uses (needs the test tools of
#                  hack/deps.sh: docker-registry, busybox-static); down.sh stops it.
# Ctrl-C stops Cubelet (containers keep running); hack/down.sh removes the rest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

test_images=false
for arg in "$@"; do
    case "$arg" in
    --test-images) test_images=true ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
    esac
done

[[ $EUID -eq 0 ]] || die "run as root: Cubelet makes namespaces, mounts and a bridge"
UP_STATE="${UP_STATE:-/run/cubelet-up}"
HOST_CONTAINERD="/run/containerd/containerd.sock"
SOCKET="/run/cubelet/cubelet.sock"

# Another Cubelet (the Debian package, a previous up.sh still running) owns
# the same socket, state and bridge: say so rather than fight over them.
if [[ -S "$SOCKET" ]] && python3 -c "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])" "$SOCKET" 2>/dev/null; then
    die "a Cubelet already serves $SOCKET (systemctl stop cubelet, or hack/down.sh)"
fi
if [[ ! -d "$UP_STATE" ]] && [[ -e /var/lib/cubelet || -e /run/cubelet ]]; then
    die "/var/lib/cubelet or /run/cubelet exists and is not hack/up.sh's: another Cubelet's state (the package? 'apt purge cubelet' or 'cubelet uninstall' removes it)"
fi
mkdir -p "$UP_STATE/bin"
record() { printf '%s\n' "$*" >>"$UP_STATE/made"; }

# Rust: the workspace's rust-version, through rustup (Debian's is too old).
want_rust="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)"
command -v cargo >/dev/null 2>&1 || die "no cargo: install Rust >= ${want_rust} with rustup (https://rustup.rs); Debian 12's rustc is 1.63"
have_rust="$(rustc --version | awk '{print $2}')"
if [[ "$(printf '%s\n%s\n' "$want_rust" "$have_rust" | sort -V | head -n1)" != "$want_rust" ]]; then
    die "rustc ${have_rust} is older than the workspace's rust-version ${want_rust}: rustup update"
fi

# The packages Cubelet needs to build and run; only missing ones are
# installed (and recorded; down.sh names them but does not remove them).
missing=()
for p in containerd runc nftables iproute2 protobuf-compiler; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    record "package ${missing[*]}"
fi

log "building cubelet (release; a first build takes about 15 minutes on 2 cores)"
cargo build --release -p cubelet
PAUSE_BIN="$REPO_ROOT/target/cubelet-pause" "$HACK_DIR/build-pause.sh" >/dev/null
# Copies, so a rebuild in the checkout does not change a running agent.
install -m 0755 target/release/cubelet "$UP_STATE/bin/cubelet"
install -m 0755 target/cubelet-pause "$UP_STATE/bin/cubelet-pause"

# The host's containerd, or one started by hand with Debian's configuration
# where it is not running (no systemd here, or the unit is stopped).
if ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1; then
    log "using the running containerd at $HOST_CONTAINERD"
else
    # Its root, if this makes it, goes in down.sh; /run/containerd is shared
    # (containerd 1.6 keeps every instance's shim sockets there) and stays.
    [[ -e /var/lib/containerd ]] || record "dir /var/lib/containerd"
    log "starting containerd by hand (log: $UP_STATE/containerd.log)"
    setsid containerd >"$UP_STATE/containerd.log" 2>&1 </dev/null &
    echo $! >"$UP_STATE/containerd.pid"
    record "containerd $UP_STATE/containerd.pid"
    for _ in $(seq 1 100); do
        ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1 && break
        sleep 0.1
    done
    ctr --address "$HOST_CONTAINERD" version >/dev/null 2>&1 \
        || die "containerd did not answer on $HOST_CONTAINERD (see $UP_STATE/containerd.log)"
fi

if $test_images; then
    if curl -fsS -o /dev/null "http://${REGISTRY_ADDR}/v2/" 2>/dev/null; then
        log "registry already answering at ${REGISTRY_ADDR}"
    else
        "$HACK_DIR/registry.sh" start
        record "registry"
    fi
    "$HACK_DIR/test-images.sh"
fi

# Cubelet's configuration: up.sh's own file; /etc/cubelet is not touched.
mkdir -p "$UP_STATE/certs.d/${REGISTRY_ADDR}"
cat >"$UP_STATE/certs.d/${REGISTRY_ADDR}/hosts.toml" <<TOML
server = "http://${REGISTRY_ADDR}"
[host."http://${REGISTRY_ADDR}"]
  capabilities = ["pull", "resolve"]
TOML
cat >"$UP_STATE/config.yaml" <<YAML
# Written by hack/up.sh; every other key is the default (docs/configuration.md).
socket: ${SOCKET}
containerd:
  address: ${HOST_CONTAINERD}
images:
  registry_config_dir: ${UP_STATE}/certs.d
YAML
mkdir -p "$UP_STATE/config.d"

if [[ ! -e /etc/crictl.yaml ]]; then
    cat >/etc/crictl.yaml <<YAML
# Written by Cubelet's hack/up.sh; hack/down.sh removes it.
runtime-endpoint: unix://${SOCKET}
image-endpoint: unix://${SOCKET}
timeout: 30
YAML
    record "crictl $(sha256sum /etc/crictl.yaml | cut -d' ' -f1)"
else
    log "keeping the existing /etc/crictl.yaml (crictl --runtime-endpoint unix://${SOCKET} if it points elsewhere)"
fi
command -v crictl >/dev/null 2>&1 || log "no crictl on PATH (Debian does not package it): see docs/clients.md"

log "starting cubelet: CRI on ${SOCKET}, metrics on http://127.0.0.1:9385/metrics; Ctrl-C stops it, hack/down.sh removes everything"
echo $$ >"$UP_STATE/cubelet.pid"
exec "$UP_STATE/bin/cubelet" --config "$UP_STATE/config.yaml"
