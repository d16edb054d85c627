#!/usr/bin/env bash
# Build Cubelet's test images from Debian's busybox-static and the
# cubelet-pause binary, WITHOUT docker, and push them to the private registry
# (hack/registry.sh) through the registry HTTP API with curl:
#
#   ${REGISTRY_ADDR}/busybox:test        Docker schema2 manifest, 2 layers
#   ${REGISTRY_ADDR}/busybox-oci:test    OCI manifest (user "tester"), same layers
#   ${REGISTRY_ADDR}/busybox-usergroup:test
#                                        OCI manifest (user "tester:cubelet-extra"), same layers
#   ${REGISTRY_ADDR}/busybox-multi:test  manifest list: linux/amd64 + a bogus linux/arm64
#   ${REGISTRY_ADDR}/pause:test          cubelet-pause (sandbox image of containerd's CRI)
#   ${REGISTRY_ADDR}/hostile-user-{zero,fifo,hostetc}:test
#                                        /etc/passwd and /etc/group -> /dev/zero, FIFOs,
#                                        and /etc -> /etc (e2e/tests/hostile/image_user.rs)
#   ${REGISTRY_ADDR}/bench-layers:test   only with BENCH_IMAGES=1: busybox and 5 layers of
#                                        60 MiB of incompressible data (cri-bench --pulls)
#
# Tars are deterministic (fixed mtimes, owners), so re-running pushes nothing
# new: blobs already present are skipped and manifests are re-put unchanged.
#
# Env: REGISTRY_ADDR BUSYBOX_BIN PAUSE_BIN BENCH_IMAGES TEST_IMAGES_WORK (build dir,
#      default ${CUBELET_TEST_ROOT}/test-images) (see hack/lib.sh)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_bin python3 python3
need_bin curl curl
[[ -x "$BUSYBOX_BIN" ]] || die "$BUSYBOX_BIN not found; install it: apt-get install -y busybox-static"
if [[ ! -x "$PAUSE_BIN" ]]; then
    log "$PAUSE_BIN missing, building it"
    PAUSE_BIN="$PAUSE_BIN" "${HACK_DIR}/build-pause.sh" >/dev/null
fi
curl -fsS -o /dev/null "http://${REGISTRY_ADDR}/v2/" \
    || die "registry not answering at http://${REGISTRY_ADDR}/v2/; run hack/registry.sh start"

WORK="${TEST_IMAGES_WORK:-${CUBELET_TEST_ROOT}/test-images}"
rm -rf "$WORK"
mkdir -p "$WORK/blobs"
log "building image blobs in ${WORK}"

python3 - "$WORK" "$BUSYBOX_BIN" "$PAUSE_BIN" "${BENCH_IMAGES:-0}" <<'PY'
import gzip, hashlib, io, json, os, random, sys, tarfile

work, busybox, pause, bench = sys.argv[1:5]
blobs = os.path.join(work, "blobs")
MTIME = 1700000000

def put(data):
    d = "sha256:" + hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, d[7:]), "wb") as f:
        f.write(data)
    return d, len(data)

def tar_of(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for e in entries:
            kind, name = e[0], e[1]
            ti = tarfile.TarInfo(name)
            ti.mtime = MTIME
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = "root"
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                ti.mode = e[2]
                t.addfile(ti)
            elif kind == "fifo":
                ti.type = tarfile.FIFOTYPE
                ti.mode = 0o644
                t.addfile(ti)
            elif kind == "chr":
                ti.type = tarfile.CHRTYPE
                ti.mode = 0o666
                ti.devmajor, ti.devminor = e[2]
                t.addfile(ti)
            elif kind == "sym":
                ti.type = tarfile.SYMTYPE
                ti.linkname = e[2]
                ti.mode = 0o777
                t.addfile(ti)
            else:
                data = e[2]
                ti.size = len(data)
                ti.mode = e[3]
                t.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as g:
        g.write(raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest(), gz.getvalue()

applets = ["sh", "ls", "cat", "echo", "sleep", "httpd", "wget", "id", "env", "ps", "kill",
           "mkdir", "rm", "touch", "true", "false", "test", "grep", "head", "tail", "date",
           "hostname", "ip", "nc", "mount", "df", "du", "stat", "whoami", "printf", "sync", "top"]
bb = open(busybox, "rb").read()
rootfs = [("dir", "bin", 0o755), ("file", "bin/busybox", bb, 0o755)]
rootfs += [("sym", "bin/" + a, "busybox") for a in applets]
rootfs += [
    ("dir", "etc", 0o755),
    ("file", "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\ntester:x:1000:1000:tester:/home/tester:/bin/sh\n", 0o644),
    ("file", "etc/group", b"root:x:0:\ntester:x:1000:\ncubelet-extra:x:50000:tester\n", 0o644),
    ("dir", "home", 0o755), ("dir", "home/tester", 0o755), ("dir", "root", 0o700),
    ("dir", "tmp", 0o1777), ("dir", "var", 0o755), ("dir", "www", 0o755),
    ("file", "www/index.html", b"cubelet test\n", 0o644),
]
extra = [("dir", "etc", 0o755), ("file", "etc/cubelet-test", b"layer two\n", 0o644)]

layers = []
for entries in (rootfs, extra):
    diff_id, gz = tar_of(entries)
    digest, size = put(gz)
    layers.append({"digest": digest, "size": size, "diff_id": diff_id})

def config(arch, user, cmd, env_extra):
    return {
        "architecture": arch, "os": "linux",
        "created": "2023-11-14T22:13:20Z",
        "config": {
            "User": user,
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", env_extra],
            "Cmd": cmd, "WorkingDir": "/",
            "Labels": {"io.cubelet.test": "busybox"},
            "StopSignal": "SIGTERM",
        },
        "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
        "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "hack/test-images.sh"}],
    }

def put_json(obj):
    return put(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())

DOCKER = {"manifest": "application/vnd.docker.distribution.manifest.v2+json",
          "config": "application/vnd.docker.container.image.v1+json",
          "layer": "application/vnd.docker.image.rootfs.diff.tar.gzip",
          "list": "application/vnd.docker.distribution.manifest.list.v2+json"}
OCI = {"manifest": "application/vnd.oci.image.manifest.v1+json",
       "config": "application/vnd.oci.image.config.v1+json",
       "layer": "application/vnd.oci.image.layer.v1.tar+gzip"}

def manifest(mt, cfg, lays):
    cd, cs = put_json(cfg)
    m = {"schemaVersion": 2, "mediaType": mt["manifest"],
         "config": {"mediaType": mt["config"], "digest": cd, "size": cs},
         "layers": [{"mediaType": mt["layer"], "digest": l["digest"], "size": l["size"]} for l in lays]}
    data = json.dumps(m, sort_keys=True, indent=2).encode()
    d, s = put(data)
    return {"media_type": mt["manifest"], "digest": d, "size": s, "data": data, "blobs": [cd] + [l["digest"] for l in lays]}

out = {}
out["busybox"] = manifest(DOCKER, config("amd64", "", ["sh"], "CUBELET_TEST=busybox"), layers)
out["busybox-oci"] = manifest(OCI, config("amd64", "tester", ["sleep", "3600"], "CUBELET_TEST=busybox-oci"), layers)
# `USER tester:cubelet-extra`: a group named, resolved from the image's /etc/group.
out["busybox-usergroup"] = manifest(OCI, config("amd64", "tester:cubelet-extra", ["sleep", "3600"], "CUBELET_TEST=busybox-usergroup"), layers)
arm = manifest(DOCKER, config("arm64", "", ["bogus"], "CUBELET_TEST=bogus-arm64"), layers)
amd = out["busybox"]
lst = {"schemaVersion": 2, "mediaType": DOCKER["list"], "manifests": [
    {"mediaType": arm["media_type"], "digest": arm["digest"], "size": arm["size"],
     "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
    {"mediaType": amd["media_type"], "digest": amd["digest"], "size": amd["size"],
     "platform": {"architecture": "amd64", "os": "linux"}},
]}
ldata = json.dumps(lst, sort_keys=True, indent=2).encode()
ld, ls_ = put(ldata)
out["busybox-multi"] = {"media_type": DOCKER["list"], "digest": ld, "size": ls_, "data": ldata,
                        "blobs": amd["blobs"] + arm["blobs"], "children": [arm, amd]}

# Hostile images (e2e/tests/hostile/image_user.rs): the user lookup of a
# container with runAsUser and no runAsGroup must stay inside the rootfs and
# read only regular files. One layer each: busybox and a crafted /etc.
hostile_base = [("dir", "bin", 0o755), ("file", "bin/busybox", bb, 0o755),
                ("sym", "bin/sh", "busybox"), ("sym", "bin/sleep", "busybox"),
                ("dir", "tmp", 0o1777)]
hostile = {
    # /etc/passwd and /etc/group -> /dev/zero, and the image's own /dev/zero.
    "hostile-user-zero": [("dir", "dev", 0o755), ("chr", "dev/zero", (1, 5)),
                          ("dir", "etc", 0o755),
                          ("sym", "etc/passwd", "/dev/zero"), ("sym", "etc/group", "/dev/zero")],
    # Both FIFOs: an open for reading blocks until a writer comes.
    "hostile-user-fifo": [("dir", "etc", 0o755), ("fifo", "etc/passwd"), ("fifo", "etc/group")],
    # /etc -> /etc: read from the host's root, the host's files.
    "hostile-user-hostetc": [("sym", "etc", "/etc")],
}
for repo, entries in hostile.items():
    diff_id, gz = tar_of(hostile_base + entries)
    digest, size = put(gz)
    lay = [{"digest": digest, "size": size, "diff_id": diff_id}]
    cfg = config("amd64", "", ["sleep", "3600"], "CUBELET_TEST=" + repo)
    cfg["rootfs"]["diff_ids"] = [diff_id]
    out[repo] = manifest(OCI, cfg, lay)

pause_bin = open(pause, "rb").read()
pdiff, pgz = tar_of([("file", "pause", pause_bin, 0o755)])
pd, ps = put(pgz)
pcfg = {"architecture": "amd64", "os": "linux", "created": "2023-11-14T22:13:20Z",
        "config": {"Entrypoint": ["/pause"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [pdiff]}}
out["pause"] = manifest(OCI, pcfg, [{"digest": pd, "size": ps}])

if bench == "1":
    # A pull benchmark's image: busybox plus five layers of 60 MiB each of
    # seeded pseudo-random (so incompressible, and the same every run) data.
    rng = random.Random(1700000000)
    blay = [layers[0]]
    for i in range(5):
        data = rng.randbytes(60 << 20)
        diff_id, gz = tar_of([("dir", "data", 0o755), ("file", f"data/layer{i}", data, 0o644)])
        digest, size = put(gz)
        blay.append({"digest": digest, "size": size, "diff_id": diff_id})
    bcfg = config("amd64", "", ["sleep", "3600"], "CUBELET_TEST=bench-layers")
    bcfg["rootfs"]["diff_ids"] = [l["diff_id"] for l in blay]
    out["bench-layers"] = manifest(OCI, bcfg, blay)

# Plan for the pusher: repo, blobs, then child manifests, then the top manifest.
with open(os.path.join(work, "plan.txt"), "w") as plan:
    for repo, m in out.items():
        for b in dict.fromkeys(m["blobs"]):
            plan.write(f"blob {repo} {b}\n")
        for c in m.get("children", []):
            plan.write(f"manifest {repo} {c['digest']} {c['media_type']} {c['digest']}\n")
        plan.write(f"manifest {repo} test {m['media_type']} {m['digest']}\n")
PY

push_blob() {
    local repo="$1" digest="$2" file="$WORK/blobs/${2#sha256:}" location
    if curl -fsS -o /dev/null -I "http://${REGISTRY_ADDR}/v2/${repo}/blobs/${digest}" 2>/dev/null; then
        log "blob ${repo}@${digest:0:19} present"
        return 0
    fi
    location="$(curl -fsS -o /dev/null -D - -X POST "http://${REGISTRY_ADDR}/v2/${repo}/blobs/uploads/" \
        | tr -d '\r' | sed -n 's/^[Ll]ocation: //p')"
    [[ -n "$location" ]] || die "no upload location for ${repo}"
    [[ "$location" == http* ]] || location="http://${REGISTRY_ADDR}${location}"
    if [[ "$location" == *\?* ]]; then location="${location}&digest=${digest}"; else location="${location}?digest=${digest}"; fi
    curl -fsS -o /dev/null -X PUT -H 'Content-Type: application/octet-stream' \
        --data-binary "@${file}" "$location"
    log "blob ${repo}@${digest:0:19} pushed ($(stat -c %s "$file") bytes)"
}

push_manifest() {
    local repo="$1" ref="$2" media_type="$3" digest="$4"
    curl -fsS -o /dev/null -X PUT -H "Content-Type: ${media_type}" \
        --data-binary "@$WORK/blobs/${digest#sha256:}" "http://${REGISTRY_ADDR}/v2/${repo}/manifests/${ref}"
    local sep=":"
    [[ "$ref" == sha256:* ]] && sep="@"
    log "manifest ${REGISTRY_ADDR}/${repo}${sep}${ref} (${media_type##*/})"
}

while read -r kind repo a b c; do
    case "$kind" in
        blob) push_blob "$repo" "$a" ;;
        manifest) push_manifest "$repo" "$a" "$b" "$c" ;;
    esac
done <"$WORK/plan.txt"
log "test images pushed to ${REGISTRY_ADDR}: busybox:test busybox-oci:test busybox-usergroup:test busybox-multi:test pause:test hostile-user-{zero,fifo,hostetc}:test$([[ "${BENCH_IMAGES:-0}" == 1 ]] && echo ' bench-layers:test')"
