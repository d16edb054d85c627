#!/usr/bin/env python3
"""Static checks of the cubelet Helm chart, for machines without helm.

Checks, one result line per item:
  * Chart.yaml, values.yaml and every JSON file of the chart parse;
  * Chart.yaml has apiVersion v2, name, version and appVersion;
  * values.schema.json is a valid draft-07 schema, values.yaml satisfies it,
    it covers every key of values.yaml, and it rejects bad values (enums,
    unknown keys);
  * every `.Values.x.y` path used in templates exists in values.yaml;
  * every `include` names a defined template and every `.Files.Get` an
    existing file;
  * template actions are balanced, and with the actions stripped each
    manifest template is still YAML with apiVersion, kind and metadata.name;
  * the dashboard queries only known metric names and has a panel for each
    metric the chart promises;
  * charts/cubelet/files/cubelet.service and hack/cubelet.service are
    identical and carry the required directives;
  * the installer scripts pass `sh -n`, and install.sh / uninstall.sh do
    their job against a scratch "host" directory with nsenter, systemctl and
    wget stubbed (nothing on this machine is touched);
  * README.md documents every value.

The last line is `N passed, M failed`; the exit status is 1 if anything
failed. Needs python3-yaml and python3-jsonschema (Debian packages).
"""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
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

# Metric names of DESIGN.md ("Metrics") plus the GC, event and storage
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


def balance_error(text):
    """Why the actions of a template are unbalanced, or None."""
    text = COMMENT_RE.sub("", text)
    if "{{/*" in text or "{{- /*" in text:
        return "unterminated comment"
    depth_open = None
    pos = 0
    while True:
        opening = text.find("{{", pos)
        closing = text.find("}}", pos)
        if depth_open is None:
            if closing != -1 and (opening == -1 or closing < opening):
                line = text.count("\n", 0, closing) + 1
                return f"stray '}}}}' at line {line}"
            if opening == -1:
                return None
            depth_open = opening
            pos = opening + 2
        else:
            if closing == -1:
                line = text.count("\n", 0, depth_open) + 1
                return f"unclosed '{{{{' at line {line}"
            if opening != -1 and opening < closing:
                line = text.count("\n", 0, depth_open) + 1
                return f"'{{{{' at line {line} not closed before the next '{{{{'"
            depth_open = None
            pos = closing + 2


BLOCK_OPEN_RE = re.compile(r"^\s*-?\s*(if|with|range|define|block)\b")
BLOCK_CLOSE_RE = re.compile(r"^\s*-?\s*end\s*-?$")


def block_error(text):
    """Why if/with/range/define and end do not pair up, or None."""
    depth = 0
    for action in actions(text):
        inner = action[2:-2].strip().lstrip("-").rstrip("-").strip()
        if BLOCK_OPEN_RE.match(inner):
            depth += 1
        elif BLOCK_CLOSE_RE.match(inner):
            depth -= 1
            if depth < 0:
                return "'end' without a block"
    return None if depth == 0 else f"{depth} block(s) without 'end'"


def strip_actions(text):
    """The template with its actions removed: lines made only of actions
    vanish, actions inside a line become a placeholder scalar."""
    text = COMMENT_RE.sub("", text)
    out = []
    for line in text.split("\n"):
        if ACTION_RE.search(line) and not ACTION_RE.sub("", line).strip():
            out.append("")
        else:
            out.append(ACTION_RE.sub("PLACEHOLDER", line))
    return "\n".join(out)


def check_template_syntax(report, templates):
    for path in templates:
        text = path.read_text()
        err = balance_error(text) or block_error(text)
        report.check(f"{rel(path)} has balanced actions", err is None, err or "")
        if path.suffix != ".yaml" or err is not None:
            continue
        name = f"{rel(path)} is YAML with actions stripped"
        try:
            docs = [d for d in yaml.safe_load_all(strip_actions(text)) if d is not None]
        except yaml.YAMLError as yerr:
            report.check(name, False, str(yerr).replace("\n", " "))
            continue
        bad = [d for d in docs
               if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind")
                       and isinstance(d.get("metadata"), dict) and "name" in d["metadata"])]
        report.check(name, bool(docs) and not bad,
                     "no manifest" if not docs else "a document lacks apiVersion/kind/metadata.name")


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
                     "not a Cubelet metric (DESIGN.md, Metrics)")
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
systemctl | journalctl)
	echo "$*" >>"$FAKE_LOG"
	exit 0
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
        code, out = box.run("install.sh", until="sleeping", KUBELET_SWITCH_RUNTIME="true")
        calls = box.calls()
        dropin = host / "etc/systemd/system/kubelet.service.d/99-cubelet-runtime.conf"
        report.check("install.sh with switchRuntime writes the kubelet drop-in, restarts kubelet, exits",
                     code == 0 and dropin.is_file() and "systemctl restart kubelet" in calls
                     and "sleeping" not in out, f"exit {code}, calls {calls}")
        code, out = box.run("install.sh", until="sleeping", KUBELET_SWITCH_RUNTIME="true",
                            CUBELET_READY_TIMEOUT="2",
                            PATH=box.env["PATH"].replace(str(box.base / "stubs"), str(box.base / "stubs-down")))
        box.calls()
        report.check("install.sh fails when /readyz never answers", code != 0 and "not ready" in out,
                     f"exit {code}: {out[-300:]}")
        (host / "var/lib/test-cubelet-check/store.redb").write_text("state")
        code, out = box.run("uninstall.sh")
        calls = box.calls()
        report.check("uninstall.sh removes the drop-in and restarts kubelet first",
                     code == 0 and not dropin.exists() and calls[:2] == ["systemctl daemon-reload",
                                                                        "systemctl restart kubelet"],
                     f"exit {code}, calls {calls}: {out[-300:]}")
        report.check("uninstall.sh disables the unit and removes installed files and state",
                     "systemctl disable --now cubelet" in calls
                     and not any(p.exists() for p in installed)
                     and not (host / "var/lib/test-cubelet-check").exists(), f"calls {calls}")
        code, out = box.run("uninstall.sh")
        report.check("uninstall.sh re-run succeeds", code == 0, f"exit {code}: {out[-300:]}")


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
                   "helm template cubelet charts/cubelet"):
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
    check_template_syntax(report, templates)
    report.check("a dashboard exists", bool(dashboards), "no charts/cubelet/dashboards/*.json")
    for path, dash in dashboards:
        check_dashboard(report, path, dash)
    check_units(report)
    check_scripts(report)
    check_installer_scripts(report)
    check_readme(report, values)
    print(f"{report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
