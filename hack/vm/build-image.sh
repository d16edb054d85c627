#!/usr/bin/env bash
# Build the Cubelet test guest image from Debian packages only: debootstrap
# bookworm (minbase) with systemd as PID 1, the guest's own kernel, containerd
# + runc (systemd cgroups), sshd, the test registry's and images' tools, and
# the files in hack/vm/guest/. The result is cached under
# ${CUBELET_VM_CACHE}/<recipe hash>/ (rootfs.img, vmlinuz, initrd.img): the
# hash covers this script, hack/vm/guest/ and hack/cubelet.service, so
# editing any of them rebuilds.
#
# Usage: hack/vm/build-image.sh          prints the image directory
#        hack/vm/build-image.sh --hash   prints the recipe hash only
# Env: CUBELET_VM_CACHE (default /var/cache/cubelet-vm), CUBELET_VM_MIRROR
#      (default http://deb.debian.org/debian), CUBELET_VM_DISK (image size,
#      default 6G, sparse)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

VM_DIR="${HACK_DIR}/vm"
CACHE="${CUBELET_VM_CACHE:-/var/cache/cubelet-vm}"
MIRROR="${CUBELET_VM_MIRROR:-http://deb.debian.org/debian}"
DISK="${CUBELET_VM_DISK:-6G}"
SUITE=bookworm

# What the guest runs: systemd (PID 1, udev for the virtio modules, dbus for
# runc's and Cubelet's systemd cgroup driver), its kernel, containerd and
# runc, sshd, and what hack/registry.sh, hack/test-images.sh, the daemon and
# the e2e tests call (docs/guest.md).
PACKAGES=(
    systemd systemd-sysv udev dbus kmod linux-image-amd64
    containerd runc containernetworking-plugins
    openssh-server
    docker-registry busybox-static curl python3 ca-certificates
    iproute2 nftables iptables procps util-linux e2fsprogs mount openssl
)

recipe_hash() {
    (
        cd "$VM_DIR"
        printf '%s\n' "$SUITE" "$DISK" "${PACKAGES[*]}"
        cat build-image.sh
        find guest -type f | LC_ALL=C sort | xargs sha256sum
        sha256sum ../cubelet.service
    ) | sha256sum | cut -c1-16
}

key="$(recipe_hash)"
if [[ "${1:-}" == --hash ]]; then
    echo "$key"
    exit 0
fi
out="${CACHE}/${key}"
if [[ -f "${out}/rootfs.img" && -f "${out}/vmlinuz" && -f "${out}/initrd.img" ]]; then
    log "guest image ${key} cached in ${out}"
    echo "$out"
    exit 0
fi

need_bin debootstrap debootstrap
need_bin mkfs.ext4 e2fsprogs
mkdir -p "$CACHE/debs"
work="$(mktemp -d "${CACHE}/build.XXXXXX")"
cleanup() {
    local rc=$?
    # Nothing is mounted in the tree (no chroot mounts are needed below), so
    # a plain rm is safe.
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
root="${work}/root"

log "debootstrap ${SUITE} (minbase + ${#PACKAGES[@]} packages) from ${MIRROR} into ${root}"
pkgs="$(IFS=,; echo "${PACKAGES[*]}")"
if ! debootstrap --variant=minbase --include="$pkgs" --cache-dir="${CACHE}/debs" \
    "$SUITE" "$root" "$MIRROR" >"${work}/debootstrap.log" 2>&1; then
    tail -n 30 "${work}/debootstrap.log" >&2
    [[ -f "${root}/debootstrap/debootstrap.log" ]] && tail -n 30 "${root}/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
fi

log "configuring the guest"
g="${VM_DIR}/guest"
echo cubelet-vm >"${root}/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 cubelet-vm\n::1 localhost ip6-localhost ip6-loopback\n' >"${root}/etc/hosts"
install -m 0644 "${g}/fstab" "${root}/etc/fstab"
mkdir -p "${root}/mnt/vmctl"
install -D -m 0644 "${g}/10-vm.network" "${root}/etc/systemd/network/10-vm.network"
install -D -m 0644 "${g}/sshd-vm.conf" "${root}/etc/ssh/sshd_config.d/cubelet-vm.conf"
install -D -m 0644 "${g}/ssh-vmctl.conf" "${root}/etc/systemd/system/ssh.service.d/cubelet-vm.conf"
install -D -m 0644 "${g}/containerd-config.toml" "${root}/etc/containerd/config.toml"
install -D -m 0644 "${g}/registry-hosts.toml" "${root}/etc/containerd/certs.d/127.0.0.1:5000/hosts.toml"
install -D -m 0644 "${g}/registry-hosts.toml" "${root}/etc/cubelet/certs.d/127.0.0.1:5000/hosts.toml"
install -D -m 0644 "${g}/cubelet-config.yaml" "${root}/etc/cubelet/config.yaml"
install -D -m 0644 "${HACK_DIR}/cubelet.service" "${root}/etc/systemd/system/cubelet.service"
mkdir -p "${root}/opt/cubelet/bin"
# The e2e harness passes containerd.root = /var/lib/cubelet-test/containerd
# (hack/containerd.sh's private root on a development host); in the guest
# containerd is the node's own, at Debian's default root.
mkdir -p "${root}/var/lib/cubelet-test"
ln -s /var/lib/containerd "${root}/var/lib/cubelet-test/containerd"
# Root logs in on the serial console without a password (to inspect a
# hung guest); ssh takes keys only.
chroot "$root" passwd -d root >/dev/null
# On: the network (for ssh), sshd, containerd. Off: Debian's registry unit
# (hack/registry.sh runs its own on 127.0.0.1:5000) and periodic jobs that
# would only take the guest's CPU during a test.
chroot "$root" systemctl enable systemd-networkd.service ssh.service containerd.service >/dev/null 2>&1
chroot "$root" systemctl disable docker-registry.service >/dev/null 2>&1 || true
for unit in docker-registry.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer \
    e2scrub_reap.service fstrim.timer dpkg-db-backup.timer systemd-networkd-wait-online.service; do
    ln -sf /dev/null "${root}/etc/systemd/system/${unit}"
done
rm -f "${root}"/etc/ssh/ssh_host_*
# Host keys are made once here (they are thrown away with the run's
# snapshot anyway); the host does not check them (a per-run known_hosts).
chroot "$root" ssh-keygen -A >/dev/null
rm -rf "${root}/var/cache/apt/archives/"*.deb "${root}/var/lib/apt/lists/"*

log "kernel and initrd"
vmlinuz="$(find "${root}/boot" -name 'vmlinuz-*' | sort | tail -n 1)"
initrd="$(find "${root}/boot" -name 'initrd.img-*' | sort | tail -n 1)"
[[ -n "$vmlinuz" && -n "$initrd" ]] || die "no kernel or initrd in ${root}/boot"
install -m 0644 "$vmlinuz" "${work}/vmlinuz"
install -m 0644 "$initrd" "${work}/initrd.img"

log "ext4 image (${DISK}, sparse)"
mkfs.ext4 -q -F -L cubelet-vm -d "$root" "${work}/rootfs.img" "$DISK" >&2
rm -rf "$root"
{
    echo "suite=${SUITE}"
    echo "kernel=$(basename "$vmlinuz")"
    echo "packages=${PACKAGES[*]}"
    echo "built=$(date -u +%FT%TZ)"
} >"${work}/image.info"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
# Older recipes' images are dead weight.
find "$CACHE" -mindepth 1 -maxdepth 1 -type d -not -name debs -not -name "$key" \
    -not -name 'build.*' -exec rm -rf {} +
log "guest image ${key} built in ${out}"
echo "$out"
