#!/usr/bin/env python3
"""Where a CRI call's time goes: reads a Cubelet log written with
CUBELET_LOG_SPANS=1 (spans logged as they close) and prints, per span path
(parents:child), how many closed and the p50 of their wall time (busy +
idle) and of their busy time (the agent on a CPU), in ms.

Usage: hack/span-times.py LOG [SPAN...]
  SPAN: only paths through a span of one of these names, e.g. create_container
Typical: CUBELET_LOG_SPANS=1 CUBELET_E2E_LOG=info,cubelet_runtime=debug
         cri-bench --cubelet cubelet --keep-logs /tmp/logs ...
         hack/span-times.py /tmp/logs/cubelet.log create_container remove_container
"""
import re
import sys

LINE = re.compile(
    r"^\S+\s+[A-Z]+\s+(?P<spans>.*): (?P<target>[\w:]+): close "
    r"time\.busy=(?P<busy>[\d.]+)(?P<bu>\D+?) time\.idle=(?P<idle>[\d.]+)(?P<iu>\D+?)\s*$"
)
UNIT_MS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1000.0}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def p50(values):
    v = sorted(values)
    return v[max(0, (len(v) + 1) // 2 - 1)] if v else 0.0


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    prefixes = argv[2:]
    spans = {}
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        for raw in f:
            m = LINE.match(ANSI.sub("", raw))
            if not m:
                continue
            path = re.sub(r"\{[^}]*\}", "", m["spans"])
            if prefixes and not any(p in path.split(":") for p in prefixes):
                continue
            busy = float(m["busy"]) * UNIT_MS.get(m["bu"], 1.0)
            idle = float(m["idle"]) * UNIT_MS.get(m["iu"], 1.0)
            spans.setdefault(path, []).append((busy + idle, busy))
    if not spans:
        print("no closed spans found (was the agent run with CUBELET_LOG_SPANS=1?)", file=sys.stderr)
        return 1
    width = max(len(p) for p in spans)
    print(f"{'span':<{width}} {'n':>5} {'p50 ms':>8} {'busy ms':>8}")
    for path in sorted(spans):
        v = spans[path]
        print(
            f"{path:<{width}} {len(v):>5} {p50([w for w, _ in v]):>8.2f} {p50([b for _, b in v]):>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
