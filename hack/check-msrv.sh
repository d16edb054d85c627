#!/usr/bin/env bash
# The declared minimum Rust version (`rust-version` of the workspace), held
# two ways:
#  1. every locked dependency that declares a `rust-version` declares one no
#     newer than ours (cargo metadata, offline): a dependency that needs a
#     newer compiler makes our declaration false whatever our own code does;
#  2. when a toolchain of exactly that version is installed (rustup), the
#     workspace is checked with it; otherwise a SKIP line says so (this CI
#     machine has one toolchain and cannot download another).
# Our own code's use of std APIs newer than `rust-version` is clippy's
# `incompatible_msrv` lint, which `cargo clippy -D warnings` already runs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

msrv="$(cargo metadata --format-version 1 --locked --no-deps | python3 -c '
import json, sys
versions = {p["rust_version"] for p in json.load(sys.stdin)["packages"]}
if len(versions) != 1 or None in versions:
    sys.exit(f"workspace members declare rust-version {sorted(map(str, versions))}: want one")
print(versions.pop())
')"
log "rust-version ${msrv}: dependencies"
cargo metadata --format-version 1 --locked | python3 -c '
import json, sys
msrv = sys.argv[1]
def key(v):
    parts = [int(x) for x in v.split(".")]
    return parts + [0] * (3 - len(parts))
meta = json.load(sys.stdin)
members = set(meta["workspace_members"])
newer = sorted((p["name"], p["version"], p["rust_version"]) for p in meta["packages"]
               if p["id"] not in members and p.get("rust_version")
               and key(p["rust_version"]) > key(msrv))
for name, version, needs in newer:
    print(f"  {name} {version} needs rustc {needs}", file=sys.stderr)
if newer:
    sys.exit(f"{len(newer)} locked dependencies need a newer rustc than rust-version {msrv}")
print(f"every locked dependency builds with rustc {msrv} by its own declaration")
' "$msrv"

toolchain="$(rustup toolchain list 2>/dev/null | awk -v v="$msrv" '
    { name = $1; sub(/-.*/, "", name) }
    name == v || index(name, v ".") == 1 { print $1; exit }')"
if [[ -z "$toolchain" ]]; then
    log "SKIP msrv build: no Rust ${msrv} toolchain installed (rustup toolchain install ${msrv}); installed: $(rustup toolchain list 2>/dev/null | awk '{print $1}' | paste -sd' ')"
    exit 0
fi
log "rust-version ${msrv}: cargo +${toolchain} check --workspace --all-targets"
cargo "+${toolchain}" check --workspace --all-targets --locked --features cubelet/failpoints
