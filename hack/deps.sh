#!/usr/bin/env bash
# Installs the Debian packages Cubelet and its test suite need. Idempotent:
# apt-get skips what is already installed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PACKAGES=(
    containerd runc protobuf-compiler docker-registry busybox-static
    containernetworking-plugins prometheus iproute2 nftables iptables
    e2fsprogs util-linux mount curl ca-certificates file procps openssl
    python3 python3-yaml python3-jsonschema
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
