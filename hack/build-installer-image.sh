#!/usr/bin/env bash
# Build the chart's installer image (charts/cubelet, `image.repository`) as
# an OCI image layout directory, without docker or a registry, and validate
# it.
#
# The image holds what charts/cubelet/files/install.sh and uninstall.sh run
# inside the installer pod: a static busybox in /bin with its applets as
# symlinks (sh, cp, cmp, mkdir, dirname, chmod, mv, rm, sleep, wget for
# /readyz and the readiness probe, nsenter into the host, pidof, tr, sed,
# tail, awk and cat for the runtime switch's checks, timeout), and `cubelet` and
# `cubelet-pause` in `image.binDir` (/usr/local/bin), which install.sh copies
# to the host. The scripts themselves come from the chart's ConfigMap. The
# binaries run on the host (cubelet under systemd, cubelet-pause in pods),
# never in this image: cubelet must suit the nodes' libc, cubelet-pause is
# the static build of hack/build-pause.sh.
#
# The layout (oci-layout, index.json, blobs/sha256/: one gzip layer, its
# config and manifest) is written with tar, gzip, sha256sum and python3 and
# is reproducible (sorted entries, owner 0:0, mtime SOURCE_DATE_EPOCH). It
# is then checked: every descriptor's digest and size against its blob, the
# config's diff_id against the uncompressed layer, the layer's files against
# their sources, static busybox and cubelet-pause, the applets the scripts
# need resolving in the extracted image, one architecture throughout.
#
# Load it where needed, e.g.
#   skopeo copy oci:target/installer-oci:0.2.0 docker://registry.example/cubelet-installer:0.2.0
#   tar -C target/installer-oci -cf installer.tar . && ctr -n k8s.io images import installer.tar
#
# Usage: hack/build-installer-image.sh [release|debug]   (default release)
#        hack/build-installer-image.sh --check [DIR]      (validate only)
# Env: OUT (default target/installer-oci), CUBELET_BIN (default
#   target/<profile>/cubelet), PAUSE_BIN (default target/cubelet-pause),
#   BUSYBOX_BIN (default /bin/busybox), SOURCE_DATE_EPOCH (default 0),
#   GZIP_LEVEL (default 6). Prints the layout's path.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

cd "$REPO_ROOT"
target_dir="${CARGO_TARGET_DIR:-${REPO_ROOT}/target}"
OUT="${OUT:-${target_dir}/installer-oci}"
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-0}"
GZIP_LEVEL="${GZIP_LEVEL:-6}"

# validate LAYOUT [CUBELET PAUSE BUSYBOX]: check an OCI layout; with the
# source binaries, also that the layer carries exactly them.
validate() {
    python3 - "$@" <<'PY'
import gzip, hashlib, json, os, struct, subprocess, sys, tarfile, tempfile
from pathlib import Path

import yaml

layout = Path(sys.argv[1])
sources = sys.argv[2:5]
root = Path(os.environ["REPO_ROOT"])
values = yaml.safe_load((root / "charts/cubelet/values.yaml").read_text())
chart = yaml.safe_load((root / "charts/cubelet/Chart.yaml").read_text())
bin_dir = values["image"]["binDir"].strip("/")
tag = values["image"]["tag"] or str(chart["appVersion"])
ref = f"{values['image']['repository']}:{tag}"
# What install.sh, uninstall.sh and the readiness probe run in the image.
APPLETS = ["sh", "cp", "cmp", "mkdir", "dirname", "chmod", "mv", "rm", "sleep", "wget", "nsenter",
           "pidof", "tr", "sed", "tail", "awk", "cat", "timeout"]
ELF_MACHINES = {62: "amd64", 183: "arm64", 40: "arm", 3: "386", 243: "riscv64", 22: "s390x", 21: "ppc64le"}
errors = []


def fail(msg):
    errors.append(msg)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def blob(desc, media_type):
    """The blob of a descriptor, after checking media type, digest and size."""
    if desc.get("mediaType") != media_type:
        fail(f"descriptor {desc.get('digest')}: mediaType {desc.get('mediaType')!r}, want {media_type}")
    algo, _, hexdigest = str(desc.get("digest", "")).partition(":")
    path = layout / "blobs" / algo / hexdigest
    if algo != "sha256" or not path.is_file():
        fail(f"descriptor {desc.get('digest')}: no blob {path}")
        return None
    if path.stat().st_size != desc.get("size"):
        fail(f"{desc['digest']}: size {path.stat().st_size}, descriptor says {desc.get('size')}")
    if sha256(path) != hexdigest:
        fail(f"{desc['digest']}: content hashes to sha256:{sha256(path)}")
    return path


def elf(data):
    """(machine, has PT_INTERP) of a 64/32-bit little-endian ELF, or None."""
    if data[:4] != b"\x7fELF":
        return None
    is64 = data[4] == 2
    machine = struct.unpack_from("<H", data, 18)[0]
    phoff = struct.unpack_from("<Q" if is64 else "<I", data, 32 if is64 else 28)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 54 if is64 else 42)
    interp = any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))
    return machine, interp


layout_file = layout / "oci-layout"
if not layout_file.is_file() or json.loads(layout_file.read_text()).get("imageLayoutVersion") != "1.0.0":
    sys.exit(f"{layout}: no oci-layout with imageLayoutVersion 1.0.0")
index = json.loads((layout / "index.json").read_text())
if index.get("schemaVersion") != 2 or index.get("mediaType") != "application/vnd.oci.image.index.v1+json":
    fail(f"index.json: schemaVersion {index.get('schemaVersion')}, mediaType {index.get('mediaType')}")
manifests = index.get("manifests") or []
if len(manifests) != 1:
    sys.exit(f"index.json: {len(manifests)} manifests, want 1")
mdesc = manifests[0]
annotations = mdesc.get("annotations") or {}
if annotations.get("org.opencontainers.image.ref.name") != tag:
    fail(f"index.json: ref.name {annotations.get('org.opencontainers.image.ref.name')!r}, want {tag!r}")
if annotations.get("io.containerd.image.name") != ref:
    fail(f"index.json: io.containerd.image.name {annotations.get('io.containerd.image.name')!r}, want {ref!r}")
mpath = blob(mdesc, "application/vnd.oci.image.manifest.v1+json")
if mpath is None:
    sys.exit("\n".join(errors))
manifest = json.loads(mpath.read_text())
if manifest.get("schemaVersion") != 2 or manifest.get("mediaType") != mdesc["mediaType"]:
    fail(f"manifest: schemaVersion {manifest.get('schemaVersion')}, mediaType {manifest.get('mediaType')}")
cpath = blob(manifest.get("config") or {}, "application/vnd.oci.image.config.v1+json")
layers = manifest.get("layers") or []
lpaths = [blob(d, "application/vnd.oci.image.layer.v1.tar+gzip") for d in layers]
if len(layers) != 1:
    fail(f"manifest: {len(layers)} layers, want 1")
if errors:
    sys.exit(f"{layout}: invalid installer image:\n  " + "\n  ".join(errors))
config = json.loads(cpath.read_text())
platform = mdesc.get("platform") or {}
arch = config.get("architecture")
if config.get("os") != "linux" or platform != {"architecture": arch, "os": "linux"}:
    fail(f"config os/architecture {config.get('os')}/{arch}, index platform {platform}")
diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
with gzip.open(lpaths[0], "rb") as f:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
if config.get("rootfs", {}).get("type") != "layers" or diff_ids != [f"sha256:{h.hexdigest()}"]:
    fail(f"config rootfs.diff_ids {diff_ids}, the layer uncompressed is sha256:{h.hexdigest()}")
if config.get("config", {}).get("User") != "0:0":
    fail(f"config User {config.get('config', {}).get('User')!r}, want 0:0")
referenced = {mdesc["digest"], manifest["config"]["digest"], layers[0]["digest"]}
present = {f"sha256:{p.name}" for p in (layout / "blobs" / "sha256").iterdir()}
if present != referenced:
    fail(f"blobs not referenced: {sorted(present - referenced)}")

with tarfile.open(lpaths[0], "r:gz") as tar:
    members = {m.name: m for m in tar.getmembers()}
    for m in members.values():
        if m.name.startswith("/") or ".." in m.name.split("/") or m.uid or m.gid:
            fail(f"layer entry {m.name}: absolute, '..' or not owned by 0:0")
    wanted = {f"{bin_dir}/cubelet": 0, f"{bin_dir}/cubelet-pause": 1, "bin/busybox": 2}
    for name, i in wanted.items():
        m = members.get(name)
        if m is None or not m.isfile() or m.mode != 0o755:
            fail(f"layer: {name} missing, not a file or not mode 0755")
            continue
        data = tar.extractfile(m).read()
        if sources and hashlib.sha256(data).hexdigest() != sha256(sources[i]):
            fail(f"layer: {name} differs from {sources[i]}")
        info = elf(data)
        if info is None:
            fail(f"layer: {name} is not an ELF executable")
            continue
        if ELF_MACHINES.get(info[0]) != arch:
            fail(f"layer: {name} is for ELF machine {info[0]}, the image for {arch}")
        if name != f"{bin_dir}/cubelet" and info[1]:
            fail(f"layer: {name} is dynamically linked; it must be static")
    for applet in APPLETS:
        m = members.get(f"bin/{applet}")
        if m is None or not m.issym() or m.linkname != "busybox":
            fail(f"layer: bin/{applet} is not a symlink to busybox")

with tempfile.TemporaryDirectory(prefix="installer-oci-check-") as tmp:
    subprocess.run(["tar", "-xzf", str(lpaths[0]), "-C", tmp], check=True)
    listed = subprocess.run([f"{tmp}/bin/busybox", "--list"], capture_output=True, text=True)
    missing = [a for a in APPLETS if a not in listed.stdout.split()]
    if listed.returncode != 0 or missing:
        fail(f"the image's busybox lacks applets {missing}")
    # Each command resolves in the extracted tree to the busybox binary (the
    # runtime execs the readiness probe's wget without a shell), and busybox
    # dispatches on the name it is run by.
    busybox = os.path.realpath(f"{tmp}/bin/busybox")
    unresolved = [a for a in APPLETS if os.path.realpath(f"{tmp}/bin/{a}") != busybox]
    if unresolved:
        fail(f"in the extracted image, {unresolved} do not resolve to bin/busybox")
    runs = [([f"{tmp}/bin/sh", "-c", "exit 0"], ""), ([f"{tmp}/bin/dirname", "/a/b"], "/a\n"),
            ([f"{tmp}/bin/cmp", busybox, busybox], "")]
    # The readiness probe's and install.sh's call, against a closed port:
    # wget must fail as a program (exit 1), not die of a signal (Debian's
    # busybox 1.35 wget segfaults on -T).
    probe = subprocess.run([f"{tmp}/bin/timeout", "2", f"{tmp}/bin/wget", "-q", "-O", "/dev/null",
                            "http://127.0.0.1:9/"], capture_output=True, text=True, env={"PATH": f"{tmp}/bin"})
    if probe.returncode != 1:
        fail(f"in the extracted image, the readiness probe's wget exits {probe.returncode} "
             f"against a closed port, want 1: {probe.stderr!r}")
    for argv, want in runs:
        run = subprocess.run(argv, capture_output=True, text=True, env={"PATH": f"{tmp}/bin"})
        if run.returncode != 0 or run.stdout != want:
            fail(f"in the extracted image, {argv} exits {run.returncode} with {run.stdout!r}{run.stderr!r}")

if errors:
    sys.exit(f"{layout}: invalid installer image:\n  " + "\n  ".join(errors))
size = lpaths[0].stat().st_size
print(f"validated {ref} ({arch}): manifest {mdesc['digest']}, layer {size / 1e6:.1f} MB, "
      f"{len(members)} entries", file=sys.stderr)
PY
}

if [[ "${1:-}" == "--check" ]]; then
    export REPO_ROOT
    validate "${2:-$OUT}"
    exit 0
fi

profile="${1:-release}"
[[ "$profile" == release || "$profile" == debug ]] || die "usage: $0 [release|debug] | --check [DIR]"
CUBELET_BIN="${CUBELET_BIN:-${target_dir}/${profile}/cubelet}"
[[ -x "$CUBELET_BIN" ]] || die "no $CUBELET_BIN; run cargo build$([[ $profile == release ]] && echo " --release") -p cubelet"
[[ -x "$PAUSE_BIN" ]] || die "no $PAUSE_BIN; run hack/build-pause.sh"
[[ -x "$BUSYBOX_BIN" ]] || die "no $BUSYBOX_BIN; install it: apt-get install -y busybox-static"
need_bin python3 python3
need_bin sha256sum coreutils
need_bin gzip gzip

# Chart facts: image reference and the binaries' directory in the image.
read -r repository tag bin_dir < <(python3 - <<'PY'
import yaml
v = yaml.safe_load(open("charts/cubelet/values.yaml"))
c = yaml.safe_load(open("charts/cubelet/Chart.yaml"))
print(v["image"]["repository"], v["image"]["tag"] or c["appVersion"], v["image"]["binDir"])
PY
)
arch="$(dpkg --print-architecture 2>/dev/null || true)"
if [[ -z "$arch" ]]; then
    case "$(uname -m)" in
    x86_64) arch=amd64 ;;
    aarch64) arch=arm64 ;;
    *) die "unknown architecture $(uname -m)" ;;
    esac
fi

mkdir -p "$target_dir"
work="$(mktemp -d "${target_dir}/installer-oci.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
log "building ${repository}:${tag} (${arch}, cubelet ${profile}) in ${OUT}"

# Root filesystem: busybox and its applets, the two binaries, /tmp.
install -d -m 0755 "$rootfs/bin" "$rootfs${bin_dir}"
install -d -m 1777 "$rootfs/tmp"
install -m 0755 "$BUSYBOX_BIN" "$rootfs/bin/busybox"
for applet in $("$BUSYBOX_BIN" --list); do
    [[ "$applet" == busybox || "$applet" == */* ]] || ln -s busybox "$rootfs/bin/$applet"
done
install -m 0755 "$CUBELET_BIN" "$rootfs${bin_dir}/cubelet"
install -m 0755 "$PAUSE_BIN" "$rootfs${bin_dir}/cubelet-pause"
(cd "$rootfs" && find . -mindepth 1 -type d ! -path ./tmp -exec chmod 0755 {} +)

# The layer: a reproducible tar, gzipped.
top=()
for entry in "$rootfs"/*; do top+=("$(basename "$entry")"); done
tar --sort=name --mtime="@${SOURCE_DATE_EPOCH}" --owner=0 --group=0 --numeric-owner \
    --format=gnu -C "$rootfs" -cf "$work/layer.tar" "${top[@]}"
gzip -n "-${GZIP_LEVEL}" -c "$work/layer.tar" >"$work/layer.tar.gz"
diff_id="$(sha256sum "$work/layer.tar" | cut -d' ' -f1)"
rm -f "$work/layer.tar"

layout="$work/layout"
install -d "$layout/blobs/sha256"
# put FILE: move FILE into blobs/ under its digest; prints "digest size".
put() {
    local digest size
    digest="$(sha256sum "$1" | cut -d' ' -f1)"
    size="$(stat -c %s "$1")"
    mv "$1" "$layout/blobs/sha256/$digest"
    echo "$digest $size"
}
read -r layer_digest layer_size < <(put "$work/layer.tar.gz")

revision="$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || true)"
# json FILE CODE [ARGS]: run python3 CODE, which writes FILE (sys.argv[1]).
json() {
    ARCH="$arch" TAG="$tag" REF="${repository}:${tag}" DIFF_ID="$diff_id" EPOCH="$SOURCE_DATE_EPOCH" \
        REVISION="$revision" PROFILE="$profile" python3 -c "$2" "$1" "${@:3}"
}
json "$work/config.json" '
import datetime, json, os, sys
created = datetime.datetime.fromtimestamp(int(os.environ["EPOCH"]), datetime.timezone.utc)
created = created.strftime("%Y-%m-%dT%H:%M:%SZ")
labels = {"org.opencontainers.image.title": "cubelet-installer",
          "org.opencontainers.image.version": os.environ["TAG"]}
if os.environ["REVISION"]:
    labels["org.opencontainers.image.revision"] = os.environ["REVISION"]
config = {
    "created": created, "architecture": os.environ["ARCH"], "os": "linux",
    "config": {"User": "0:0", "WorkingDir": "/", "Cmd": ["/bin/sh"], "Labels": labels,
               "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + os.environ["DIFF_ID"]]},
    "history": [{"created": created,
                 "created_by": "hack/build-installer-image.sh " + os.environ["PROFILE"]}],
}
open(sys.argv[1], "w").write(json.dumps(config, sort_keys=True, separators=(",", ":")))
'
read -r config_digest config_size < <(put "$work/config.json")
json "$work/manifest.json" '
import json, os, sys
config_digest, config_size, layer_digest, layer_size = sys.argv[2:6]
manifest = {
    "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
               "digest": "sha256:" + config_digest, "size": int(config_size)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": "sha256:" + layer_digest, "size": int(layer_size)}],
    "annotations": {"org.opencontainers.image.version": os.environ["TAG"]},
}
open(sys.argv[1], "w").write(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
' "$config_digest" "$config_size" "$layer_digest" "$layer_size"
read -r manifest_digest manifest_size < <(put "$work/manifest.json")
json "$layout/index.json" '
import json, os, sys
digest, size = sys.argv[2:4]
index = {
    "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": "sha256:" + digest, "size": int(size),
        "platform": {"architecture": os.environ["ARCH"], "os": "linux"},
        "annotations": {"org.opencontainers.image.ref.name": os.environ["TAG"],
                        "io.containerd.image.name": os.environ["REF"]},
    }],
}
open(sys.argv[1], "w").write(json.dumps(index, sort_keys=True, separators=(",", ":")))
' "$manifest_digest" "$manifest_size"
printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"

export REPO_ROOT
# Against the staged copies: what was copied is what must be in the layer,
# even if a concurrent cargo build replaces target/ meanwhile.
validate "$layout" "$rootfs${bin_dir}/cubelet" "$rootfs${bin_dir}/cubelet-pause" "$rootfs/bin/busybox"
rm -rf "$OUT.old"
mkdir -p "$(dirname "$OUT")"
if [[ -e "$OUT" ]]; then mv "$OUT" "$OUT.old"; fi
mv "$layout" "$OUT"
rm -rf "$OUT.old"
log "${repository}:${tag} at ${OUT}"
echo "$OUT"
