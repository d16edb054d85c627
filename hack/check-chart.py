#!/usr/bin/env python3
"""Checks of the cubelet Helm chart, rendered by the real helm.

Run by hack/check-chart.sh, which fetches helm v3.16.4 (hack/helm.sh) and
passes it as `--helm PATH`. Checks, one result line per item:
  * Chart.yaml, values.yaml and every JSON file of the chart parse;
  * Chart.yaml has apiVersion v2, name, version and appVersion;
  * values.schema.json is a valid draft-07 schema, values.yaml satisfies it,
    it covers every key of values.yaml, and it rejects bad values (enums,
    unknown keys);
  * every `.Values.x.y` path used in templates exists in values.yaml;
  * every `include` names a defined template and every `.Files.Get` an
    existing file;
  * `helm lint --strict` passes under every values set below, and every
    manifest template renders (`helm template`) to objects with apiVersion,
    kind and metadata.name;
  * the dashboard queries only known metric names and has a panel for each
    metric the chart promises;
  * charts/cubelet/files/cubelet.service and hack/cubelet.service are
    identical and carry the required directives;
  * the installer scripts pass `sh -n`, and install.sh / uninstall.sh do
    their job against a scratch "host" directory with nsenter, systemctl and
    wget stubbed (nothing on this machine is touched);
  * README.md documents every value;
  * rendered by `helm template` under several values sets, with `lookup`
    answered by a stand-in API server on 127.0.0.1 that knows only sample
    Nodes and Namespaces (`--dry-run=server`; NOTES.txt from `helm install
    --dry-run=server -o json` against the same stand-in): the DaemonSet's and
    the Service's selectors select the installer pods and never the `helm
    test` Pod or the uninstall Job pods; the pre-delete Jobs run on exactly
    the nodes the DaemonSet ran installers on (node selector, node affinity
    and taints/tolerations matched the way the DaemonSet controller, the
    scheduler and kubelet do, for nodes with and without the labels, with
    empty and other values, and with tolerated and untolerated
    NoSchedule/NoExecute taints), with the DaemonSet's nodeSelector,
    affinity and tolerations; the namespace option creates a Namespace
    labelled PodSecurity privileged, NOTES.txt states the requirement and
    warns about a baseline namespace; the installer and uninstall containers
    run as root explicitly.

The last line is `N passed, M failed`; the exit status is 1 if anything
failed. Needs python3-yaml and python3-jsonschema (Debian packages).
"""

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

try:
    import jsonschema
    import yaml
except ImportError as err:  # pragma: no cover - environment problem
    sys.stderr.write(
        f"check-chart: {err}; install python3-yaml and python3-jsonschema\n"
    )
    sys.exit(2)

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "cubelet"
TEMPLATES = CHART / "templates"
UNIT_IN_CHART = CHART / "files" / "cubelet.service"
UNIT_IN_HACK = ROOT / "hack" / "cubelet.service"
HELM_VERSION = "v3.16.4"

# Metric names of docs/DESIGN.md ("Metrics") plus the GC, event and storage
# metrics the daemon also exports.
KNOWN_METRICS = {
    "cubelet_flow_duration_seconds",
    "cubelet_flow_step_duration_seconds",
    "cubelet_flow_rejections_total",
    "cubelet_flow_inflight",
    "cubelet_flow_limit",
    "cubelet_flow_rollbacks_total",
    "cubelet_cri_requests_total",
    "cubelet_cri_request_duration_seconds",
    "cubelet_sandboxes",
    "cubelet_gc_reclaimed_total",
    "cubelet_build_info",
    "cubelet_gc_runs_total",
    "cubelet_gc_failures_total",
    "cubelet_gc_pending",
    "cubelet_events_dropped_total",
    "cubelet_storage_pool_total",
}
HISTOGRAMS = {
    "cubelet_flow_duration_seconds",
    "cubelet_flow_step_duration_seconds",
    "cubelet_cri_request_duration_seconds",
}
# Metrics the dashboard must chart (the panels promised in the chart README).
DASHBOARD_REQUIRED = [
    "cubelet_flow_duration_seconds_bucket",
    "cubelet_flow_step_duration_seconds_bucket",
    "cubelet_flow_rejections_total",
    "cubelet_flow_inflight",
    "cubelet_flow_limit",
    "cubelet_flow_rollbacks_total",
    "cubelet_gc_reclaimed_total",
    "cubelet_cri_requests_total",
    "cubelet_cri_request_duration_seconds_bucket",
]

# (section, key, value): value None means "present"; a list means "the
# space-separated value of the key, over all its lines, contains these".
UNIT_DIRECTIVES = [
    ("Unit", "After", ["network-online.target", "containerd.service"]),
    ("Unit", "Wants", ["containerd.service"]),
    ("Service", "Type", "notify"),
    ("Service", "NotifyAccess", "main"),
    ("Service", "WatchdogSec", "30s"),
    # Start reconciles every pod before READY=1: 90 s killed it under load.
    ("Service", "TimeoutStartSec", "600"),
    ("Service", "ExecStart", "/opt/cubelet/bin/cubelet --config /etc/cubelet/config.yaml"),
    ("Service", "Delegate", "yes"),
    ("Service", "KillMode", "process"),
    ("Service", "LimitNOFILE", "1048576"),
    ("Service", "OOMScoreAdjust", "-999"),
    ("Service", "Restart", "always"),
    ("Service", "RestartSec", "5"),
    ("Install", "WantedBy", "multi-user.target"),
]

# Values maps whose keys are the user's (not documented one by one).
OPEN_MAPS = {
    "resources",
    "nodeSelector",
    "config.runtime.handlers",
    "config.flows",
}

ACTION_RE = re.compile(r"\{\{.*?\}\}", re.S)
COMMENT_RE = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.S)
VALUES_RE = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
INCLUDE_RE = re.compile(r"\b(?:include|template)\s+\"([^\"]+)\"")
DEFINE_RE = re.compile(r"\{\{-?\s*define\s+\"([^\"]+)\"")
FILES_GET_RE = re.compile(r"\.Files\.Get\s+\"([^\"]+)\"")
METRIC_RE = re.compile(r"\bcubelet_[a-z0-9_]+")


class Report:
    """Collects one pass/fail line per checked item."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"PASS {name}")
        else:
            self.failed += 1
            print(f"FAIL {name}: {detail}")
        return ok


def rel(path):
    return str(path.relative_to(ROOT))


def load_yaml(report, path):
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        report.check(f"{rel(path)} parses as YAML", False, str(err))
        return None
    report.check(f"{rel(path)} parses as YAML", isinstance(data, dict), "not a mapping")
    return data if isinstance(data, dict) else None


def load_json(report, path):
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        report.check(f"{rel(path)} parses as JSON", False, str(err))
        return None
    report.check(f"{rel(path)} parses as JSON", True)
    return data


def coalesce_values(base, override):
    """Helm's merge of user values into the chart's: maps merge, null deletes,
    anything else replaces."""
    out = copy.deepcopy(base)
    for key, val in (override or {}).items():
        if val is None:
            out.pop(key, None)
        elif isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = coalesce_values(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def check_chart_yaml(report, chart):
    if chart is None:
        report.check("Chart.yaml fields", False, "Chart.yaml did not parse")
        return
    report.check("Chart.yaml apiVersion is v2", chart.get("apiVersion") == "v2",
                 f"got {chart.get('apiVersion')!r}")
    report.check("Chart.yaml name is cubelet", chart.get("name") == CHART.name,
                 f"got {chart.get('name')!r}")
    version = str(chart.get("version", ""))
    report.check("Chart.yaml version is SemVer",
                 re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?", version) is not None,
                 f"got {version!r}")
    report.check("Chart.yaml appVersion is set", bool(str(chart.get("appVersion", "")).strip()),
                 "missing")


def schema_gaps(values, schema, prefix=""):
    """Dotted values paths that the schema does not describe."""
    gaps = []
    if not isinstance(values, dict):
        return gaps
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, val in values.items():
        path = f"{prefix}{key}"
        if key in props:
            gaps += schema_gaps(val, props[key], path + ".")
        elif isinstance(extra, dict):
            gaps += schema_gaps(val, extra, path + ".")
        elif extra is False:
            gaps.append(path)
    return gaps


def check_schema(report, values, schema):
    if values is None or schema is None:
        report.check("values.yaml validates against values.schema.json", False,
                     "values.yaml or values.schema.json did not parse")
        return
    try:
        jsonschema.Draft7Validator.check_schema(schema)
        report.check("values.schema.json is a valid draft-07 schema", True)
    except jsonschema.SchemaError as err:
        report.check("values.schema.json is a valid draft-07 schema", False, err.message)
        return
    report.check("values.schema.json declares draft-07",
                 schema.get("$schema", "").startswith("http://json-schema.org/draft-07/schema"),
                 f"got {schema.get('$schema')!r}")
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(values), key=lambda e: list(e.path))
    report.check("values.yaml validates against values.schema.json", not errors,
                 "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors))
    for key in values:
        gaps = schema_gaps({key: values[key]}, schema)
        report.check(f"values.schema.json covers values.{key}", not gaps,
                     "not in schema: " + ", ".join(gaps))

    def rejects(name, mutate):
        bad = copy.deepcopy(values)
        mutate(bad)
        report.check(f"values.schema.json rejects {name}", not validator.is_valid(bad),
                     "accepted")

    rejects("network.provider=foo", lambda v: v["config"]["network"].__setitem__("provider", "foo"))
    rejects("runtime.cgroup_driver=foo",
            lambda v: v["config"]["runtime"].__setitem__("cgroup_driver", "foo"))
    rejects("an unknown top-level key", lambda v: v.__setitem__("bogus", 1))
    rejects("an unknown config key", lambda v: v["config"].__setitem__("bogus", 1))
    rejects("a flow without steps", lambda v: v["config"]["flows"]["create"].pop("steps"))
    rejects("image.pullPolicy=Sometimes", lambda v: v["image"].__setitem__("pullPolicy", "Sometimes"))
    rejects("podLabels overriding the selector's component label",
            lambda v: v["podLabels"].__setitem__("app.kubernetes.io/component", "x"))
    rejects("namespace.name that is not a DNS label",
            lambda v: v["namespace"].__setitem__("name", "Cubelet_System"))
    rejects("kubelet.switchRuntime as a string",
            lambda v: v["kubelet"].__setitem__("switchRuntime", "yes"))


def template_files():
    files = sorted(TEMPLATES.rglob("*.yaml")) + sorted(TEMPLATES.rglob("*.tpl"))
    notes = TEMPLATES / "NOTES.txt"
    if notes.exists():
        files.append(notes)
    return files


def actions(text):
    return ACTION_RE.findall(COMMENT_RE.sub("", text))


def lookup_path(values, parts):
    node = values
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return ".".join(parts[: i + 1])
        node = node[part]
    return None


def check_values_paths(report, values, templates):
    used = {}
    for path in templates:
        for action in actions(path.read_text()):
            for match in VALUES_RE.finditer(action):
                used.setdefault(match.group(1)[1:], set()).add(path.name)
    report.check("templates use .Values at all", bool(used), "no .Values found")
    for dotted in sorted(used):
        missing = lookup_path(values or {}, dotted.split("."))
        where = ", ".join(sorted(used[dotted]))
        report.check(f".Values.{dotted} exists in values.yaml ({where})", missing is None,
                     f"no values.{missing}")


def check_includes_and_files(report, templates):
    defined = set()
    for path in templates:
        defined.update(DEFINE_RE.findall(path.read_text()))
    included, got = {}, {}
    for path in templates:
        for action in actions(path.read_text()):
            for name in INCLUDE_RE.findall(action):
                included.setdefault(name, set()).add(path.name)
            for name in FILES_GET_RE.findall(action):
                got.setdefault(name, set()).add(path.name)
    for name in sorted(included):
        report.check(f'include "{name}" is defined', name in defined, "no such define")
    for name in sorted(got):
        report.check(f'.Files.Get "{name}" exists in the chart', (CHART / name).is_file(),
                     f"no file {rel(CHART / name)}")

def dashboard_exprs(node):
    if isinstance(node, dict):
        for key, val in node.items():
            if key in ("expr", "query", "definition") and isinstance(val, str):
                yield val
            elif isinstance(val, dict) and key == "query" and isinstance(val.get("query"), str):
                yield val["query"]
            else:
                yield from dashboard_exprs(val)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def known_metric(name):
    if name in KNOWN_METRICS:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return True
    return False


def check_dashboard(report, path, dash):
    if dash is None:
        return
    names = {}
    for expr in dashboard_exprs(dash):
        for name in METRIC_RE.findall(expr):
            names[name] = names.get(name, 0) + 1
    report.check(f"{rel(path)} has queries", bool(names), "no cubelet_* metric in any expr")
    for name in sorted(names):
        report.check(f"{rel(path)} metric {name} is known", known_metric(name),
                     "not a Cubelet metric (docs/DESIGN.md, Metrics)")
    for name in DASHBOARD_REQUIRED:
        report.check(f"{rel(path)} charts {name}", name in names, "no panel queries it")
    panels = dash.get("panels", [])
    ids = [p.get("id") for p in panels]
    report.check(f"{rel(path)} panel ids are unique", len(ids) == len(set(ids)), f"ids {ids}")
    empty = [p.get("title") for p in panels if p.get("type") != "row" and not p.get("targets")]
    report.check(f"{rel(path)} every panel has a query", not empty, f"no targets: {empty}")


def parse_unit(text):
    sections, current = {}, None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, val = line.partition("=")
        if current is not None:
            current.setdefault(key.strip(), []).append(val.strip())
    return sections


def check_units(report):
    for path in (UNIT_IN_CHART, UNIT_IN_HACK):
        report.check(f"{rel(path)} exists", path.is_file(), "missing")
    if not (UNIT_IN_CHART.is_file() and UNIT_IN_HACK.is_file()):
        return
    chart_text = UNIT_IN_CHART.read_bytes()
    report.check(f"{rel(UNIT_IN_HACK)} is identical to {rel(UNIT_IN_CHART)}",
                 chart_text == UNIT_IN_HACK.read_bytes(), "the files differ")
    unit = parse_unit(chart_text.decode())
    for section, key, want in UNIT_DIRECTIVES:
        got = unit.get(section, {}).get(key, [])
        if isinstance(want, list):
            words = " ".join(got).split()
            ok = all(w in words for w in want)
            label = f"{key} includes {' '.join(want)}"
        else:
            ok = bool(got) and got[-1] == want
            label = f"{key}={want}"
        report.check(f"cubelet.service [{section}] {label}", ok, f"got {got}")


def check_scripts(report):
    for path in sorted((CHART / "files").glob("*.sh")):
        proc = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True, check=False)
        report.check(f"{rel(path)} passes sh -n", proc.returncode == 0, proc.stderr.strip())


# Stands in for nsenter: runs the command after "--" with every absolute
# path argument moved under $FAKE_HOST, and only logs systemctl/journalctl.
NSENTER_STUB = """#!/bin/sh
while [ "$1" != "--" ]; do shift; done
shift
case "$1" in
systemctl | journalctl | ip | nft)
	echo "$*" >>"$FAKE_LOG"
	case "$*" in *is-active*cubelet-uninstall*) exit 3 ;; esac
	exit 0
	;;
systemd-run)
	# Runs the unit's command at once, with its --setenv variables (not
	# PATH: the stubs stay first).
	echo "systemd-run" >>"$FAKE_LOG"
	shift
	while [ $# -gt 0 ]; do
		case $1 in
		--setenv) case $2 in PATH=*) ;; *) export "$2" ;; esac; shift 2 ;;
		--*) shift 2 ;;
		*) break ;;
		esac
	done
	exec sh "$FAKE_HOST$2" "$3"
	;;
esac
cmd=$1
shift
n=$#
for a; do
	case $a in /*) a="$FAKE_HOST$a" ;; esac
	set -- "$@" "$a"
done
shift "$n"
exec "$cmd" "$@"
"""

# Stands in for the host's crictl: `pods -q` prints $FAKE_PODS_IDS, `pods
# --label ...` $FAKE_PODS_INSTALLER and `pods` $FAKE_PODS_JSON (files the
# checks write: ids, then crictl's JSON); stopp and rmp are logged in
# $FAKE_CRICTL_LOG.
CRICTL_STUB = """#!/bin/sh
show() { if [ -f "$1" ]; then cat "$1"; fi; }
case " $* " in
*" pods "*"-q "*) show "$FAKE_PODS_IDS" ;;
*" pods "*"--label "*) show "$FAKE_PODS_INSTALLER" ;;
*" pods "*) show "$FAKE_PODS_JSON" ;;
*" stopp "* | *" rmp "*) echo "$*" >>"$FAKE_CRICTL_LOG" ;;
esac
exit 0
"""


def pods_json(*pods):
    """crictl pods -o json of (namespace, name, uid, labels, annotations)."""
    items = [{"id": f"id-{name}", "metadata": {"name": name, "uid": uid, "namespace": ns, "attempt": 0},
              "state": "SANDBOX_READY", "labels": labels, "annotations": annotations}
             for ns, name, uid, labels, annotations in pods]
    return json.dumps({"items": items}, indent=2) + "\n"


WEB_POD = ("default", "web-1", "uid-web", {"app": "web"}, {"kubernetes.io/config.source": "api"})
DS_POD = ("kube-system", "proxy-x", "uid-proxy", {"pod-template-generation": "1"},
          {"kubernetes.io/config.source": "api"})
STATIC_POD = ("kube-system", "etcd-node", "uid-etcd", {}, {"kubernetes.io/config.source": "file"})
INSTALLER_POD = ("cubelet-system", "cubelet-x", "uid-installer",
                 {"pod-template-generation": "1", "app.kubernetes.io/component": "installer"}, {})
UNINSTALL_POD = ("cubelet-system", "cubelet-uninstall-x", "uid-job",
                 {"app.kubernetes.io/component": "uninstall"}, {})


class Scratch:
    """A scratch host tree plus stubs for running the installer scripts."""

    def __init__(self, base):
        self.base = Path(base)
        self.host = self.base / "host"
        self.log = self.base / "systemctl.log"
        # stubs/: wget answers; stubs-down/: it never does.
        for name, wget_status in (("stubs", 0), ("stubs-down", 1)):
            stubs = self.base / name
            stubs.mkdir()
            (stubs / "nsenter").write_text(NSENTER_STUB)
            (stubs / "wget").write_text(f"#!/bin/sh\nexit {wget_status}\n")
            (stubs / "crictl").write_text(CRICTL_STUB)
            # No kubelet runs in the box (the machine's own must not be seen).
            # $FAKE_KUBELET_PID when set: a process whose command line names
            # the runtime endpoint.
            (stubs / "pidof").write_text('#!/bin/sh\n[ -n "${FAKE_KUBELET_PID:-}" ] || exit 1\n'
                                         'echo "$FAKE_KUBELET_PID"\n')
            for stub in stubs.iterdir():
                stub.chmod(0o755)
        stubs = self.base / "stubs"
        image = self.base / "image"
        image.mkdir()
        (image / "cubelet").write_text("cubelet v1\n")
        (image / "cubelet-pause").write_text("pause v1\n")
        self.scripts = self.base / "scripts"
        self.scripts.mkdir()
        (self.scripts / "config.yaml").write_text("socket: /run/cubelet/cubelet.sock\n")
        (self.scripts / "cubelet.service").write_bytes(UNIT_IN_CHART.read_bytes())
        (self.scripts / "kubelet-runtime.conf").write_text("[Service]\nExecStart=\n")
        for sub in ("opt/cubelet/bin", "etc/cubelet", "etc/systemd/system", "var/lib/test-cubelet-check"):
            (self.host / sub).mkdir(parents=True)
        self.env = dict(
            os.environ,
            PATH=f"{stubs}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            FAKE_HOST=str(self.host), FAKE_LOG=str(self.log),
            HOST_ROOT=str(self.host), CONFIG_SRC=str(self.scripts),
            CUBELET_IMAGE_BIN_DIR=str(image),
            CUBELET_BIN_DIR="/opt/cubelet/bin", CUBELET_CONFIG_DIR="/etc/cubelet",
            CUBELET_SYSTEMD_DIR="/etc/systemd/system",
            CUBELET_READYZ_URL="http://127.0.0.1:9385/readyz", CUBELET_READY_TIMEOUT="4",
            KUBELET_SWITCH_RUNTIME="false", KUBELET_SERVICE="kubelet",
            KUBELET_DROPIN="/etc/systemd/system/kubelet.service.d/99-cubelet-runtime.conf",
            CUBELET_PURGE_STATE="true", CUBELET_ROOT_DIR="/var/lib/test-cubelet-check",
            CUBELET_STATE_DIR="/run/test-cubelet-check",
            CUBELET_SOCKET="/run/cubelet/cubelet.sock", CUBELET_BRIDGE="test-cbl0", POD_UID="uid-installer",
            POD_NAMESPACE="cubelet-system",
            FAKE_PODS_IDS=str(self.base / "pods-ids"), FAKE_PODS_JSON=str(self.base / "pods.json"),
            FAKE_PODS_INSTALLER=str(self.base / "pods-installer.json"),
            FAKE_CRICTL_LOG=str(self.base / "crictl.log"),
        )

    def calls(self):
        """systemctl calls since the last look."""
        text = self.log.read_text() if self.log.exists() else ""
        self.log.write_text("")
        return text.splitlines()

    def run(self, script, until=None, **env):
        """Run a script; with `until`, stop it (SIGTERM to its group) once
        that line is printed. Returns (exit status, output)."""
        out = self.base / "out.txt"
        with open(out, "w") as sink:
            proc = subprocess.Popen(["sh", str(CHART / "files" / script)],
                                    env={**self.env, **env}, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline:
                if until and until in out.read_text():
                    os.killpg(proc.pid, signal.SIGTERM)
                    break
                time.sleep(0.05)
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
        return code, out.read_text()


def check_installer_scripts(report):
    with tempfile.TemporaryDirectory(prefix="check-chart-") as tmp:
        box = Scratch(tmp)
        host = box.host
        code, out = box.run("install.sh", until="sleeping")
        calls = box.calls()
        report.check("install.sh installs and sleeps until SIGTERM", code == 0 and "sleeping" in out,
                     f"exit {code}: {out[-300:]}")
        installed = [host / "opt/cubelet/bin/cubelet", host / "opt/cubelet/bin/cubelet-pause",
                     host / "etc/cubelet/config.yaml", host / "etc/systemd/system/cubelet.service"]
        report.check("install.sh copies binaries, config and unit to the host",
                     all(p.is_file() for p in installed), f"missing {[str(p) for p in installed if not p.is_file()]}")
        report.check("install.sh makes the binaries executable",
                     all(os.access(p, os.X_OK) for p in installed[:2]), "not executable")
        report.check("install.sh reloads, enables and restarts cubelet on change",
                     calls[:3] == ["systemctl daemon-reload", "systemctl enable cubelet",
                                   "systemctl restart cubelet"], f"calls {calls}")
        code, out = box.run("install.sh", until="sleeping")
        calls = box.calls()
        report.check("install.sh re-run changes nothing and runs enable --now",
                     code == 0 and "installed /" not in out
                     and calls == ["systemctl daemon-reload", "systemctl enable --now cubelet"],
                     f"exit {code}, calls {calls}")
        pending = host / "etc/cubelet/restart-pending"
        pending.write_text("")
        code, out = box.run("install.sh", until="sleeping")
        calls = box.calls()
        report.check("install.sh restarts cubelet after an installer killed between copy and restart",
                     code == 0 and "systemctl restart cubelet" in calls and not pending.exists(),
                     f"exit {code}, calls {calls}: {out[-300:]}")
        retired = host / "run/cubelet-uninstall/retired/uid-installer"
        retired.mkdir(parents=True)
        (host / "opt/cubelet/bin/cubelet").unlink()
        code, out = box.run("install.sh", until="sleeping")
        calls = box.calls()
        report.check("install.sh in an installer pod helm uninstall retired installs nothing",
                     code == 0 and "retired" in out and not calls
                     and not (host / "opt/cubelet/bin/cubelet").exists(), f"exit {code}, calls {calls}: {out[-300:]}")
        retired.rmdir()
        box.run("install.sh", until="sleeping")
        box.calls()

        dropin = host / "etc/systemd/system/kubelet.service.d/99-cubelet-runtime.conf"
        (box.base / "pods.json").write_text(pods_json(WEB_POD, DS_POD, STATIC_POD, UNINSTALL_POD))
        code, out = box.run("install.sh", until="drain the node first", KUBELET_SWITCH_RUNTIME="true")
        calls = box.calls()
        report.check("install.sh with switchRuntime refuses an undrained node, naming its pods",
                     "drain the node first" in out and "default/web-1" in out and "proxy-x" not in out
                     and "etcd-node" not in out and not dropin.exists()
                     and "systemctl restart kubelet" not in calls, f"calls {calls}: {out[-400:]}")
        (box.base / "pods.json").write_text(pods_json(DS_POD, STATIC_POD))
        code, out = box.run("install.sh", until="sleeping", KUBELET_SWITCH_RUNTIME="true")
        calls = box.calls()
        previous = host / "etc/cubelet/kubelet-previous-endpoint"
        report.check("install.sh with switchRuntime on a drained node writes the drop-in, restarts kubelet, exits",
                     code == 0 and dropin.is_file() and "systemctl restart kubelet" in calls
                     and "sleeping" not in out, f"exit {code}, calls {calls}: {out[-300:]}")
        report.check("install.sh records kubelet's previous runtime endpoint",
                     previous.is_file() and previous.read_text().strip() == "unix:///run/containerd/containerd.sock",
                     f"{previous.read_text() if previous.exists() else 'missing'}")
        kubelet = subprocess.Popen(["sh", "-c", "sleep 60", "kubelet",
                                    "--container-runtime-endpoint=unix:///run/cubelet/cubelet.sock"])
        try:
            (box.base / "pods-ids").write_text("old-1\nold-2\n")
            code, out = box.run("install.sh", until="sleeping", KUBELET_SWITCH_RUNTIME="true",
                                FAKE_KUBELET_PID=str(kubelet.pid))
        finally:
            kubelet.kill()
            kubelet.wait()
        calls = box.calls()
        crictl = (box.base / "crictl.log").read_text() if (box.base / "crictl.log").exists() else ""
        report.check("install.sh under Cubelet removes the sandboxes kubelet left on the previous runtime",
                     code == 0 and "sleeping" in out and "systemctl restart kubelet" not in calls
                     and all(f"-r unix:///run/containerd/containerd.sock {op} {i}" in crictl
                             for op in ("stopp", "rmp") for i in ("old-1", "old-2")), f"crictl {crictl!r}: {out[-300:]}")
        (box.base / "crictl.log").write_text("")
        code, out = box.run("install.sh", until="sleeping", KUBELET_SWITCH_RUNTIME="true",
                            CUBELET_READY_TIMEOUT="2",
                            PATH=box.env["PATH"].replace(str(box.base / "stubs"), str(box.base / "stubs-down")))
        box.calls()
        report.check("install.sh fails when /readyz never answers", code != 0 and "not ready" in out,
                     f"exit {code}: {out[-300:]}")

        (host / "var/lib/test-cubelet-check/store.redb").write_text("state")
        (box.base / "pods.json").write_text(pods_json(WEB_POD, INSTALLER_POD, UNINSTALL_POD))
        code, out = box.run("uninstall.sh", until="drain the node first")
        calls = box.calls()
        report.check("uninstall.sh refuses to move kubelet off Cubelet while other pods run on it",
                     "drain the node first" in out and "default/web-1" in out and "cubelet-x" not in out
                     and "cubelet-uninstall-x" not in out and dropin.exists()
                     and "systemd-run" not in calls, f"calls {calls}: {out[-400:]}")
        (box.base / "pods.json").write_text(pods_json(INSTALLER_POD, UNINSTALL_POD))
        (box.base / "pods-installer.json").write_text(pods_json(INSTALLER_POD))
        (box.base / "pods-ids").write_text("cubelet-1\n")
        code, out = box.run("uninstall.sh")
        calls = box.calls()
        crictl = (box.base / "crictl.log").read_text()
        order = [c for c in calls if c in ("systemd-run", "systemctl restart kubelet", "systemctl disable --now cubelet")]
        report.check("uninstall.sh retires the installer pods and hands over to a host unit",
                     code == 0 and "retired installer pod uid-installer" in out and "systemd-run" in calls,
                     f"exit {code}, calls {calls}: {out[-400:]}")
        report.check("uninstall.sh (host unit) restarts kubelet on its previous runtime, then removes Cubelet's pods and stops it",
                     order == ["systemd-run", "systemctl restart kubelet", "systemctl disable --now cubelet"]
                     and not dropin.exists() and "stopp cubelet-1" in crictl and "rmp cubelet-1" in crictl
                     and "ip link delete test-cbl0" in calls and "nft delete table ip cubelet_test_cbl0" in calls,
                     f"calls {calls}, crictl {crictl!r}")
        report.check("uninstall.sh removes installed files, markers and state",
                     not any(p.exists() for p in installed) and not previous.exists()
                     and not (host / "opt/cubelet").exists()
                     and not (host / "var/lib/test-cubelet-check").exists()
                     and not (host / "run/cubelet-uninstall").exists(), f"calls {calls}")
        code, out = box.run("uninstall.sh")
        report.check("uninstall.sh re-run succeeds", code == 0, f"exit {code}: {out[-300:]}")

# ---------------------------------------------------------------------------
# Rendering with the real helm.

RELEASE = "cubelet"
RELEASE_NAMESPACE = "kube-system"
KUBE_VERSION = "v1.28.0"


class RenderError(Exception):
    """helm refused to render (its message)."""


def _api_resources(group_version, resources):
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": [{"name": name, "singularName": name[:-1], "namespaced": namespaced,
                           "kind": kind, "verbs": ["get", "list"]}
                          for name, kind, namespaced in resources]}


# What helm's discovery asks before a lookup or a server dry run.
DISCOVERY = {
    "/version": {"major": "1", "minor": "28", "gitVersion": KUBE_VERSION, "platform": "linux/amd64"},
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
        {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}}
        for g in ("apps", "batch", "monitoring.coreos.com")]},
    "/api/v1": _api_resources("v1", [
        ("nodes", "Node", False), ("namespaces", "Namespace", False),
        ("configmaps", "ConfigMap", True), ("pods", "Pod", True), ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True), ("secrets", "Secret", True)]),
    "/apis/apps/v1": _api_resources("apps/v1", [("daemonsets", "DaemonSet", True)]),
    "/apis/batch/v1": _api_resources("batch/v1", [("jobs", "Job", True)]),
    "/apis/monitoring.coreos.com/v1": _api_resources(
        "monitoring.coreos.com/v1", [("servicemonitors", "ServiceMonitor", True)]),
}


class StandInApi:
    """A read-only stand-in for a Kubernetes API server on 127.0.0.1: the
    discovery documents, the Nodes and Namespaces it is given, and NotFound
    for anything else (so a dry-run install finds no release and no object
    in its way). It is what `lookup` sees."""

    def __init__(self):
        self.nodes = []
        self.namespaces = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?")[0].rstrip("/")
                if path in DISCOVERY:
                    return self._send(200, DISCOVERY[path])
                if path == "/api/v1/nodes":
                    return self._send(200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                                            "items": api.nodes})
                found = None
                if path.startswith("/api/v1/nodes/"):
                    name = path.rsplit("/", 1)[1]
                    found = next((n for n in api.nodes if n["metadata"]["name"] == name), None)
                elif path.startswith("/api/v1/namespaces/") and path.count("/") == 4:
                    found = api.namespaces.get(path.rsplit("/", 1)[1])
                elif path.endswith("/secrets"):
                    return self._send(200, {"apiVersion": "v1", "kind": "SecretList", "metadata": {},
                                            "items": []})
                if found is not None:
                    return self._send(200, found)
                return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404, "message": "not found"})

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Rendered:
    """One render of the chart: the documents `helm template` printed, with
    the template each came from, and NOTES.txt (which helm template does not
    print) from a dry-run install of the same values."""

    def __init__(self, text, notes):
        self.docs = []
        self.notes = notes
        for part in re.split(r"^---\s*$", text, flags=re.M):
            source = re.search(r"^# Source: (\S+)", part, flags=re.M)
            try:
                doc = yaml.safe_load(part)
            except yaml.YAMLError as err:
                raise RenderError(f"helm's output is not YAML: {err}".replace("\n", " "))
            if doc is not None:
                self.docs.append((source.group(1) if source else "?", doc))

    def kind(self, kind):
        return [d for _, d in self.docs if isinstance(d, dict) and d.get("kind") == kind]

    def one(self, kind):
        found = self.kind(kind)
        return found[0] if len(found) == 1 else None


class Helm:
    """The helm binary, with its homes and kubeconfig in a scratch directory
    (nothing of the user's is read or written) and a stand-in API server."""

    def __init__(self, binary, scratch):
        self.binary = binary
        self.scratch = Path(scratch)
        self.api = StandInApi()
        kubeconfig = self.scratch / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.api.url}}],
            "users": [{"name": "stand-in", "user": {}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in"}}]}))
        kubeconfig.chmod(0o600)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
        self.env.update(KUBECONFIG=str(kubeconfig), HELM_CACHE_HOME=str(self.scratch / "cache"),
                        HELM_CONFIG_HOME=str(self.scratch / "config"),
                        HELM_DATA_HOME=str(self.scratch / "data"))
        self._files = 0

    def close(self):
        self.api.close()

    def version(self):
        return self._run(["version", "--short"]).stdout.strip()

    def _values(self, overrides):
        self._files += 1
        path = self.scratch / f"values-{self._files}.yaml"
        path.write_text(yaml.safe_dump(overrides or {}))
        return path

    def _run(self, args):
        return subprocess.run([self.binary, *args], env=self.env, capture_output=True, text=True,
                              timeout=120, check=False)

    def lint(self, overrides):
        """`helm lint --strict` with the values set; (ok, output)."""
        proc = self._run(["lint", "--strict", str(CHART), "-n", RELEASE_NAMESPACE,
                          "-f", str(self._values(overrides))])
        return proc.returncode == 0, (proc.stdout + proc.stderr).strip()

    def template(self, overrides=None, nodes=None, namespaces=None):
        """`helm template` as a user runs it (lookup finds nothing), or, with
        nodes or namespaces, `--dry-run=server` against the stand-in, which
        answers lookup with them; NOTES.txt from `helm install
        --dry-run=server` with the same. Raises RenderError."""
        values = self._values(overrides)
        args = ["template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "-f", str(values),
                "--kube-version", KUBE_VERSION]
        if nodes is not None or namespaces is not None:
            args.append("--dry-run=server")
        self.api.nodes = copy.deepcopy(nodes or [])
        self.api.namespaces = copy.deepcopy(namespaces or {})
        proc = self._run(args)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip().replace("\n", " "))
        return Rendered(proc.stdout, self._notes(values))

    def _notes(self, values):
        """NOTES.txt of the same values and stand-in, from a dry-run install."""
        proc = self._run(["install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "-f", str(values),
                          "--dry-run=server", "--disable-openapi-validation", "-o", "json"])
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip().replace("\n", " "))
        return json.loads(proc.stdout)["info"].get("notes", "")


HELM = None  # set by main


def _values_sets():
    """Every values set the checks below render, once each, by label."""
    sets, seen = {}, set()
    candidates = {**PLACEMENT_VALUES, **SELECTOR_VALUES, **NAMESPACE_VALUES,
                  "every option on": ALL_ON_VALUES, **WITHOUT_NAMESPACE_VALUES}
    for label, overrides in candidates.items():
        key = json.dumps(overrides, sort_keys=True)
        if key not in seen:
            seen.add(key)
            sets[label] = overrides
    return sets


def check_helm(report):
    """helm itself: its lint in strict mode under every values set, and every
    manifest template rendering to well-formed objects."""
    version = HELM.version()
    report.check(f"helm is {HELM_VERSION} (got {version})", version.startswith(HELM_VERSION), version)
    for label, overrides in _values_sets().items():
        ok, out = HELM.lint(overrides)
        report.check(f"helm lint --strict ({label})", ok, out[-600:].replace("\n", " "))
    rendered = _render(report, "every optional object on, with nodes", ALL_ON_VALUES, nodes=SAMPLE_NODES)
    if rendered is None:
        return
    for path in sorted(TEMPLATES.rglob("*.yaml")):
        source = f"{CHART.name}/{path.relative_to(CHART)}"
        docs = [d for s, d in rendered.docs if s == source]
        bad = [d for d in docs
               if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind")
                       and (d.get("metadata") or {}).get("name"))]
        report.check(f"{rel(path)} renders objects with apiVersion, kind and metadata.name "
                     "(every option on)", bool(docs) and not bad,
                     f"malformed: {bad[:1]}" if docs else "renders nothing")


def _node(name, labels, taints=()):
    """A Node as `lookup` returns it; labels None means no metadata.labels."""
    meta = {"name": name}
    if labels is not None:
        meta["labels"] = {"kubernetes.io/hostname": name, **labels}
    spec = {"taints": [dict(t) for t in taints]} if taints else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec}


def _taint(key, value, effect):
    taint = {"key": key, "effect": effect}
    if value is not None:
        taint["value"] = value
    return taint


_LINUX = {"kubernetes.io/os": "linux"}
_WORKER = {"node-role.kubernetes.io/worker": ""}
# Nodes with and without the labels the values sets select on (a label with
# an empty value, one with a value, none, no labels at all) and with taints
# the DaemonSet tolerates or not.
SAMPLE_NODES = [
    _node("plain", _LINUX),
    _node("worker", {**_LINUX, **_WORKER}),
    _node("worker-true", {**_LINUX, "node-role.kubernetes.io/worker": "true"}),
    _node("windows", {"kubernetes.io/os": "windows", **_WORKER}),
    _node("unlabelled", None),
    _node("control-plane", {**_LINUX, "node-role.kubernetes.io/control-plane": ""},
          [_taint("node-role.kubernetes.io/control-plane", None, "NoSchedule")]),
    _node("dedicated", {**_LINUX, **_WORKER}, [_taint("dedicated", "cubelet", "NoExecute")]),
    _node("gpu", {**_LINUX, **_WORKER}, [_taint("dedicated", "gpu", "NoExecute")]),
    _node("cordoned", {**_LINUX, **_WORKER},
          [_taint("node.kubernetes.io/unschedulable", None, "NoSchedule")]),
    _node("spot", _LINUX, [_taint("spot", "true", "PreferNoSchedule")]),
    _node("zone-a", {**_LINUX, **_WORKER, "topology.kubernetes.io/zone": "a", "cubelet.io/gen": "3"}),
    _node("zone-b", {**_LINUX, "topology.kubernetes.io/zone": "b", "cubelet.io/gen": "x"},
          [_taint("dedicated", "cubelet", "NoSchedule")]),
]

_ZONE_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]},
        {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}]}]}}}
_TERMS_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [
        {"matchExpressions": [{"key": "node-role.kubernetes.io/worker", "operator": "Exists"},
                              {"key": "kubernetes.io/os", "operator": "NotIn", "values": ["windows"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["plain"]}]},
        {"matchExpressions": [{"key": "cubelet.io/gen", "operator": "Gt", "values": ["2"]}]}]},
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [
            {"key": "spot", "operator": "DoesNotExist"}]}}]}}

# Values sets for the placement checks: name -> values overrides.
PLACEMENT_VALUES = {
    "defaults": {},
    'nodeSelector worker: ""': {"nodeSelector": {"node-role.kubernetes.io/worker": ""}},
    "nodeSelector worker: true": {"nodeSelector": {"node-role.kubernetes.io/worker": "true"}},
    "no nodeSelector, no tolerations": {"nodeSelector": None, "tolerations": []},
    "tolerations dedicated=cubelet:NoExecute only": {
        "nodeSelector": {"node-role.kubernetes.io/worker": ""},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "cubelet",
                         "effect": "NoExecute"}]},
    "zone affinity, tolerations key dedicated": {
        "tolerations": [{"key": "dedicated", "operator": "Exists"}], "affinity": _ZONE_AFFINITY},
    "affinity with three terms, no nodeSelector": {
        "nodeSelector": None, "tolerations": [{"effect": "NoSchedule", "operator": "Exists"}],
        "affinity": _TERMS_AFFINITY},
}

# What the DaemonSet controller adds to every daemon pod
# (pkg/controller/daemon/util: AddOrUpdateDaemonPodTolerations).
DAEMON_POD_TOLERATIONS = [
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
]
HOSTNETWORK_DAEMON_TOLERATION = {"key": "node.kubernetes.io/network-unavailable",
                                 "operator": "Exists", "effect": "NoSchedule"}


def tolerates(toleration, taint):
    """core/v1 Toleration.ToleratesTaint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def untolerated(node, tolerations, effects):
    return [t for t in (node.get("spec") or {}).get("taints") or []
            if t.get("effect") in effects and not any(tolerates(tol, t) for tol in tolerations)]


def _requirement(expr, value, present):
    """One NodeSelectorRequirement against a label (or field) value."""
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        if not present or len(values) != 1:
            return False
        try:
            have, limit = int(value), int(values[0])
        except ValueError:
            return False
        return have > limit if op == "Gt" else have < limit
    return False


def node_affinity_matches(affinity, node):
    """requiredDuringSchedulingIgnoredDuringExecution of a pod's node
    affinity: terms ORed, requirements of a term ANDed, an empty term
    matches nothing."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    for term in required.get("nodeSelectorTerms") or []:
        exprs, field_exprs = term.get("matchExpressions") or [], term.get("matchFields") or []
        if not exprs and not field_exprs:
            continue
        if (all(_requirement(e, labels.get(e["key"]), e["key"] in labels) for e in exprs)
                and all(_requirement(e, fields.get(e["key"]), e["key"] in fields) for e in field_exprs)):
            return True
    return False


def node_selector_matches(selector, node):
    labels = node["metadata"].get("labels") or {}
    return all(key in labels and labels[key] == str(want) for key, want in (selector or {}).items())


def daemon_pod_fits(pod_spec, node):
    """Whether the DaemonSet controller runs a daemon pod of pod_spec on node
    (NodeShouldRunDaemonPod: node selector and required node affinity, and
    every NoSchedule/NoExecute taint tolerated, with the tolerations the
    controller adds)."""
    tolerations = list(pod_spec.get("tolerations") or []) + DAEMON_POD_TOLERATIONS
    if pod_spec.get("hostNetwork"):
        tolerations.append(HOSTNETWORK_DAEMON_TOLERATION)
    return (node_selector_matches(pod_spec.get("nodeSelector"), node)
            and node_affinity_matches(pod_spec.get("affinity"), node)
            and not untolerated(node, tolerations, ("NoSchedule", "NoExecute")))


def kubelet_refuses(pod_spec, node):
    """Why kubelet refuses (or the taint manager evicts) a pod bound by
    nodeName: node selector, node affinity, NoExecute taints; None if it
    runs. NoSchedule taints do not apply to a pod that skips the scheduler."""
    if not node_selector_matches(pod_spec.get("nodeSelector"), node):
        return "nodeSelector does not match"
    if not node_affinity_matches(pod_spec.get("affinity"), node):
        return "node affinity does not match"
    bad = untolerated(node, pod_spec.get("tolerations") or [], ("NoExecute",))
    if bad:
        return f"untolerated NoExecute taint {bad[0]['key']}={bad[0].get('value', '')}"
    return None


def selector_selects(selector, labels):
    """A LabelSelector (matchLabels, matchExpressions) or a Service's plain
    selector map, against a pod's labels. An empty selector selects
    nothing for a Service and everything for a LabelSelector; both are
    reported as selecting."""
    labels = labels or {}
    if "matchLabels" in selector or "matchExpressions" in selector:
        match, exprs = selector.get("matchLabels") or {}, selector.get("matchExpressions") or []
    else:
        match, exprs = selector, []
    if not all(labels.get(k) == v for k, v in match.items()):
        return False
    for expr in exprs:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


_RENDERS = {}


def _render(report, label, overrides=None, **kwargs):
    """HELM.template, reported once per distinct input; None if it failed."""
    key = json.dumps([overrides, kwargs], sort_keys=True)
    if key not in _RENDERS:
        try:
            _RENDERS[key] = HELM.template(overrides, **kwargs)
            report.check(f"chart renders ({label})", True)
        except RenderError as err:
            _RENDERS[key] = None
            report.check(f"chart renders ({label})", False, str(err))
    return _RENDERS[key]


def _uninstall_pods(rendered):
    return [(job["metadata"]["name"], job["spec"]["template"]) for job in rendered.kind("Job")
            if "pre-delete" in str((job["metadata"].get("annotations") or {}).get("helm.sh/hook"))]


def _test_pods(rendered):
    return [pod for pod in rendered.kind("Pod")
            if "test" in str((pod["metadata"].get("annotations") or {}).get("helm.sh/hook"))]


def check_rendered_basics(report, values, schema):
    """Every values set renders, validates, and yields well-formed manifests."""
    validator = jsonschema.Draft7Validator(schema) if schema else None
    sets = {**PLACEMENT_VALUES, **SELECTOR_VALUES, **NAMESPACE_VALUES, "every option on": ALL_ON_VALUES}
    for label, overrides in sets.items():
        if validator is not None and values is not None:
            merged = coalesce_values(values, overrides)
            errors = list(validator.iter_errors(merged))
            report.check(f"values set '{label}' validates against values.schema.json", not errors,
                         "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors))
    rendered = _render(report, "helm template, defaults")
    if rendered is None:
        return
    bad = [name for name, doc in rendered.docs
           if not (isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind")
                   and (doc.get("metadata") or {}).get("name"))]
    report.check("rendered manifests have apiVersion, kind and metadata.name", not bad,
                 f"in {sorted(set(bad))}")
    kinds = sorted({d["kind"] for _, d in rendered.docs})
    report.check("helm template renders ConfigMap, DaemonSet, Pod (test), Service, ServiceAccount",
                 kinds == ["ConfigMap", "DaemonSet", "Pod", "Service", "ServiceAccount"], f"kinds {kinds}")
    report.check("helm template renders no uninstall Job (lookup finds no nodes)",
                 not rendered.kind("Job"), f"{len(rendered.kind('Job'))} Jobs")
    report.check("NOTES.txt renders", bool(rendered.notes.strip()), "empty")
    rendered = _render(report, "every optional object on, with nodes", ALL_ON_VALUES, nodes=SAMPLE_NODES)
    if rendered is None:
        return
    kinds = sorted({d["kind"] for _, d in rendered.docs})
    want = ["ConfigMap", "DaemonSet", "Job", "Namespace", "Pod", "Service", "ServiceAccount", "ServiceMonitor"]
    report.check("with every option on, all kinds render", kinds == want, f"kinds {kinds}")
    svc, monitor = rendered.one("Service"), rendered.one("ServiceMonitor")
    if svc is not None and monitor is not None:
        report.check("the ServiceMonitor selects the Service in its namespace",
                     selector_selects(monitor["spec"]["selector"], svc["metadata"].get("labels"))
                     and monitor["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]],
                     f"selector {monitor['spec']['selector']}, namespaces "
                     f"{monitor['spec']['namespaceSelector']}, Service in {svc['metadata']['namespace']}")


# Every optional object of the chart at once.
ALL_ON_VALUES = {
    "namespace": {"create": True, "name": "cubelet-system"},
    "config": {"metrics": {"address": "0.0.0.0:9385"}},
    "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prometheus"}},
    "dashboard": {"enabled": True},
    "kubelet": {"switchRuntime": True},
    "uninstall": {"purgeState": True},
}

# Values sets for the selector checks.
SELECTOR_VALUES = {
    "defaults": {},
    "podLabels, metrics on 0.0.0.0": {"podLabels": {"team": "node"},
                                      "config": {"metrics": {"address": "0.0.0.0:9385"}}},
}


def check_selectors(report):
    """The DaemonSet adopts (and the Service selects) only installer pods:
    never the `helm test` Pod or the uninstall Jobs' pods."""
    for label, overrides in SELECTOR_VALUES.items():
        rendered = _render(report, f"{label}, with nodes", overrides, nodes=SAMPLE_NODES)
        if rendered is None:
            continue
        ds, svc = rendered.one("DaemonSet"), rendered.one("Service")
        tests, jobs = _test_pods(rendered), _uninstall_pods(rendered)
        if not report.check(f"one DaemonSet, a test Pod and uninstall Jobs render ({label})",
                            ds is not None and tests and jobs,
                            f"DaemonSet {ds is not None}, {len(tests)} test Pods, {len(jobs)} Jobs"):
            continue
        selector = ds["spec"]["selector"]
        installer = ds["spec"]["template"]["metadata"].get("labels") or {}
        report.check(f"DaemonSet selector selects its pod template ({label})",
                     selector_selects(selector, installer), f"selector {selector}, labels {installer}")
        selectors = [("DaemonSet selector", selector)]
        if svc is not None:
            report.check(f"Service selector selects the installer pods ({label})",
                         selector_selects(svc["spec"]["selector"], installer),
                         f"selector {svc['spec']['selector']}, labels {installer}")
            selectors.append(("Service selector", svc["spec"]["selector"]))
        for what, sel in selectors:
            hit = [p["metadata"]["name"] for p in tests if selector_selects(sel, p["metadata"].get("labels"))]
            report.check(f"{what} does not select the helm test Pod ({label})", not hit,
                         f"{sel} selects {hit} (labels {tests[0]['metadata'].get('labels')})")
            hit = [name for name, tpl in jobs if selector_selects(sel, tpl["metadata"].get("labels"))]
            report.check(f"{what} does not select the uninstall Job pods ({label})", not hit,
                         f"{sel} selects the pods of {len(hit)} Jobs (labels "
                         f"{jobs[0][1]['metadata'].get('labels')})")


def check_uninstall_placement(report):
    """The pre-delete Jobs run exactly where the DaemonSet ran installers:
    the kube scheduler's and kubelet's matching, applied to both."""
    nodes = {n["metadata"]["name"]: n for n in SAMPLE_NODES}
    for label, overrides in PLACEMENT_VALUES.items():
        rendered = _render(report, f"{label}, with nodes", overrides, nodes=SAMPLE_NODES)
        if rendered is None:
            continue
        ds = rendered.one("DaemonSet")
        if not report.check(f"one DaemonSet renders ({label})", ds is not None, "none or several"):
            continue
        ds_spec = ds["spec"]["template"]["spec"]
        installed = {name for name, node in nodes.items() if daemon_pod_fits(ds_spec, node)}
        jobs = _uninstall_pods(rendered)
        pinned = [(name, tpl["spec"].get("nodeName")) for name, tpl in jobs]
        report.check(f"every uninstall Job is pinned to one node by nodeName, one Job per node ({label})",
                     all(n in nodes for _, n in pinned) and len({n for _, n in pinned}) == len(pinned),
                     f"nodeNames {[n for _, n in pinned]}")
        targets = {tpl["spec"].get("nodeName") for _, tpl in jobs}
        refused = {tpl["spec"]["nodeName"]: why for _, tpl in jobs
                   if tpl["spec"].get("nodeName") in nodes
                   for why in [kubelet_refuses(tpl["spec"], nodes[tpl["spec"]["nodeName"]])] if why}
        ran = targets - set(refused)
        problems = []
        if targets - installed:
            problems.append(f"Jobs for nodes without an installer: {sorted(targets - installed)}")
        if refused:
            problems.append("Jobs kubelet refuses: " + ", ".join(f"{n} ({w})" for n, w in sorted(refused.items())))
        if installed - ran:
            problems.append(f"installer nodes no Job cleans up: {sorted(installed - ran)}")
        report.check(f"uninstall Jobs run on exactly the DaemonSet's nodes ({label})", not problems,
                     f"installer on {sorted(installed)}; " + "; ".join(problems))
        for key in ("nodeSelector", "affinity", "tolerations"):
            differ = [name for name, tpl in jobs if tpl["spec"].get(key) != ds_spec.get(key)]
            report.check(f"uninstall Job pods have the DaemonSet's {key} ({label})", not differ,
                         f"DaemonSet {ds_spec.get(key)}, Job {jobs[0][1]['spec'].get(key) if differ else ''}")


def _runs_as_root(container, pod_spec):
    sc = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    return sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is not True


def check_run_as_root(report):
    """nsenter into PID 1 needs root: the installer and uninstall containers
    say so instead of relying on the image's user."""
    rendered = _render(report, "defaults, with nodes", nodes=SAMPLE_NODES)
    if rendered is None:
        return
    ds = rendered.one("DaemonSet")
    groups = [("installer DaemonSet", [ds["spec"]["template"]] if ds else [])]
    groups.append(("uninstall Job", [tpl for _, tpl in _uninstall_pods(rendered)]))
    for what, templates in groups:
        containers = [(c, tpl["spec"]) for tpl in templates
                      for c in (tpl["spec"].get("initContainers") or []) + tpl["spec"]["containers"]]
        bad = [c for c, spec in containers if not _runs_as_root(c, spec)]
        report.check(f"{what} containers run as root (runAsUser: 0, runAsNonRoot not true)",
                     bool(containers) and not bad,
                     "no containers" if not containers else
                     f"{bad[0]['name']}: securityContext {bad[0].get('securityContext')}" if bad else "")


# Values sets for the namespace checks.
NAMESPACE_VALUES = {
    "namespace.create": {"namespace": {"create": True, "name": "cubelet-system"}},
    "namespace.name only": {"namespace": {"name": "cubelet-system"}},
}
# Values written before the namespace option existed (helm upgrade
# --reuse-values from chart 0.1.0): null deletes the key, as in a values file.
WITHOUT_NAMESPACE_VALUES = {"values without namespace, as --reuse-values from 0.1.0": {"namespace": None}}
PSA_LABELS = {f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")}


def _namespaced(rendered):
    return [(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace"))
            for _, d in rendered.docs if d.get("kind") != "Namespace"]


def check_namespace(report):
    """The pods need a namespace whose PodSecurity level is privileged: the
    chart can create one, says so, and warns when the target enforces less."""
    rendered = _render(report, "defaults, with nodes", nodes=SAMPLE_NODES)
    if rendered is not None:
        report.check("by default no Namespace is rendered", not rendered.kind("Namespace"),
                     f"{[n['metadata']['name'] for n in rendered.kind('Namespace')]}")
        wrong = [o for o in _namespaced(rendered) if o[2] != "kube-system"]
        report.check("by default every object is in the release namespace", not wrong, f"{wrong}")
        notes = rendered.notes
        report.check("NOTES.txt states the PodSecurity requirement (enforce=privileged)",
                     "pod-security.kubernetes.io/enforce=privileged" in notes, "not mentioned")
    rendered = _render(report, "namespace.create", NAMESPACE_VALUES["namespace.create"], nodes=SAMPLE_NODES)
    if rendered is not None:
        namespaces = rendered.kind("Namespace")
        ns = namespaces[0] if len(namespaces) == 1 else None
        report.check("namespace.create=true renders one Namespace namespace.name",
                     ns is not None and ns["metadata"]["name"] == "cubelet-system",
                     f"Namespaces {[n['metadata']['name'] for n in namespaces]}")
        labels = (ns or {}).get("metadata", {}).get("labels") or {}
        report.check("the created Namespace has PodSecurity enforce/audit/warn: privileged",
                     all(labels.get(k) == v for k, v in PSA_LABELS.items()),
                     f"labels {labels}")
        wrong = [o for o in _namespaced(rendered) if o[2] != "cubelet-system"]
        report.check("namespace.create=true: every object (and hook) is in namespace.name",
                     not wrong, f"{wrong}")
    rendered = _render(report, "namespace.name only", NAMESPACE_VALUES["namespace.name only"],
                       nodes=SAMPLE_NODES)
    if rendered is not None:
        report.check("namespace.name without create renders no Namespace", not rendered.kind("Namespace"),
                     "a Namespace is rendered")
        wrong = [o for o in _namespaced(rendered) if o[2] != "cubelet-system"]
        report.check("namespace.name: every object (and hook) is in it", not wrong, f"{wrong}")
    (label, overrides), = WITHOUT_NAMESPACE_VALUES.items()
    rendered = _render(report, label, overrides, nodes=SAMPLE_NODES)
    if rendered is not None:
        wrong = [o for o in _namespaced(rendered) if o[2] != "kube-system"]
        report.check("without a namespace key every object is in the release namespace",
                     not wrong and not rendered.kind("Namespace"), f"{wrong}")
    try:
        HELM.template({"namespace": {"create": True}})
        report.check("namespace.create=true without namespace.name fails the render", False,
                     "rendered (Helm stores the release in that namespace before creating anything)")
    except RenderError as err:
        report.check("namespace.create=true without namespace.name fails the render",
                     "namespace.name" in str(err), str(err))
    baseline = {"kube-system": {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "kube-system", "labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}}
    rendered = _render(report, "release namespace enforces baseline", nodes=SAMPLE_NODES,
                       namespaces=baseline)
    if rendered is not None:
        report.check("NOTES.txt warns when the namespace enforces baseline",
                     "WARNING" in rendered.notes and "baseline" in rendered.notes,
                     "no warning in NOTES.txt")
    privileged = {"kube-system": {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "kube-system", "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}}
    rendered = _render(report, "release namespace enforces privileged", nodes=SAMPLE_NODES,
                       namespaces=privileged)
    if rendered is not None:
        report.check("NOTES.txt does not warn when the namespace enforces privileged",
                     "WARNING" not in rendered.notes, "warns anyway")


def value_paths(values, prefix=""):
    """Dotted paths of values.yaml to document: leaves, empty maps and the
    open maps of OPEN_MAPS."""
    for key, val in values.items():
        path = f"{prefix}{key}"
        if isinstance(val, dict) and val and path not in OPEN_MAPS:
            yield from value_paths(val, path + ".")
        else:
            yield path


def check_readme(report, values):
    readme = CHART / "README.md"
    if not report.check(f"{rel(readme)} exists", readme.is_file(), "missing"):
        return
    text = readme.read_text()
    for needle in ("helm install cubelet charts/cubelet -n kube-system",
                   "helm template cubelet charts/cubelet",
                   "pod-security.kubernetes.io/enforce=privileged"):
        report.check(f"{rel(readme)} shows `{needle}`", needle in text, "not found")
    if values is None:
        return
    by_top = {}
    for path in value_paths(values):
        by_top.setdefault(path.split(".")[0], []).append(path)
    for top, paths in by_top.items():
        missing = [p for p in paths if f"`{p}`" not in text]
        report.check(f"{rel(readme)} documents every value under {top}", not missing,
                     "undocumented: " + ", ".join(missing))


def main():
    global HELM
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--helm", required=True, help=f"a helm {HELM_VERSION} binary (hack/helm.sh)")
    args = parser.parse_args()
    report = Report()
    chart = load_yaml(report, CHART / "Chart.yaml")
    values = load_yaml(report, CHART / "values.yaml")
    schema = None
    dashboards = []
    for path in sorted(CHART.rglob("*.json")):
        data = load_json(report, path)
        if path.name == "values.schema.json":
            schema = data
        elif path.parent.name == "dashboards":
            dashboards.append((path, data))
    report.check("charts/cubelet/values.schema.json exists", schema is not None, "missing")
    check_chart_yaml(report, chart)
    check_schema(report, values, schema)
    templates = template_files()
    report.check("templates exist", bool(templates), f"none under {rel(TEMPLATES)}")
    check_values_paths(report, values, templates)
    check_includes_and_files(report, templates)
    report.check("a dashboard exists", bool(dashboards), "no charts/cubelet/dashboards/*.json")
    for path, dash in dashboards:
        check_dashboard(report, path, dash)
    check_units(report)
    check_scripts(report)
    check_installer_scripts(report)
    with tempfile.TemporaryDirectory(prefix="check-chart-helm-") as scratch:
        HELM = Helm(args.helm, scratch)
        try:
            check_helm(report)
            check_rendered_basics(report, values, schema)
            check_selectors(report)
            check_uninstall_placement(report)
            check_namespace(report)
            check_run_as_root(report)
        finally:
            HELM.close()
    check_readme(report, values)
    print(f"{report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
