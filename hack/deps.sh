#!/usr/bin/env bash
# Installs what Cubelet and its test suite need: Debian packages (apt-get
# skips what is already installed), cargo-deny and cargo-deb. Idempotent.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PACKAGES=(
    containerd runc protobuf-compiler docker-registry busybox-static
    containernetworking-plugins prometheus iproute2 nftables iptables
    e2fsprogs util-linux mount curl ca-certificates file procps openssl
    python3 python3-yaml python3-jsonschema fonts-dejavu-core
    qemu-system-x86 debootstrap openssh-client etcd-server
)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    log "all packages present"
fi

# cargo-deny, for hack/test.sh's license, ban and source checks (deny.toml),
# from crates.io. The version is pinned so every machine applies the same
# rules; it is built without LTO, which saves most of the install time (the
# crate's release profile asks for fat LTO and one codegen unit).
CARGO_DENY_VERSION=0.20.2
if [[ "$(cargo deny --version 2>/dev/null)" == "cargo-deny $CARGO_DENY_VERSION" ]]; then
    log "cargo-deny $CARGO_DENY_VERSION present"
else
    log "installing cargo-deny $CARGO_DENY_VERSION (cargo install --locked)"
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        cargo install --locked --version "$CARGO_DENY_VERSION" cargo-deny
fi

# cargo-deb, for hack/test-package.sh's Debian package, from crates.io;
# pinned and built without LTO for the same reasons.
CARGO_DEB_VERSION=3.8.0
if [[ "$(cargo deb --version 2>/dev/null)" == *"$CARGO_DEB_VERSION"* ]]; then
    log "cargo-deb $CARGO_DEB_VERSION present"
else
    log "installing cargo-deb $CARGO_DEB_VERSION (cargo install --locked)"
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        cargo install --locked --version "$CARGO_DEB_VERSION" cargo-deb
fi
