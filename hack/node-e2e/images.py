#!/usr/bin/env python3
"""Builds stand-ins for the images Kubernetes v1.28.7's node e2e suite pulls
(test/utils/image/manifest.go) and pushes them to the local registry under
the repository paths of registry.k8s.io, so that a runtime whose hosts.toml
mirrors registry.k8s.io to that registry pulls them by their upstream names:

  e2e-test-images/busybox:1.29-4       Debian's busybox-static, every applet a hard link
  e2e-test-images/agnhost:2.45         busybox + the agnhost binary given (/agnhost,
                                       ENTRYPOINT ["/agnhost"], CMD ["pause"]), the
                                       users/groups of the upstream image and, as it has,
                                       /localhost.crt and /localhost.key (here a key and
                                       self-signed certificate for localhost made by
                                       openssl for the run), and a curl stand-in
                                       (busybox wget: `curl URL` prints the body), which
                                       the lifecycle hook specs' exec hooks call
  e2e-test-images/nginx:1.14-4, 1.15-4 busybox + the stand-in server as /usr/sbin/nginx
  e2e-test-images/httpd:2.4.38-4, 2.4.39-4
                                       busybox + the stand-in server as /usr/local/bin/httpd
  e2e-test-images/nonewprivs:1.3       busybox + the stand-in as a setuid-root
                                       /usr/local/bin/nonewprivs ("Effective uid: N")
  e2e-test-images/nonroot:1.4          busybox, USER 1234
  pause:3.9                            the cubelet-pause binary (ENTRYPOINT ["/pause"]);
                                       pushed only when the registry has no pause:3.9
                                       (hack/critest/images.py pushes one of its own)

The stand-in server is hack/critest/standin.c (it serves HTTP 200 on $PORT,
default 80, and acts by the name it is installed under).

Usage: images.py REGISTRY BUSYBOX STANDIN AGNHOST PAUSE

Tars are deterministic (fixed mtimes and owners): re-running pushes nothing
new but agnhost's certificate layer. A dynamically linked agnhost gets the
libraries ldd names beside it.
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from oci_images import MANIFEST, Builder, req  # noqa: E402

registry, busybox, standin, agnhost, pause_bin = sys.argv[1:6]
B = Builder("io.cubelet.node-e2e-standin", "hack/node-e2e/images.py")
layer, image = B.layer, B.image


def dirs_of(path):
    """The parent directories of path, outermost first (no leading /)."""
    parts = path.strip("/").split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


PASSWD = (b"root:x:0:0:root:/root:/bin/sh\n"
          b"nobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
GROUP = b"root:x:0:\nnogroup:x:65534:\n"

applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
bb = open(busybox, "rb").read()
base_entries = [("dir", "bin", 0o755), ("file", "bin/busybox", bb, 0o755)]
# Hard links, as the upstream busybox image has them.
base_entries += [("hard", "bin/" + a, "bin/busybox") for a in sorted(set(applets)) if a != "busybox"]
base_entries += [
    ("dir", "etc", 0o755),
    ("file", "etc/passwd", PASSWD, 0o644),
    ("file", "etc/group", GROUP, 0o644),
    ("dir", "root", 0o700), ("dir", "tmp", 0o1777), ("dir", "home", 0o755),
    ("dir", "usr", 0o755), ("dir", "usr/bin", 0o755), ("dir", "usr/sbin", 0o755),
    ("dir", "usr/local", 0o755), ("dir", "usr/local/bin", 0o755), ("dir", "var", 0o755),
    ("dir", "var/run", 0o755), ("dir", "var/www", 0o755), ("dir", "proc", 0o555),
    ("dir", "sys", 0o555), ("dir", "dev", 0o755),
]
base = layer(base_entries)
sb = open(standin, "rb").read()
nginx = layer([("dir", "usr", 0o755), ("dir", "usr/sbin", 0o755), ("file", "usr/sbin/nginx", sb, 0o755)])
httpd = layer([("dir", "usr", 0o755), ("dir", "usr/local", 0o755), ("dir", "usr/local/bin", 0o755),
               ("file", "usr/local/bin/httpd", sb, 0o755)])
nnp = layer([("dir", "usr", 0o755), ("dir", "usr/local", 0o755), ("dir", "usr/local/bin", 0o755),
             ("file", "usr/local/bin/nonewprivs", sb, 0o4755)])

CURL = b"""#!/bin/sh
# curl [options] URL: GETs URL and prints the body (a stand-in on busybox wget;
# options are ignored).
url=""
for a in "$@"; do
    case "$a" in -*) ;; *) url="$a" ;; esac
done
exec wget -q -O - "$url"
"""

# agnhost: the binary, its libraries when it is dynamically linked, and
# the users and groups the upstream image adds (adduser -u 1000, addgroup -g 50000).
agn = [("file", "agnhost", open(agnhost, "rb").read(), 0o755), ("sym", "agnhost-2", "agnhost"),
       ("dir", "uploads", 0o777),
       ("dir", "etc", 0o755),
       ("file", "etc/passwd", PASSWD + b"user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n", 0o644),
       ("file", "etc/group", GROUP + b"user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n", 0o644),
       ("dir", "home", 0o755), ("dir", "home/user-defined-in-image", 0o755),
       ("dir", "usr", 0o755), ("dir", "usr/bin", 0o755), ("file", "usr/bin/curl", CURL, 0o755)]
ldd = subprocess.run(["ldd", agnhost], capture_output=True, text=True)
libs = []
if ldd.returncode == 0:
    for line in ldd.stdout.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0] if words and words[0].startswith("/") else None
        if path and os.path.isfile(path):
            libs.append(path)
seen = {e[1] for e in agn}
for lib in libs:
    for d in dirs_of(lib):
        if d not in seen:
            agn.append(("dir", d, 0o755))
            seen.add(d)
    real = os.path.realpath(lib)
    agn.append(("file", lib.lstrip("/"), open(real, "rb").read(), 0o755))
with tempfile.TemporaryDirectory() as tmp:
    # netexec --tls-cert-file /localhost.crt (the lifecycle hook specs' HTTPS server).
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", f"{tmp}/localhost.key", "-out", f"{tmp}/localhost.crt"],
                   check=True, capture_output=True)
    certs = layer([("file", "localhost.crt", open(f"{tmp}/localhost.crt", "rb").read(), 0o644),
                   ("file", "localhost.key", open(f"{tmp}/localhost.key", "rb").read(), 0o644)])
agnhost_layer = layer(agn)


E = "e2e-test-images/"
nginx_img = image([base, nginx], ["nginx", "-g", "daemon off;"], marker="nginx")
httpd_img = image([base, httpd], ["httpd"], marker="httpd")
plan = [
    (E + "busybox", "1.29-4", image([base], ["sh"], marker="busybox")),
    (E + "agnhost", "2.45", image([base, agnhost_layer, certs], ["pause"], entrypoint=["/agnhost"], marker="agnhost")),
    (E + "nginx", "1.14-4", nginx_img),
    (E + "nginx", "1.15-4", nginx_img),
    (E + "httpd", "2.4.38-4", httpd_img),
    (E + "httpd", "2.4.39-4", httpd_img),
    (E + "nonewprivs", "1.3", image([base, nnp], ["nonewprivs"], marker="nonewprivs")),
    (E + "nonroot", "1.4", image([base], ["sh"], user="1234", marker="nonroot")),
]
pause_layer = layer([("file", "pause", open(pause_bin, "rb").read(), 0o755)])
pause_img = image([pause_layer], None, entrypoint=["/pause"], marker="pause")

status, _ = req("HEAD", f"http://{registry}/v2/pause/manifests/3.9", headers={"Accept": MANIFEST})
if status != 200:
    plan.append(("pause", "3.9", pause_img))

B.push(registry, plan, "node-e2e-images")
