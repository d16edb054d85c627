#!/usr/bin/env bash
# The chart checks: fetches the pinned helm (hack/helm.sh), then
# hack/check-chart.py runs `helm lint --strict` and `helm template` over
# every values set and checks the rendered objects.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
helm="$("$HACK_DIR/helm.sh")"
exec python3 "$HACK_DIR/check-chart.py" --helm "$helm"
