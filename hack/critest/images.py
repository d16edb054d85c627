#!/usr/bin/env python3
"""Builds stand-ins for critest v1.36.0's test images from busybox-static and
the stand-in binary (standin.c), and pushes them to the local registry under
the repository paths critest names, so that a daemon whose hosts.toml mirrors
registry.k8s.io, k8s.gcr.io and gcr.io to that registry pulls them by their
upstream names.

Usage: images.py REGISTRY BUSYBOX STANDIN

Tars are deterministic (fixed mtimes and owners): re-running pushes nothing
new. The one image that cannot be stood in for is the one critest pulls by
its upstream digest (test-image-digest@sha256:9700...).
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from oci_images import Builder  # noqa: E402

registry, busybox, standin = sys.argv[1:4]
B = Builder("io.cubelet.critest-standin", "hack/critest/images.py", default_marker="yes")
layer, image = B.layer, B.image


PASSWD = (b"root:x:0:0:root:/root:/bin/sh\n"
          b"www-data:x:33:33:www-data:/var/www:/bin/sh\n"
          b"nobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
GROUP = b"root:x:0:\nwww-data:x:33:\nnogroup:x:65534:\n"

applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
bb = open(busybox, "rb").read()
base_entries = [("dir", "bin", 0o755), ("file", "bin/busybox", bb, 0o755)]
# Hard links, as busybox images have them: masking one applet's path (critest
# masks /bin/ls) must not mask the shell.
base_entries += [("hard", "bin/" + a, "bin/busybox") for a in sorted(set(applets)) if a != "busybox"]
base_entries += [
    ("dir", "etc", 0o755),
    ("file", "etc/passwd", PASSWD, 0o644),
    ("file", "etc/group", GROUP, 0o644),
    ("dir", "root", 0o700), ("dir", "tmp", 0o1777), ("dir", "home", 0o755),
    ("dir", "usr", 0o755), ("dir", "usr/sbin", 0o755), ("dir", "usr/local", 0o755),
    ("dir", "usr/local/bin", 0o755), ("dir", "var", 0o755), ("dir", "var/run", 0o755),
    ("dir", "var/www", 0o755), ("dir", "proc", 0o555), ("dir", "sys", 0o555), ("dir", "dev", 0o755),
]
# Debian's busybox has no pgrep and no ipcs applet; critest runs `pgrep sleep`
# and `ipcs -m`.
PGREP = b"""#!/bin/sh
# pgrep NAME: the pids of the processes named NAME (a stand-in).
found=1
for d in /proc/[0-9]*; do
    read -r comm <"$d/comm" 2>/dev/null || continue
    if [ "$comm" = "$1" ]; then echo "${d#/proc/}"; found=0; fi
done
exit $found
"""
IPCS = b"""#!/bin/sh
# ipcs -m: the System V shared memory segments (a stand-in).
cat /proc/sysvipc/shm
"""
base_entries += [("dir", "usr/bin", 0o755), ("file", "usr/bin/pgrep", PGREP, 0o755),
                 ("file", "usr/bin/ipcs", IPCS, 0o755)]
base = layer(base_entries)
sb = open(standin, "rb").read()
nginx = layer([("dir", "usr", 0o755), ("dir", "usr/sbin", 0o755), ("file", "usr/sbin/nginx", sb, 0o755)])
httpd = layer([("dir", "usr", 0o755), ("dir", "usr/local", 0o755), ("dir", "usr/local/bin", 0o755),
               ("file", "usr/local/bin/httpd", sb, 0o755)])
nnp = layer([("dir", "usr", 0o755), ("dir", "usr/local", 0o755), ("dir", "usr/local/bin", 0o755),
             ("file", "usr/local/bin/nonewprivs", sb, 0o4755)])
predefined = layer([
    ("dir", "etc", 0o755),
    ("file", "etc/passwd", PASSWD + b"default-user:x:1000:1000:default-user:/home/default-user:/bin/sh\n", 0o644),
    ("file", "etc/group", GROUP + b"default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n", 0o644),
    ("dir", "home/default-user", 0o755),
])


busybox_img = image([base], ["sh"])
nginx_img = image([base, nginx], ["nginx", "-g", "daemon off;"])
S = "k8s-staging-cri-tools/"
E = "e2e-test-images/"
# (repository, tag, image) in the local registry.
plan = [
    (E + "busybox", "1.29-2", busybox_img),
    (E + "nginx", "1.14-2", nginx_img),
    (E + "httpd", "2.4.39-4", image([base, httpd], ["/usr/local/bin/httpd"])),
    (E + "nonewprivs", "1.3", image([base, nnp], ["/usr/local/bin/nonewprivs"])),
    (S + "hostnet-nginx-amd64", "latest", image([base, nginx], ["nginx", "-g", "daemon off;"], env=["PORT=12003"])),
    (S + "test-image-user-uid", "latest", image([base], ["sh"], user="1002")),
    (S + "test-image-user-username", "latest", image([base], ["sh"], user="www-data")),
    (S + "test-image-user-uid-group", "latest", image([base], ["sh"], user="1003:1003")),
    (S + "test-image-user-username-group", "latest", image([base], ["sh"], user="www-data:33")),
    (S + "test-image-predefined-group", "latest", image([base, predefined], ["sh"], user="1000")),
    (S + "test-image-latest", "latest", image([base], ["sh"], marker="latest")),
    (S + "test-image-tag", "test", image([base], ["sh"], marker="tag-test")),
    (S + "test-image-tag", "all", image([base], ["sh"], marker="tag-all")),
    (S + "test-image-1", "latest", image([base], ["sh"], marker="1")),
    (S + "test-image-2", "latest", image([base], ["sh"], marker="2")),
    (S + "test-image-3", "latest", image([base], ["sh"], marker="3")),
]
tags_img = image([base], ["sh"], marker="tags")
plan += [(S + "test-image-tags", t, tags_img) for t in ("1", "2", "3")]
pause = image([base], ["sleep", "2147483647"], marker="pause")
plan.append(("pause", "3.9", pause))

B.push(registry, plan, "critest-images")
