#!/usr/bin/env bash
# A Debian 12 test node under qemu for Cubelet: systemd as PID 1, a pure
# cgroup v2 hierarchy, Debian's containerd with runc's systemd cgroups, and
# Cubelet as hack/cubelet.service with the systemd cgroup driver. The guest
# has no route out (qemu user networking with restrict=on): the host reaches
# it by ssh on a forwarded loopback port, with a key made for the run. See
# docs/guest.md.
#
# Usage:
#   hack/vm.sh build            build (or reuse) the cached guest image
#   hack/vm.sh boot             boot it; the repository is shared read-only at
#                               its own path, the staged binaries at /mnt/bin
#   hack/vm.sh run CMD...       run CMD in the booted guest (as root, by ssh)
#   hack/vm.sh ssh              interactive shell in the booted guest
#   hack/vm.sh reboot           reboot the guest (its disk survives) and wait
#                               for ssh; the shares are mounted again
#   hack/vm.sh stop [DIR]       save the guest's journal and console log to
#                               DIR (if given), power it off, remove the state
#   hack/vm.sh test             build-or-reuse, boot, run hack/vm/guest-test.sh
#                               inside, stop; logs kept under
#                               ${CUBELET_VM_OUT} when anything fails
#   hack/vm.sh helm             the chart end to end on a one-node cluster
#                               (hack/vm/helm-test.sh, docs/guest.md)
#
# Env: CUBELET_VM_STATE (run state, default /var/tmp/cubelet-vm)
#      CUBELET_VM_OUT (logs of a failed test, default target/vm-out)
#      CUBELET_VM_ACCEL (tcg or kvm, default tcg) CUBELET_VM_SMP (2)
#      CUBELET_VM_NET_EXTRA (more -netdev user options)
#      CUBELET_VM_MEM (MiB, 2048) CUBELET_VM_BOOT_TIMEOUT (s, 300)
#      CUBELET_VM_TEST_TIMEOUT (s, whole guest test, 3600)
#      CUBELET_BIN CUBELET_PAUSE_BIN (binaries staged into the guest; default
#      target/debug/cubelet, target/cubelet-pause)
#      CUBELET_KUBELET_BIN or KUBELET_BIN (kubelet for e2e/tests/kubelet.rs;
#      default kubelet-v1.28.7 on PATH; the suite is skipped without one)
#      CRICTL_BIN (default crictl on PATH; staged if found)
#      CUBELET_VM_E2E (e2e test binaries to run inside, see guest-test.sh)
#      CUBELET_VM_E2E_DIR (a directory of e2e test binaries by name, instead
#      of asking cargo for them)
#      and hack/vm/build-image.sh's CUBELET_VM_CACHE CUBELET_VM_MIRROR
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

STATE="${CUBELET_VM_STATE:-/var/tmp/cubelet-vm}"
OUT="${CUBELET_VM_OUT:-${REPO_ROOT}/target/vm-out}"
ACCEL="${CUBELET_VM_ACCEL:-tcg}"
SMP="${CUBELET_VM_SMP:-2}"
MEM="${CUBELET_VM_MEM:-2048}"
BOOT_TIMEOUT="${CUBELET_VM_BOOT_TIMEOUT:-300}"
TEST_TIMEOUT="${CUBELET_VM_TEST_TIMEOUT:-3600}"
TARGET_DIR="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"
# More -netdev user options (",hostfwd=...,guestfwd=..."), for hack/vm.sh helm.
NET_EXTRA="${CUBELET_VM_NET_EXTRA:-}"
# Where the guest sees the staged binaries and the control directory.
GUEST_BIN=/mnt/bin
GUEST_CTL=/mnt/vmctl

now() { date +%s; }

# ssh_opts: the options of every ssh to the guest. Host keys are not
# checked: the guest is ours, on a loopback port, for this run only. One
# master connection is shared by every ssh (a handshake costs seconds in an
# emulated guest): start_master opens it with its output on /dev/null (a
# master holding the caller's stdout would keep a pipe open), every other
# ssh only uses it, or connects on its own when there is none (after a
# guest reboot until the next start_master); cmd_stop closes it.
ssh_opts() {
    printf '%s\n' -i "${STATE}/id_ed25519" -p "$(cat "${STATE}/ssh_port")" \
        -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR \
        -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4 \
        -o KexAlgorithms=curve25519-sha256 -o "ControlPath=${STATE}/ssh.ctl"
}

guest() {
    local opts
    mapfile -t opts < <(ssh_opts)
    # shellcheck disable=SC2029 # the command is the guest's, quoted by the caller
    ssh "${opts[@]}" -o ControlMaster=no root@127.0.0.1 "$@"
}

# probe: the guest's boot id, if it answers within 15 s.
probe() {
    local opts
    mapfile -t opts < <(ssh_opts)
    timeout 15 ssh "${opts[@]}" -o ControlMaster=no root@127.0.0.1 'cat /proc/sys/kernel/random/boot_id'
}

start_master() {
    local opts
    mapfile -t opts < <(ssh_opts)
    ssh "${opts[@]}" -O check root@127.0.0.1 >/dev/null 2>&1 && return 0
    ssh "${opts[@]}" -o ControlMaster=yes -o ControlPersist=yes -f -N root@127.0.0.1 \
        </dev/null >/dev/null 2>&1 || true
}

qemu_alive() { pid_alive "${STATE}/qemu.pid"; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# stage NAME SRC: hard-link (or copy) SRC into the staging dir as NAME.
stage() {
    local dst="${STATE}/stage/$1"
    mkdir -p "$(dirname "$dst")"
    ln -fL "$2" "$dst" 2>/dev/null || cp -fL "$2" "$dst"
}

# list_e2e: "name executable" of each e2e test binary, as cargo lists them
# (building what is stale).
list_e2e() {
    (cd "$REPO_ROOT" && cargo test --workspace --no-run --message-format=json) \
        | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and "test" in m["target"]["kind"] and "/e2e#" in m["package_id"]:
        print(m["target"]["name"], m["executable"])
'
}

kubelet_bin() {
    local k="${CUBELET_KUBELET_BIN:-${KUBELET_BIN:-}}"
    if [[ -z "$k" ]]; then k="$(command -v kubelet-v1.28.7 || true)"; fi
    [[ -n "$k" && -x "$k" ]] && echo "$k"
    return 0
}

# stage_binaries: the daemon, the pause binary, the e2e test binaries (as
# cargo lists them: `cargo test --workspace --no-run`, a no-op after
# hack/test.sh's `cargo test --workspace`), and kubelet and crictl if the
# host has them.
stage_binaries() {
    local bin="${CUBELET_BIN:-${TARGET_DIR}/debug/cubelet}"
    local pause="${CUBELET_PAUSE_BIN:-${PAUSE_BIN}}"
    [[ -x "$bin" ]] || die "$bin missing: run \`cargo build -p cubelet\` (or set CUBELET_BIN)"
    [[ -x "$pause" ]] || die "$pause missing: run hack/build-pause.sh (or set CUBELET_PAUSE_BIN)"
    stage cubelet "$bin"
    stage cubelet-pause "$pause"
    local name exe
    if [[ -n "${CUBELET_VM_E2E_DIR:-}" ]]; then
        log "e2e test binaries from ${CUBELET_VM_E2E_DIR}"
        for exe in "$CUBELET_VM_E2E_DIR"/*; do
            if [[ -x "$exe" ]]; then stage "e2e/$(basename "$exe")" "$exe"; fi
        done
    else
        log "listing e2e test binaries (cargo test --workspace --no-run)"
        list_e2e >"${STATE}/e2e.list" || die "cargo test --workspace --no-run failed"
        while read -r name exe; do
            stage "e2e/${name}" "$exe"
        done <"${STATE}/e2e.list"
    fi
    local k
    k="$(kubelet_bin)"
    if [[ -n "$k" ]]; then stage kubelet "$k"; fi
    k="${CRICTL_BIN:-$(command -v crictl || true)}"
    if [[ -n "$k" && -x "$k" ]]; then stage crictl "$k"; fi
    log "staged: $(cd "${STATE}/stage" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
}

# refuse_running: one guest per state dir; a second boot must not stop it.
refuse_running() {
    if qemu_alive; then die "a guest is already running (pid $(cat "${STATE}/qemu.pid")); hack/vm.sh stop"; fi
}

cmd_build() { "${HACK_DIR}/vm/build-image.sh"; }

cmd_boot() {
    need_bin qemu-system-x86_64 qemu-system-x86
    need_bin ssh openssh-client
    local image
    image="$(cmd_build)"
    rm -rf "$STATE"
    mkdir -p "${STATE}/ctl/out" "${STATE}/stage"
    stage_binaries
    ssh-keygen -q -t ed25519 -N '' -C cubelet-vm -f "${STATE}/id_ed25519"
    install -m 0600 "${STATE}/id_ed25519.pub" "${STATE}/ctl/authorized_keys"
    free_port >"${STATE}/ssh_port"
    echo "$image" >"${STATE}/image"
    local cpu=max
    [[ "$ACCEL" == kvm ]] && cpu=host
    log "booting ${image} (accel ${ACCEL}, ${SMP} CPUs, ${MEM} MiB, ssh on 127.0.0.1:$(cat "${STATE}/ssh_port"), console ${STATE}/console.log)"
    # The disk is a snapshot: the cached image is never written. restrict=on:
    # the guest reaches nothing but the forwarded port's other end.
    TMPDIR="$STATE" qemu-system-x86_64 \
        -name cubelet-vm -machine q35 -accel "$ACCEL" -cpu "$cpu" -smp "$SMP" -m "$MEM" \
        -kernel "${image}/vmlinuz" -initrd "${image}/initrd.img" \
        -append "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 net.ifnames=0" \
        -drive "file=${image}/rootfs.img,format=raw,if=virtio,snapshot=on" \
        -netdev "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:$(cat "${STATE}/ssh_port")-:22${NET_EXTRA}" \
        -device virtio-net-pci,netdev=n0 \
        -virtfs "local,path=${STATE}/ctl,mount_tag=vmctl,security_model=none,id=vmctl" \
        -virtfs "local,path=${REPO_ROOT},mount_tag=repo,security_model=none,readonly=on,id=repo" \
        -virtfs "local,path=${STATE}/stage,mount_tag=bin,security_model=none,readonly=on,id=bin" \
        -display none -vga none -monitor none -serial "file:${STATE}/console.log" \
        -pidfile "${STATE}/qemu.pid" -daemonize
    wait_ssh
    # shellcheck disable=SC2016 # expanded in the guest
    log "guest up after $(($(now) - BOOTED)) s: $(guest 'echo "$(uname -r), PID 1 $(cat /proc/1/comm), /sys/fs/cgroup $(stat -f -c %T /sys/fs/cgroup)"')"
}

# wait_ssh: wait until the guest answers ssh (up to BOOT_TIMEOUT s from
# now), then share the master connection and mount the shares. BOOTED is
# when the wait began.
BOOTED=0
wait_ssh() {
    BOOTED="$(now)"
    # qemu accepts the forwarded port before the guest listens: a probe
    # without a time limit can wait for minutes for a banner.
    while ! probe </dev/null >/dev/null 2>&1; do
        qemu_alive || { tail -n 40 "${STATE}/console.log" >&2 || true; die "qemu exited while booting"; }
        if (($(now) - BOOTED > BOOT_TIMEOUT)); then
            tail -n 40 "${STATE}/console.log" >&2 || true
            die "no ssh into the guest within ${BOOT_TIMEOUT} s (console: ${STATE}/console.log)"
        fi
        sleep 2
    done
    start_master
    mount_shares
}

# cmd_reboot: reboot the guest (same qemu, same disk snapshot: what the
# guest wrote survives) and wait for it to answer again.
cmd_reboot() {
    qemu_alive || die "no guest running (hack/vm.sh boot)"
    local before start
    before="$(probe)"
    guest 'systemctl reboot' >/dev/null 2>&1 || true
    close_master
    # Until the old system is gone, ssh may still answer.
    start="$(now)"
    while [[ "$(probe </dev/null 2>/dev/null || true)" == "$before" ]]; do
        (($(now) - start < 120)) || die "the guest did not go down within 120 s of systemctl reboot"
        sleep 2
    done
    wait_ssh
    log "guest rebooted, up after $(($(now) - BOOTED)) s"
}

# mount_shares: the repository at its own path (the test binaries' paths
# baked in by cargo stay right) and the staged binaries; again after a
# guest reboot.
mount_shares() {
    local o=trans=virtio,version=9p2000.L,msize=512000,ro
    guest "set -e
        mkdir -p '${REPO_ROOT}' ${GUEST_BIN}
        mountpoint -q '${REPO_ROOT}' || mount -t 9p -o ${o} repo '${REPO_ROOT}'
        mountpoint -q ${GUEST_BIN} || mount -t 9p -o ${o} bin ${GUEST_BIN}"
}

cmd_run() {
    qemu_alive || die "no guest running (hack/vm.sh boot)"
    start_master
    mount_shares
    guest "$@"
}

cmd_ssh() {
    qemu_alive || die "no guest running (hack/vm.sh boot)"
    local opts
    mapfile -t opts < <(ssh_opts)
    start_master
    mount_shares
    exec ssh -o ControlMaster=no -t "${opts[@]}" root@127.0.0.1
}

# cmd_stop [DIR]: journal and console log to DIR when given, then power
# off (qemu killed if it does not exit) and remove the state dir.
cmd_stop() {
    local keep="${1:-}"
    if qemu_alive && [[ -n "$keep" ]]; then
        guest "journalctl -b --no-pager -o short-monotonic >${GUEST_CTL}/out/journal.txt 2>&1;
            systemctl --no-pager status cubelet containerd kubelet >${GUEST_CTL}/out/units.txt 2>&1;
            systemd-cgls --no-pager >${GUEST_CTL}/out/cgls.txt 2>&1; sync" 2>/dev/null \
            || log "could not read the guest's journal (ssh failed)"
    fi
    if qemu_alive; then
        local pid
        pid="$(cat "${STATE}/qemu.pid")"
        guest 'systemctl poweroff' >/dev/null 2>&1 || true
        close_master
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "guest did not power off in 30 s, killing qemu (pid ${pid})"
            kill -KILL "$pid" 2>/dev/null || true
            while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
        fi
        log "guest stopped"
    fi
    if [[ -n "$keep" && -d "$STATE" ]]; then
        mkdir -p "$keep"
        cp -a "${STATE}/ctl/out/." "$keep/" 2>/dev/null || true
        cp -a "${STATE}/console.log" "$keep/" 2>/dev/null || true
        log "guest logs in ${keep}: $(find "$keep" -mindepth 1 -maxdepth 1 -printf '%f ')"
    fi
    close_master
    rm -rf "$STATE"
}

# close_master: end the shared ssh connection (its process is ours).
close_master() {
    if [[ -S "${STATE}/ssh.ctl" ]]; then
        local opts
        mapfile -t opts < <(ssh_opts)
        ssh "${opts[@]}" -O exit root@127.0.0.1 >/dev/null 2>&1 || true
    fi
}

# on_exit: whatever ended the script, nothing is left running; the logs
# of a failure are kept (STOP_ALWAYS=1: stop even on success, for `test`).
T0="$(now)"
STOP_ALWAYS=0
# shellcheck disable=SC2317 # run by the EXIT trap
on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    if ((rc != 0)); then
        local dir
        dir="${OUT}/$(date -u +%Y%m%dT%H%M%SZ)"
        cmd_stop "$dir" || true
        log "FAILED after $(($(now) - T0)) s; console log, journal and test output in ${dir}"
    elif ((STOP_ALWAYS)); then
        cmd_stop || true
    fi
    exit "$rc"
}

cmd_test() {
    local t failed=""
    STOP_ALWAYS=1

    t="$(now)"
    log "step: guest image"
    cmd_build >/dev/null
    log "step: guest image: $(($(now) - t)) s"

    t="$(now)"
    log "step: boot"
    cmd_boot
    log "step: boot: $(($(now) - t)) s"

    t="$(now)"
    log "step: tests in the guest (hack/vm/guest-test.sh)"
    guest "timeout ${TEST_TIMEOUT} env CUBELET_VM_E2E='${CUBELET_VM_E2E:-}' \
        '${REPO_ROOT}/hack/vm/guest-test.sh' ${GUEST_BIN} ${GUEST_CTL}/out" || failed=1
    log "step: tests in the guest: $(($(now) - t)) s"
    [[ -z "$failed" ]] || die "tests in the guest failed"
    log "guest test passed in $(($(now) - T0)) s"
}

main() {
    case "${1:-}" in
        build) cmd_build ;;
        # A failed boot or test stops the guest and keeps its logs.
        boot) refuse_running; trap on_exit EXIT; trap 'exit 130' INT TERM; cmd_boot ;;
        run) shift; (($#)) || die "usage: $0 run CMD..."; cmd_run "$@" ;;
        ssh) cmd_ssh ;;
        reboot) cmd_reboot ;;
        stop) shift; cmd_stop "${1:-}" ;;
        test) refuse_running; trap on_exit EXIT; trap 'exit 130' INT TERM; cmd_test ;;
        helm) shift; exec "${HACK_DIR}/vm/helm-test.sh" "$@" ;;
        *) echo "usage: $0 build|boot|run CMD...|ssh|reboot|stop [DIR]|test|helm" >&2; exit 2 ;;
    esac
}

# One line, read whole before it runs: editing this file while a run goes
# on cannot feed the running shell half a command.
main "$@"; exit
