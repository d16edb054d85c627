#!/usr/bin/env python3
"""Push an OCI image layout (one manifest, hack/build-installer-image.sh)
to a plain-HTTP registry through the distribution API, as REPO:TAG.

Usage: push-oci.py LAYOUT REGISTRY REPO TAG
"""
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path


def req(method, url, data=None, headers=None):
    r = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(r, timeout=120) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers


def main():
    layout, registry, repo, tag = sys.argv[1:5]
    layout = Path(layout)
    base = f"http://{registry}/v2/{repo}"
    index = json.loads((layout / "index.json").read_text())
    mdesc = index["manifests"][0]
    blob = lambda d: layout / "blobs" / d.split(":")[0] / d.split(":")[1]  # noqa: E731
    manifest = json.loads(blob(mdesc["digest"]).read_text())
    for desc in [manifest["config"], *manifest["layers"]]:
        digest = desc["digest"]
        if req("HEAD", f"{base}/blobs/{digest}")[0] == 200:
            continue
        status, headers = req("POST", f"{base}/blobs/uploads/")
        if status != 202:
            sys.exit(f"POST {base}/blobs/uploads/: HTTP {status}")
        loc = headers["Location"]
        if loc.startswith("/"):
            loc = f"http://{registry}{loc}"
        sep = "&" if "?" in loc else "?"
        status, _ = req("PUT", f"{loc}{sep}digest={digest}", blob(digest).read_bytes(),
                        {"Content-Type": "application/octet-stream"})
        if status != 201:
            sys.exit(f"PUT blob {digest}: HTTP {status}")
    status, _ = req("PUT", f"{base}/manifests/{tag}", blob(mdesc["digest"]).read_bytes(),
                    {"Content-Type": mdesc["mediaType"]})
    if status != 201:
        sys.exit(f"PUT manifest {repo}:{tag}: HTTP {status}")
    print(f"pushed {registry}/{repo}:{tag} ({mdesc['digest']})")


main()
