#!/usr/bin/env python3
"""Checks the crate graph of docs/DESIGN.md against cargo metadata.

The design document's fenced ```crate-graph block lists every normal
dependency between the workspace's crates, one `a -> b` per line, and names
a crate with no such dependency alone on its line. This script reads the
workspace's packages from `cargo metadata --format-version 1 --no-deps` and
compares: internal dependencies only (a dependency whose name is a workspace
package), normal ones only (dev- and build-dependencies are left out). It
prints what each side has that the other lacks and exits 1 on any
difference, 2 when the block is missing or malformed.

Usage: hack/check-crate-graph.py [path/to/DESIGN.md]
"""

import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "DESIGN.md"

FENCE = re.compile(r"^```crate-graph\s*\n(.*?)^```\s*$", re.S | re.M)
EDGE = re.compile(r"^([A-Za-z0-9_-]+)\s*->\s*([A-Za-z0-9_-]+)$")
NODE = re.compile(r"^([A-Za-z0-9_-]+)$")


def die(msg):
    print(msg, file=sys.stderr)
    sys.exit(2)


def documented(path):
    """(crates, edges) of the crate-graph block in `path`."""
    text = path.read_text()
    blocks = FENCE.findall(text)
    if len(blocks) != 1:
        die(f"{path}: expected one ```crate-graph block, found {len(blocks)}")
    crates, edges = set(), set()
    for n, line in enumerate(blocks[0].splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if m := EDGE.match(line):
            edge = (m.group(1), m.group(2))
            if edge in edges:
                die(f"{path}: crate-graph line {n}: {line!r} is listed twice")
            edges.add(edge)
            crates.update(edge)
        elif m := NODE.match(line):
            crates.add(m.group(1))
        else:
            die(f"{path}: crate-graph line {n}: {line!r} is neither `a -> b` nor a crate name")
    return crates, edges


def actual():
    """(crates, edges) of the workspace as cargo metadata reports it."""
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout
    packages = json.loads(out)["packages"]
    crates = {p["name"] for p in packages}
    edges = set()
    for p in packages:
        for d in p["dependencies"]:
            # kind is null for normal dependencies, "dev" or "build" otherwise.
            if d["name"] in crates and d["kind"] is None:
                edges.add((p["name"], d["name"]))
    return crates, edges


def main():
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DESIGN
    doc_crates, doc_edges = documented(path)
    real_crates, real_edges = actual()
    rel = path.relative_to(REPO) if path.is_absolute() and REPO in path.parents else path
    problems = [
        (f"crates in the workspace missing from {rel}", real_crates - doc_crates),
        (f"crates in {rel} that the workspace does not have", doc_crates - real_crates),
        (f"dependencies in cargo metadata missing from {rel}",
         {f"{a} -> {b}" for a, b in real_edges - doc_edges}),
        (f"dependencies in {rel} that cargo metadata does not have",
         {f"{a} -> {b}" for a, b in doc_edges - real_edges}),
    ]
    failed = False
    for title, items in problems:
        if items:
            failed = True
            print(f"{title}:")
            for item in sorted(items):
                print(f"  {item}")
    if failed:
        return 1
    print(f"crate graph matches {rel}: {len(real_crates)} crates, {len(real_edges)} dependencies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
