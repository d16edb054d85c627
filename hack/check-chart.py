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
  * README.md documents every value;
  * rendered as Helm 3 renders it (a Go text/template + Sprig subset below,
    checked against known outputs first; `lookup` answers with sample Nodes
    and Namespaces), under several values sets: every set validates and
    renders; the DaemonSet's and the Service's selectors select the installer
    pods and never the `helm test` Pod or the uninstall Job pods; the
    pre-delete Jobs run on exactly the nodes the DaemonSet ran installers on
    (node selector, node affinity and taints/tolerations matched the way the
    DaemonSet controller, the scheduler and kubelet do, for nodes with and
    without the labels, with empty and other values, and with tolerated and
    untolerated NoSchedule/NoExecute taints), with the DaemonSet's
    nodeSelector, affinity and tolerations; the namespace option creates a
    Namespace labelled PodSecurity privileged, NOTES.txt states the
    requirement and warns about a baseline namespace; the installer and
    uninstall containers run as root explicitly.

The last line is `N passed, M failed`; the exit status is 1 if anything
failed. Needs python3-yaml and python3-jsonschema (Debian packages).
"""

import ast
import base64
import copy
import hashlib
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


# ---------------------------------------------------------------------------
# Rendering the chart as Helm 3 does, for the checks of rendered manifests.
#
# A subset of Go's text/template (actions, trim markers, comments, if / else
# if / else, with, range over lists and maps with sorted keys, break and
# continue, define / template / include, variables with block scope and
# assignment, pipelines, parenthesised pipelines, field chains, niladic
# method calls) and of the Sprig and Helm functions, with their semantics:
# a missing map key is nil (Helm's missingkey=zero), a field of nil is an
# error, nil prints as nothing, `and`/`or` short-circuit and return an
# operand, `eq` of different kinds is an error unless one side is nil, numbers
# from values files are float64 (printed with %v as Go does: 1e+06), `get`
# of a missing key is "", toYaml drops its last newline. A function the chart
# uses and this renderer lacks is a render error, not a silent gap.

class RenderError(Exception):
    pass


class _Missing:
    pass


MISSING = _Missing()


class BreakLoop(Exception):
    pass


class ContinueLoop(Exception):
    pass


def _go_float(f):
    """fmt's %v of a float64: strconv's 'g' with the shortest digits, which
    switches to an exponent from 1e+06 on (and below 1e-04)."""
    if f != f:
        return "NaN"
    if f in (float("inf"), float("-inf")):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "0"
    sign = "-" if f < 0 else ""
    mant, _, exp = repr(abs(f)).partition("e")
    whole, _, frac = mant.partition(".")
    digits = whole + frac
    significant = digits.lstrip("0")
    point = len(whole) - (len(digits) - len(significant)) + (int(exp) if exp else 0)
    significant = significant.rstrip("0") or "0"
    x = point - 1
    if x < -4 or x >= 6:
        m = significant[0] + ("." + significant[1:] if len(significant) > 1 else "")
        return f"{sign}{m}e{'-' if x < 0 else '+'}{abs(x):02d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{significant}"
    if point >= len(significant):
        return f"{sign}{significant}{'0' * (point - len(significant))}"
    return f"{sign}{significant[:point]}.{significant[point:]}"


def go_str(v):
    """fmt.Sprint of a value, as Go prints what YAML/JSON decode to."""
    if v is None:
        return "<nil>"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, float):
        return _go_float(v)
    if isinstance(v, (int, str)):
        return str(v)
    if isinstance(v, list):
        return "[" + " ".join(go_str(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{go_str(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def go_quote(s):
    """fmt's %q of a string."""
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def truth(v):
    """Go template truth: false, 0, nil and empty strings/lists/maps are false."""
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def _kind(v):
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "slice"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def go_eq(a, *others):
    if not others:
        raise RenderError("eq: missing argument for comparison")
    for b in others:
        if a is None or b is None:
            if a is None and b is None:
                return True
            continue
        ka, kb = _kind(a), _kind(b)
        if ka != kb:
            raise RenderError(f"eq: incompatible types for comparison ({ka} and {kb})")
        if ka in ("slice", "map"):
            raise RenderError(f"eq: non-comparable type {ka}")
        if a == b:
            return True
    return False


def _go_less(name, a, b):
    ka, kb = _kind(a), _kind(b)
    if ka != kb or ka not in ("int", "float", "string"):
        raise RenderError(f"{name}: incompatible types for comparison ({ka} and {kb})")
    return a < b


def strval(v):
    """Sprig's strval: strings as they are, anything else as fmt's %v."""
    return v if isinstance(v, str) else go_str(v)


def empty(v):
    """Sprig's empty."""
    return not truth(v)


def _plain(v):
    """A value as encoding/json sees it: integral float64s are integers."""
    if isinstance(v, float) and v == int(v) and abs(v) < 1e21:
        return int(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def to_yaml(v):
    text = yaml.safe_dump(_plain(v), default_flow_style=False, sort_keys=True,
                          allow_unicode=True, width=1 << 30)
    if text.endswith("\n...\n"):
        text = text[: -len("...\n")]
    return text[:-1] if text.endswith("\n") else text


def to_json(v):
    text = json.dumps(_plain(v), separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def go_sprintf(fmt, *args):
    """fmt.Sprintf for the verbs templates use: %s %v %d %q %%."""
    out, i, n = [], 0, 0
    while i < len(fmt):
        ch = fmt[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        verb = fmt[i + 1] if i + 1 < len(fmt) else ""
        i += 2
        if verb == "%":
            out.append("%")
            continue
        if n >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        arg = args[n]
        n += 1
        if verb in ("s", "v"):
            out.append(go_str(arg))
        elif verb == "d":
            if isinstance(arg, int) and not isinstance(arg, bool):
                out.append(str(arg))
            else:
                out.append(f"%!d({_kind(arg)}={go_str(arg)})")
        elif verb == "q":
            out.append(go_quote(strval(arg)))
        else:
            raise RenderError(f"printf: verb %{verb} not supported by this renderer")
    if n < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{_kind(a)}={go_str(a)}" for a in args[n:]) + ")")
    return "".join(out)


def go_sprint(*args):
    """fmt.Sprint: a space between operands when neither is a string."""
    out = []
    for i, arg in enumerate(args):
        if i and not isinstance(arg, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(go_str(arg))
    return "".join(out)


def _to_int(v):
    """Sprig's toInt (cast.ToInt): strings parsed, floats truncated, else 0."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return int(v)
    if isinstance(v, str):
        try:
            return int(v, 0) if v.strip().lower().startswith(("0x", "0o", "0b")) else int(v)
        except ValueError:
            return 0
    return 0


def _atoi(s):
    try:
        return int(s)
    except (TypeError, ValueError):
        return 0


def _index(coll, *keys):
    for key in keys:
        if isinstance(coll, dict):
            coll = coll.get(key)
        elif isinstance(coll, list):
            if not isinstance(key, int) or not 0 <= key < len(coll):
                raise RenderError(f"index: index out of range: {key}")
            coll = coll[key]
        elif coll is None:
            raise RenderError("index of untyped nil")
        else:
            raise RenderError(f"can't index item of type {_kind(coll)}")
    return coll


def _dig(*args):
    if len(args) < 3:
        raise RenderError("dig: needs keys, a default and a map")
    *keys, default, node = args
    for key in keys:
        if not isinstance(node, dict):
            raise RenderError(f"dig: {_kind(node)} is not a map")
        if key not in node:
            return default
        node = node[key]
    return node


def _kind_is(kind, v):
    """Sprig's kindIs, with reflect's kind names (values numbers are float64)."""
    names = {"nil": "invalid", "bool": "bool", "int": "int", "float": "float64",
             "string": "string", "slice": "slice", "map": "map"}
    return names.get(_kind(v)) == kind


def _unquote(tok):
    if tok.startswith("`"):
        return tok[1:-1]
    try:
        return ast.literal_eval(tok)
    except (ValueError, SyntaxError) as err:
        raise RenderError(f"bad string {tok}: {err}")


TOKEN_RE = re.compile(r"""
  (?P<ws>\s+)
| (?P<str>"(?:\\.|[^"\\])*")
| (?P<raw>`[^`]*`)
| (?P<char>'(?:\\.|[^'\\])+')
| (?P<decl>:=)
| (?P<assign>=)
| (?P<pipe>\|)
| (?P<lp>\()
| (?P<rp>\))
| (?P<comma>,)
| (?P<var>\$[A-Za-z0-9_]*)
| (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+)
| (?P<num>[-+]?(?:0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+(?:[eE][-+]?\d+)?))
| (?P<dot>\.)
| (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
""", re.X)

KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block",
            "break", "continue"}


class TemplateParser:
    """Parses one template file into nodes, collecting its defines."""

    def __init__(self, name, text):
        self.name = name
        self.text = text
        self.defines = {}

    def where(self, line):
        return f"{self.name}:{line}"

    def items(self):
        """Text and action items, with trim markers applied."""
        text, items, pos, trim_next = self.text, [], 0, False
        while True:
            start = text.find("{{", pos)
            chunk = text[pos:] if start == -1 else text[pos:start]
            if trim_next:
                chunk = chunk.lstrip(" \t\r\n")
            if start == -1:
                items.append(("text", chunk, None))
                return items
            line = text.count("\n", 0, start) + 1
            i = start + 2
            if text[i:i + 1] == "-" and text[i + 1:i + 2] in (" ", "\t", "\r", "\n"):
                chunk = chunk.rstrip(" \t\r\n")
                i += 1
            items.append(("text", chunk, None))
            j = i
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            if text.startswith("/*", j):
                end = text.find("*/", j + 2)
                if end == -1:
                    raise RenderError(f"{self.where(line)}: unclosed comment")
                m = re.compile(r"\s*(-)?\s*\}\}").match(text, end + 2)
                if not m:
                    raise RenderError(f"{self.where(line)}: comment ends before the closing delimiter")
                trim_next = m.group(1) is not None
                pos = m.end()
                continue
            k, quote = i, None
            while k < len(text):
                c = text[k]
                if quote:
                    if c == "\\" and quote != "`":
                        k += 2
                        continue
                    if c == quote:
                        quote = None
                elif c in "\"`'":
                    quote = c
                elif text.startswith("}}", k):
                    break
                k += 1
            else:
                raise RenderError(f"{self.where(line)}: unclosed action")
            inner = text[i:k]
            trim_next = bool(re.search(r"\s-$", inner))
            if trim_next:
                inner = inner[:-1]
            items.append(("action", inner.strip(), line))
            pos = k + 2

    def tokens(self, inner, line):
        toks, pos, ws = [], 0, True
        while pos < len(inner):
            m = TOKEN_RE.match(inner, pos)
            if not m:
                raise RenderError(f"{self.where(line)}: unexpected {inner[pos:pos + 10]!r}")
            kind = m.lastgroup
            if kind == "ws":
                ws = True
            else:
                toks.append((kind, m.group(), ws))
                ws = False
            pos = m.end()
        return toks

    def parse(self):
        self._items = self.items()
        self._pos = 0
        nodes, term = self.parse_list(())
        if term is not None:
            raise RenderError(f"{self.where(term[2])}: unexpected {term[0]}")
        return nodes, self.defines

    def parse_list(self, stops):
        """Nodes up to an action whose keyword is in stops; returns (nodes,
        (keyword, tokens, line)) or (nodes, None) at the end of the text."""
        nodes = []
        while self._pos < len(self._items):
            kind, val, line = self._items[self._pos]
            self._pos += 1
            if kind == "text":
                if val:
                    nodes.append(("text", val))
                continue
            toks = self.tokens(val, line)
            if not toks:
                raise RenderError(f"{self.where(line)}: empty action")
            word = toks[0][1] if toks[0][0] == "ident" and toks[0][1] in KEYWORDS else None
            if word in ("end", "else"):
                if word not in stops:
                    raise RenderError(f"{self.where(line)}: unexpected {{{{{word}}}}}")
                return nodes, (word, toks[1:], line)
            if word in ("if", "with"):
                nodes.append(self.parse_branch(word, toks[1:], line))
            elif word == "range":
                pipe = self.parse_pipeline(toks[1:], line, allow_range_decl=True)
                body, term = self.parse_list(("end", "else"))
                other = []
                if term and term[0] == "else":
                    other, term = self.parse_list(("end",))
                if term is None:
                    raise RenderError(f"{self.where(line)}: range without end")
                nodes.append(("range", pipe, body, other, line))
            elif word in ("define", "block"):
                if len(toks) < 2 or toks[1][0] not in ("str", "raw"):
                    raise RenderError(f"{self.where(line)}: {word} needs a name")
                name = _unquote(toks[1][1])
                body, term = self.parse_list(("end",))
                if term is None:
                    raise RenderError(f"{self.where(line)}: {word} without end")
                self.defines[name] = body
                if word == "block":
                    pipe = self.parse_pipeline(toks[2:], line) if len(toks) > 2 else None
                    nodes.append(("template", name, pipe, line))
            elif word == "template":
                if len(toks) < 2 or toks[1][0] not in ("str", "raw"):
                    raise RenderError(f"{self.where(line)}: template needs a name")
                pipe = self.parse_pipeline(toks[2:], line) if len(toks) > 2 else None
                nodes.append(("template", _unquote(toks[1][1]), pipe, line))
            elif word in ("break", "continue"):
                nodes.append((word, line))
            else:
                nodes.append(("action", self.parse_pipeline(toks, line), line))
        return nodes, None

    def parse_branch(self, word, toks, line):
        pipe = self.parse_pipeline(toks, line)
        body, term = self.parse_list(("end", "else"))
        other = []
        if term and term[0] == "else":
            rest = term[1]
            if rest and rest[0][0] == "ident" and rest[0][1] in ("if", "with"):
                # `else if` / `else with`: the nested branch takes the `end`.
                other = [self.parse_branch(rest[0][1], rest[1:], term[2])]
                return (word, pipe, body, other, line)
            other, term = self.parse_list(("end",))
        if term is None:
            raise RenderError(f"{self.where(line)}: {word} without end")
        return (word, pipe, body, other, line)

    def parse_pipeline(self, toks, line, allow_range_decl=False):
        """(decl_vars, is_assign, commands); a command is a list of operands."""
        pos, decl, assign = 0, [], False
        if len(toks) >= 2 and toks[0][0] == "var" and toks[1][0] in ("decl", "assign"):
            decl, assign, pos = [toks[0][1]], toks[1][0] == "assign", 2
        elif (allow_range_decl and len(toks) >= 4 and toks[0][0] == "var" and toks[1][0] == "comma"
              and toks[2][0] == "var" and toks[3][0] in ("decl", "assign")):
            decl, assign, pos = [toks[0][1], toks[2][1]], toks[3][0] == "assign", 4
        cmds, pos = self.parse_commands(toks, pos, line, nested=False)
        if not cmds:
            raise RenderError(f"{self.where(line)}: missing value")
        return (decl, assign, cmds)

    def parse_commands(self, toks, pos, line, nested):
        cmds, cmd = [], []
        while pos < len(toks):
            kind = toks[pos][0]
            if kind == "rp":
                if not nested:
                    raise RenderError(f"{self.where(line)}: unexpected )")
                break
            if kind == "pipe":
                if not cmd:
                    raise RenderError(f"{self.where(line)}: missing command before |")
                cmds.append(cmd)
                cmd = []
                pos += 1
                continue
            operand, pos = self.parse_operand(toks, pos, line)
            cmd.append(operand)
        if cmd:
            cmds.append(cmd)
        elif cmds:
            raise RenderError(f"{self.where(line)}: missing command after |")
        return cmds, pos

    def parse_operand(self, toks, pos, line):
        kind, val, _ = toks[pos]
        pos += 1
        if kind in ("str", "raw"):
            node = ("lit", _unquote(val))
        elif kind == "char":
            node = ("lit", ord(_unquote(val)))
        elif kind == "num":
            integer = re.fullmatch(r"[-+]?(?:0[xX][0-9a-fA-F]+|\d+)", val)
            node = ("lit", int(val, 16 if "x" in val.lower() else 10) if integer else float(val))
        elif kind == "ident":
            node = {"true": ("lit", True), "false": ("lit", False), "nil": ("lit", None)}.get(val, ("fn", val))
        elif kind == "var":
            node = ("var", val)
        elif kind == "field":
            return ("field", ("dot",), val[1:].split(".")), pos
        elif kind == "dot":
            node = ("dot",)
        elif kind == "lp":
            cmds, pos = self.parse_commands(toks, pos, line, nested=True)
            if pos >= len(toks) or toks[pos][0] != "rp":
                raise RenderError(f"{self.where(line)}: unclosed (")
            pos += 1
            node = ("paren", ([], False, cmds))
        else:
            raise RenderError(f"{self.where(line)}: unexpected {val!r}")
        if pos < len(toks) and toks[pos][0] == "field" and not toks[pos][2]:
            node = ("field", node, toks[pos][1][1:].split("."))
            pos += 1
        return node, pos


class Renderer:
    """Executes parsed templates with the Sprig/Helm functions."""

    def __init__(self, templates, lookup=None):
        self.templates = templates
        self.lookup = lookup or (lambda *args: {})
        self.depth = 0
        self.funcs = {
            "include": self.include, "lookup": lambda *a: self.lookup(*a),
            "fail": self.fail, "required": self.required,
            "default": lambda d, *given: d if not given or empty(given[0]) else given[0],
            "empty": empty, "coalesce": lambda *a: next((x for x in a if not empty(x)), None),
            "ternary": lambda t, f, c: t if truth(c) else f,
            "not": lambda v: not truth(v), "eq": go_eq, "ne": lambda a, b: not go_eq(a, b),
            "lt": lambda a, b: _go_less("lt", a, b), "gt": lambda a, b: _go_less("gt", b, a),
            "le": lambda a, b: not _go_less("le", b, a), "ge": lambda a, b: not _go_less("ge", a, b),
            "len": self.length, "index": _index, "dig": _dig,
            "print": go_sprint, "printf": go_sprintf,
            "println": lambda *a: " ".join(go_str(x) for x in a) + "\n",
            "toString": strval, "toYaml": to_yaml, "toJson": to_json,
            "quote": lambda *a: " ".join(go_quote(strval(x)) for x in a if x is not None),
            "squote": lambda *a: " ".join(f"'{strval(x)}'" for x in a if x is not None),
            "trunc": self.trunc, "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
            "trimPrefix": lambda pre, s: s[len(pre):] if pre and s.startswith(pre) else s,
            "trim": lambda s: s.strip(), "upper": lambda s: s.upper(), "lower": lambda s: s.lower(),
            "contains": lambda sub, s: sub in s, "hasPrefix": lambda pre, s: s.startswith(pre),
            "hasSuffix": lambda suf, s: s.endswith(suf),
            "replace": lambda old, new, s: s.replace(old, new),
            "indent": lambda n, s: " " * n + s.replace("\n", "\n" + " " * n),
            "nindent": lambda n, s: "\n" + " " * n + s.replace("\n", "\n" + " " * n),
            "splitList": lambda sep, s: s.split(sep), "join": lambda sep, l: sep.join(strval(x) for x in (l or [])),
            "first": lambda l: l[0] if l else None, "last": lambda l: l[-1] if l else None,
            "list": lambda *a: list(a), "append": lambda l, v: list(l or []) + [v],
            "concat": lambda *ls: [x for l in ls for x in (l or [])],
            "has": lambda needle, hay: any(needle == x and _kind(needle) == _kind(x) for x in (hay or [])),
            "without": lambda l, *vals: [x for x in (l or []) if x not in vals],
            "uniq": lambda l: [x for i, x in enumerate(l or []) if x not in l[:i]],
            "sortAlpha": lambda l: sorted(strval(x) for x in (l or [])),
            "dict": self.dict_, "get": lambda d, k: d.get(k, "") if isinstance(d, dict) else "",
            "set": self.set_, "unset": lambda d, k: (d.pop(k, None), d)[1],
            "hasKey": lambda d, k: isinstance(d, dict) and k in d,
            "keys": lambda *ds: [k for d in ds for k in d],
            "sha256sum": lambda s: hashlib.sha256(strval(s).encode()).hexdigest(),
            "b64enc": lambda s: base64.b64encode(strval(s).encode()).decode(),
            "int": _to_int, "int64": _to_int, "atoi": _atoi,
            "float64": lambda v: float(v) if v not in (None, "") else 0.0,
            "add": lambda *a: sum(_to_int(x) for x in a), "sub": lambda a, b: _to_int(a) - _to_int(b),
            "regexMatch": lambda rx, s: re.search(rx, s) is not None,
            "kindIs": _kind_is,
        }

    # --- functions that need the renderer ---------------------------------
    def include(self, name, data=None):
        return self.execute(name, data)

    @staticmethod
    def fail(msg):
        raise RenderError(f"fail: {strval(msg)}")

    @staticmethod
    def required(msg, value=None):
        if value is None or value == "":
            raise RenderError(f"required: {strval(msg)}")
        return value

    @staticmethod
    def length(v):
        if v is None:
            return 0
        if not isinstance(v, (str, list, dict)):
            raise RenderError(f"len of type {_kind(v)}")
        return len(v)

    @staticmethod
    def trunc(n, s):
        n = _to_int(n)
        if n < 0 and len(s) + n > 0:
            return s[len(s) + n:]
        if n >= 0 and len(s) > n:
            return s[:n]
        return s

    @staticmethod
    def dict_(*args):
        out = {}
        for i in range(0, len(args), 2):
            out[strval(args[i])] = args[i + 1] if i + 1 < len(args) else ""
        return out

    @staticmethod
    def set_(d, key, value):
        d[key] = value
        return d

    # --- execution ---------------------------------------------------------
    def execute(self, name, dot):
        if name not in self.templates:
            raise RenderError(f'no template "{name}"')
        self.depth += 1
        if self.depth > 100:
            raise RenderError(f'exceeded include depth at "{name}"')
        try:
            out = []
            self.walk(self.templates[name], dot, [["$", dot]], out)
            return "".join(out)
        finally:
            self.depth -= 1

    def walk(self, nodes, dot, scope, out):
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                value = self.pipeline(node[1], dot, scope)
                if not node[1][0]:
                    out.append("" if value is None else go_str(value))
            elif kind in ("if", "with"):
                mark = len(scope)
                value = self.pipeline(node[1], dot, scope)
                if truth(value):
                    self.walk(node[2], value if kind == "with" else dot, scope, out)
                else:
                    self.walk(node[3], dot, scope, out)
                del scope[mark:]
            elif kind == "range":
                self.range_(node, dot, scope, out)
            elif kind == "template":
                data = self.pipeline(node[2], dot, scope) if node[2] else None
                out.append(self.execute(node[1], data))
            elif kind == "break":
                raise BreakLoop()
            elif kind == "continue":
                raise ContinueLoop()

    def range_(self, node, dot, scope, out):
        _, (decl, assign, cmds), body, other, line = node
        mark = len(scope)
        value = self.pipeline(([], False, cmds), dot, scope)
        if value is None:
            pairs = []
        elif isinstance(value, dict):
            pairs = [(k, value[k]) for k in sorted(value)]
        elif isinstance(value, list):
            pairs = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            pairs = [(i, i) for i in range(value)]
        else:
            raise RenderError(f"range can't iterate over {go_str(value)}")
        if not pairs:
            self.walk(other, dot, scope, out)
        for key, elem in pairs:
            del scope[mark:]
            if len(decl) == 2:
                self.bind(decl[0], key, assign, scope)
                self.bind(decl[1], elem, assign, scope)
            elif decl:
                self.bind(decl[0], elem, assign, scope)
            try:
                self.walk(body, elem, scope, out)
            except BreakLoop:
                break
            except ContinueLoop:
                continue
        del scope[mark:]

    @staticmethod
    def bind(name, value, assign, scope):
        if assign:
            for entry in reversed(scope):
                if entry[0] == name:
                    entry[1] = value
                    return
            raise RenderError(f"undefined variable: {name}")
        scope.append([name, value])

    def pipeline(self, pipe, dot, scope):
        decl, assign, cmds = pipe
        value = MISSING
        for cmd in cmds:
            value = self.command(cmd, dot, scope, value)
        if decl:
            self.bind(decl[0], value, assign, scope)
        return value

    def command(self, cmd, dot, scope, final):
        head, args = cmd[0], cmd[1:]
        if head[0] == "fn":
            name = head[1]
            if name in ("and", "or"):
                operands = [lambda a=a: self.arg(a, dot, scope) for a in args]
                if final is not MISSING:
                    operands.append(lambda: final)
                if not operands:
                    raise RenderError(f"{name}: no arguments")
                for get in operands:
                    value = get()
                    if truth(value) != (name == "and"):
                        return value
                return value
            func = self.funcs.get(name)
            if func is None:
                raise RenderError(f'function "{name}" not defined (by this renderer)')
            values = [self.arg(a, dot, scope) for a in args]
            if final is not MISSING:
                values.append(final)
            try:
                return func(*values)
            except RenderError:
                raise
            except (TypeError, AttributeError, ValueError, KeyError) as err:
                raise RenderError(f"error calling {name}: {err}")
        if head[0] == "field" and (args or final is not MISSING):
            target = self.field(head, dot, scope, call=False)
            if not callable(target):
                raise RenderError(f"{'.'.join(head[2])} is not a method but has arguments")
            values = [self.arg(a, dot, scope) for a in args]
            if final is not MISSING:
                values.append(final)
            return target(*values)
        if args or final is not MISSING:
            raise RenderError(f"can't give argument to non-function {head}")
        return self.arg(head, dot, scope)

    def arg(self, node, dot, scope):
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind == "dot":
            return dot
        if kind == "var":
            for name, value in reversed(scope):
                if name == node[1]:
                    return value
            raise RenderError(f"undefined variable: {node[1]}")
        if kind == "field":
            return self.field(node, dot, scope, call=True)
        if kind == "paren":
            return self.pipeline(node[1], dot, scope)
        if kind == "fn":
            return self.command([node], dot, scope, MISSING)
        raise RenderError(f"bad operand {node}")

    def field(self, node, dot, scope, call):
        value = self.arg(node[1], dot, scope)
        names = node[2]
        for i, name in enumerate(names):
            if callable(value):
                value = value()
            if isinstance(value, dict):
                value = value.get(name)
            elif value is None:
                raise RenderError(f"nil pointer evaluating interface {{}}.{name}")
            else:
                raise RenderError(f"can't evaluate field {name} in type {_kind(value)}")
        if call and callable(value):
            value = value()
        return value


def helm_numbers(v):
    """Values as Helm reads a values file (sigs.k8s.io/yaml): numbers are float64."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return float(v)
    if isinstance(v, dict):
        return {k: helm_numbers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [helm_numbers(x) for x in v]
    return v


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


_PARSED = {}


def chart_templates():
    """Every template of the chart, parsed once, by Helm's template names."""
    if not _PARSED:
        for path in sorted(TEMPLATES.rglob("*")):
            if not path.is_file() or path.suffix not in (".yaml", ".yml", ".tpl", ".txt", ".json"):
                continue
            name = f"{CHART.name}/{path.relative_to(CHART)}"
            nodes, defines = TemplateParser(name, path.read_text()).parse()
            _PARSED[name] = nodes
            _PARSED.update(defines)
    return _PARSED


class Rendered:
    """The output of one render: manifests by template, parsed documents,
    and NOTES.txt."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.docs = []
        self.notes = ""
        for name, text in outputs.items():
            if name.endswith("NOTES.txt"):
                self.notes = text
                continue
            # Helm's manifest separator (releaseutil.SplitManifests).
            for part in re.split(r"(?:^|\s*\n)---\s*", text):
                if not part.strip():
                    continue
                try:
                    doc = yaml.safe_load(part)
                except yaml.YAMLError as err:
                    raise RenderError(f"{name}: output is not YAML: {err}".replace("\n", " "))
                if doc is not None:
                    self.docs.append((name, doc))

    def kind(self, kind):
        return [d for _, d in self.docs if isinstance(d, dict) and d.get("kind") == kind]

    def one(self, kind):
        found = self.kind(kind)
        return found[0] if len(found) == 1 else None


def render_chart(overrides=None, nodes=None, namespaces=None, release="cubelet",
                 namespace="kube-system"):
    """Renders the chart like `helm install` (or `helm template` when nodes and
    namespaces are None: lookup then finds nothing). Raises RenderError."""
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = coalesce_values(yaml.safe_load((CHART / "values.yaml").read_text()), overrides)
    values = helm_numbers(values)

    def lookup(api_version, kind, ns, name):
        if kind == "Node" and nodes is not None:
            if name:
                return next((copy.deepcopy(n) for n in nodes if n["metadata"]["name"] == name), {})
            return {"apiVersion": "v1", "kind": "NodeList", "items": copy.deepcopy(nodes)}
        if kind == "Namespace" and namespaces is not None:
            if name:
                return copy.deepcopy(namespaces.get(name, {}))
            return {"apiVersion": "v1", "kind": "NamespaceList",
                    "items": [copy.deepcopy(n) for n in namespaces.values()]}
        return {}

    def files_get(name):
        path = CHART / name
        return path.read_text() if path.is_file() and "templates" not in path.parts else ""

    def cap(key):
        return "APIVersion" if key == "apiVersion" else key[:1].upper() + key[1:]

    templates = chart_templates()
    renderer = Renderer(templates, lookup)
    outputs = {}
    for name in sorted(n for n in templates if n.startswith(f"{CHART.name}/templates/")):
        if Path(name).name.startswith("_"):
            continue
        top = {
            "Values": values,
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm",
                        "IsInstall": True, "IsUpgrade": False, "Revision": 1},
            "Chart": {cap(k): v for k, v in chart_meta.items()},
            "Capabilities": {"KubeVersion": {"Version": "v1.28.0", "Major": "1", "Minor": "28"}},
            "Files": {"Get": files_get},
            "Template": {"Name": name, "BasePath": f"{CHART.name}/templates"},
        }
        outputs[name] = renderer.execute(name, top).replace("<no value>", "")
    return Rendered(outputs)


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


# ---------------------------------------------------------------------------
# Checks of the manifests as rendered.

def check_renderer(report):
    """The renderer against Go text/template and Sprig semantics the checks
    below depend on (each expected output is what Helm prints)."""
    cases = [
        ("assignment reaches the outer variable",
         '{{- $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}', {}, "2"),
        ("a declaration inside a block is scoped to it",
         '{{ $x := 1 }}{{ with "y" }}{{ $x := 2 }}{{ end }}{{ $x }}', {}, "1"),
        ("trim markers", 'a \n {{- "b" -}} \n c', {}, "abc"),
        ("range over a map is in key order",
         '{{ range $k, $v := dict "b" 1 "a" 2 }}{{ $k }}={{ $v }},{{ end }}', {}, "a=2,b=1,"),
        ("get of a missing key is \"\"", '{{ get (dict) "x" | quote }}', {}, '""'),
        ("hasKey sees a key with an empty value", '{{ hasKey (dict "x" "") "x" }}', {}, "true"),
        ("a missing map key prints nothing", "[{{ .missing }}]", {}, "[]"),
        ("default replaces only empty values", '{{ default "d" "" }}{{ "x" | default "e" }}', {}, "dx"),
        ("and short-circuits", '{{ and 0 (fail "evaluated") }}', {}, "0"),
        ("else if", "{{ if false }}a{{ else if true }}b{{ else }}c{{ end }}", {}, "b"),
        ("include into a pipeline", '{{ define "t" }}[{{ . }}]{{ end }}{{ include "t" "x" | upper }}', {}, "[X]"),
        ("printf", '{{ printf "%s-%d" "a" 3 }}', {}, "a-3"),
        ("trunc and trimSuffix", '{{ trunc 3 "abcdef" }}{{ "x-" | trimSuffix "-" }}', {}, "abcx"),
        ("a values number prints as float64", "{{ .n }} {{ .m }}", {"n": 1048576.0, "m": 300.0},
         "1.048576e+06 300"),
        ("range else", "{{ range .l }}x{{ else }}none{{ end }}", {"l": []}, "none"),
    ]
    for name, text, dot, want in cases:
        try:
            nodes, defines = TemplateParser("selftest", text).parse()
            got = Renderer({"selftest": nodes, **defines}).execute("selftest", dot)
        except RenderError as err:
            got = f"error: {err}"
        report.check(f"renderer: {name}", got == want, f"got {got!r}, want {want!r}")
    errors = [
        ("a field of nil is an error", "{{ .a.b }}", {}),
        ("eq of a number and a string is an error", '{{ eq 1 "1" }}', {}),
        ("an unknown function is an error", "{{ nosuchfunction 1 }}", {}),
    ]
    for name, text, dot in errors:
        try:
            nodes, defines = TemplateParser("selftest", text).parse()
            got = Renderer({"selftest": nodes, **defines}).execute("selftest", dot)
            report.check(f"renderer: {name}", False, f"rendered {got!r}")
        except RenderError:
            report.check(f"renderer: {name}", True)


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
    """render_chart, reported once per distinct input; None if it failed."""
    key = json.dumps([overrides, kwargs], sort_keys=True)
    if key not in _RENDERS:
        try:
            _RENDERS[key] = render_chart(overrides, **kwargs)
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
    rendered = _render(report, "values without namespace, as --reuse-values from 0.1.0",
                       {"namespace": None}, nodes=SAMPLE_NODES)
    if rendered is not None:
        wrong = [o for o in _namespaced(rendered) if o[2] != "kube-system"]
        report.check("without a namespace key every object is in the release namespace",
                     not wrong and not rendered.kind("Namespace"), f"{wrong}")
    try:
        render_chart({"namespace": {"create": True}})
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
    check_renderer(report)
    check_rendered_basics(report, values, schema)
    check_selectors(report)
    check_uninstall_placement(report)
    check_namespace(report)
    check_run_as_root(report)
    check_readme(report, values)
    print(f"{report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
