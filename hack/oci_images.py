"""Deterministic OCI images pushed to a plain-HTTP registry: what the
stand-in image builders (hack/critest/images.py, hack/node-e2e/images.py)
share. Tars have fixed mtimes and owners and configs a fixed creation time,
so building again gives the same digests and pushes nothing new.
"""
import gzip
import hashlib
import io
import json
import sys
import tarfile
import urllib.error
import urllib.request

MTIME = 1700000000
CREATED = "2023-11-14T22:13:20Z"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class Builder:
    """Blobs by digest, and the layers and images made of them. Images carry
    the label `label` (its value the image's marker) and `created_by` in
    their history."""

    def __init__(self, label, created_by, default_marker=""):
        self.blobs = {}
        self.label = label
        self.created_by = created_by
        self.default_marker = default_marker

    def put(self, data):
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[d] = data
        return d, len(data)

    def layer(self, entries):
        """A gzip layer of `entries`: ("dir", name, mode), ("sym", name,
        target), ("hard", name, target) or ("file", name, bytes, mode)."""
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
                elif kind == "sym":
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = e[2]
                    ti.mode = 0o777
                    t.addfile(ti)
                elif kind == "hard":
                    ti.type = tarfile.LNKTYPE
                    ti.linkname = e[2]
                    ti.mode = 0o755
                    t.addfile(ti)
                else:
                    ti.size = len(e[2])
                    ti.mode = e[3]
                    t.addfile(ti, io.BytesIO(e[2]))
        raw = buf.getvalue()
        gz = io.BytesIO()
        with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as g:
            g.write(raw)
        digest, size = self.put(gz.getvalue())
        return {"digest": digest, "size": size, "diff_id": "sha256:" + hashlib.sha256(raw).hexdigest()}

    def image(self, layers, cmd, user="", env=(), entrypoint=None, marker=""):
        """An image of `layers` (bottom first): its manifest and blobs."""
        cfg = {
            "architecture": "amd64", "os": "linux", "created": CREATED,
            "config": {"User": user, "Env": [PATH_ENV, *env], "Cmd": cmd, "WorkingDir": "/",
                       "Labels": {self.label: marker or self.default_marker}},
            "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
            "history": [{"created": CREATED, "created_by": self.created_by}],
        }
        if entrypoint:
            cfg["config"]["Entrypoint"] = entrypoint
        cd, cs = self.put(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
        m = {"schemaVersion": 2, "mediaType": MANIFEST,
             "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
             "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                         "digest": l["digest"], "size": l["size"]} for l in layers]}
        data = json.dumps(m, sort_keys=True, indent=2).encode()
        return {"data": data, "blobs": [cd] + [l["digest"] for l in layers]}

    def push(self, registry, plan, tag):
        """Pushes each (repository, tag, image) of `plan`, blobs the
        registry lacks first; logs each with `tag`."""
        pushed = set()
        for repo, ref, img in plan:
            for d in dict.fromkeys(img["blobs"]):
                if (repo, d) in pushed:
                    continue
                status, _ = req("HEAD", f"http://{registry}/v2/{repo}/blobs/{d}")
                if status != 200:
                    _, h = req("POST", f"http://{registry}/v2/{repo}/blobs/uploads/")
                    loc = h["Location"]
                    if not loc.startswith("http"):
                        loc = f"http://{registry}{loc}"
                    loc += ("&" if "?" in loc else "?") + "digest=" + d
                    req("PUT", loc, self.blobs[d], {"Content-Type": "application/octet-stream"})
                pushed.add((repo, d))
            req("PUT", f"http://{registry}/v2/{repo}/manifests/{ref}", img["data"],
                {"Content-Type": MANIFEST})
            print(f"[{tag}] {registry}/{repo}:{ref}", file=sys.stderr)


def req(method, url, data=None, headers=None):
    """One registry request: (status, headers); a HEAD's 404 is an answer."""
    r = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(r) as resp:  # noqa: S310 (the local registry)
            return resp.status, resp.headers
    except urllib.error.HTTPError as e:
        if method == "HEAD" and e.code == 404:
            return 404, e.headers
        raise
