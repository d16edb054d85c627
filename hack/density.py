#!/usr/bin/env python3
"""Density benchmark through a real control plane: one kubelet at a time on
Cubelet and on containerd's CRI, alternating round by round.

Each round, for each runtime: a kubelet (v1.28, registered with the API
server of hack/cluster.sh) on that runtime's socket; a Deployment scaled
0 -> N (time until all Ready, pods/s, per-pod start as the API shows it,
kubelet's own pod-start SLI histogram, RunPodSandbox errors kubelet saw,
FailedCreatePodSandBox events) and N -> 0 (time until the API has no pod
and until the runtime lists no pod); then N static pods written at once and
removed at once. Figures are printed side by side with the ratio to
containerd; `--csv` keeps the ready-count curves, `--plot` draws them.

Run by hand as root from the repository, with the shared test services up
(hack/containerd.sh, hack/registry.sh, hack/test-images.sh), release
binaries (cargo build --release -p cubelet; hack/build-pause.sh) and the
reference binaries on PATH or named by env var (KUBELET_BIN, KUBECTL_BIN,
CRICTL_BIN; kube-apiserver, kube-controller-manager, kube-scheduler as
hack/cluster.sh finds them). Exits 3 with one line naming what is missing.

Everything it makes carries a test name and is removed: its cluster
(own ports and dirs), the Cubelet (own socket, dirs, bridge, containerd
namespace, removed with `cubelet uninstall`), kubelet's dirs, mounts,
sysctls and log dirs, the containerd CNI network if it brought it up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HACK = REPO / "hack"
NS = "cbdensity"
IMAGE = "127.0.0.1:5000/busybox:test"
CONTAINERD_SOCK = os.environ.get(
    "CUBELET_TEST_CONTAINERD", "/run/cubelet-test/containerd/containerd.sock"
)
# Kubelet writes these at start; they are put back after each kubelet.
SYSCTLS = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
]
# The cluster of this bench: its own dirs and ports, so a node e2e run or a
# developer's cluster on hack/cluster.sh's defaults is never touched.
CLUSTER_ENV = {
    "CLUSTER_ROOT": "/var/lib/cubelet-test/cluster-density",
    "CLUSTER_STATE": "/run/cubelet-test/cluster-density",
    "CLUSTER_ETCD_PORT": "23890",
    "CLUSTER_API_PORT": "16543",
    "CLUSTER_CM_PORT": "20357",
    "CLUSTER_SCHED_PORT": "20359",
}


def log(msg: str) -> None:
    print(f"[density] {msg}", file=sys.stderr, flush=True)


def which(env: str, *names: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def run(*args: str, check: bool = True, env: dict | None = None, timeout: float = 120, **kw) -> str:
    try:
        res = subprocess.run(
            list(args), capture_output=True, text=True, env=env, check=False, timeout=timeout, **kw
        )
    except subprocess.TimeoutExpired as e:
        if check:
            raise RuntimeError(f"{' '.join(args)}: no answer within {timeout} s") from e
        return ""
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {res.returncode}: {res.stderr.strip()}")
    return res.stdout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (loopback)
        return r.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def buckets(text: str, name: str, **labels: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name`, summed over the series
    whose labels include `labels`."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}_bucket\{{(.*)\}}\s+(\S+)", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if any(got.get(k) != v for k, v in labels.items()):
            continue
        le = got.get("le", "+Inf")
        key = float("inf") if le == "+Inf" else float(le)
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def hist_quantile(before: dict, after: dict, q: float) -> float | None:
    """Quantile of the observations between two scrapes, interpolated
    linearly inside a bucket as Prometheus' histogram_quantile does."""
    delta = sorted((le, after.get(le, 0) - before.get(le, 0)) for le in after)
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in delta:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9)
        prev_le, prev_n = le, n
    return None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Watch:
    """`kubectl get pods -w` in the bench namespace: when each pod was first
    seen and first seen Ready, as this process received the events."""

    def __init__(self, kubectl: str, env: dict):
        tmpl = (
            '{.metadata.name} {.metadata.deletionTimestamp} '
            '{.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
        )
        self.proc = subprocess.Popen(
            [kubectl, "-n", NS, "get", "pods", "-w", "-o", f"jsonpath={tmpl}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.seen: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            parts = line.split()
            if not parts:
                continue
            name = parts[0]
            with self.lock:
                self.seen.setdefault(name, now)
                if parts[-1] == "True" and name not in self.ready:
                    self.ready[name] = now

    def ready_count(self) -> int:
        with self.lock:
            return len(self.ready)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


class Cluster:
    def __init__(self):
        self.env = {**os.environ, **CLUSTER_ENV}
        self.started = False

    def start(self) -> None:
        res = subprocess.run([str(HACK / "cluster.sh"), "start"], env=self.env)
        if res.returncode == 3:
            raise Missing("control plane binaries (see hack/cluster.sh)")
        if res.returncode != 0:
            raise RuntimeError("hack/cluster.sh start failed")
        self.started = True
        out = run(str(HACK / "cluster.sh"), "env", env=self.env)
        for line in out.splitlines():
            k, v = line.removeprefix("export ").split("=", 1)
            self.env[k] = v

    def stop(self) -> None:
        if self.started:
            subprocess.run([str(HACK / "cluster.sh"), "stop"], env=self.env, check=False)


class Missing(Exception):
    pass


class CubeletDaemon:
    """A Cubelet of the bench's own on the shared test containerd."""

    def __init__(self, binary: Path, pause: Path):
        self.base_run = Path("/run/cubelet-density")
        self.base_lib = Path("/var/lib/cubelet-density")
        self.socket = self.base_run / "cubelet.sock"
        self.metrics = f"127.0.0.1:{free_port()}"
        self.cfg_dir = Path(tempfile.mkdtemp(prefix="cubelet-density-config"))
        certs = self.cfg_dir / "certs.d" / "127.0.0.1:5000"
        certs.mkdir(parents=True)
        (certs / "hosts.toml").write_text(
            'server = "http://127.0.0.1:5000"\n\n[host."http://127.0.0.1:5000"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        self.config = self.cfg_dir / "config.yaml"
        self.config.write_text(
            f"socket: {self.socket}\n"
            f"root_dir: {self.base_lib}/root\n"
            f"state_dir: {self.base_run}/state\n"
            f"containerd:\n  address: {CONTAINERD_SOCK}\n  namespace: cubelet-density\n"
            f"  root: /var/lib/cubelet-test/containerd\n"
            f"metrics:\n  address: {self.metrics}\n"
            f"images:\n  pause_binary: {pause}\n  registry_config_dir: {self.cfg_dir / 'certs.d'}\n"
            "runtime:\n  default_handler: runc\n  handlers:\n"
            "    runc: { runtime_type: io.containerd.runc.v2, binary: /usr/sbin/runc, "
            "root: /run/cubelet-test/runc }\n"
            "network:\n  provider: bridge\n"
            "  bridge: { name: cbdens0, subnet: 10.204.0.0/22, mtu: 1500 }\n"
        )
        (self.cfg_dir / "config.d").mkdir()
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.logf = None

    def start(self) -> None:
        self.base_lib.mkdir(parents=True, exist_ok=True)
        self.logf = open(self.base_lib / "cubelet.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(self.binary), "--config", str(self.config)],
            stdout=self.logf,
            stderr=self.logf,
            stdin=subprocess.DEVNULL,
        )
        for _ in range(300):
            try:
                scrape(f"http://{self.metrics}/readyz")
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise RuntimeError(f"Cubelet not ready; see {self.base_lib}/cubelet.log")

    def scrape(self) -> str:
        return scrape(f"http://{self.metrics}/metrics")

    def stop(self, keep_log: Path | None) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.logf:
            self.logf.close()
        if keep_log and (self.base_lib / "cubelet.log").exists():
            shutil.copy(self.base_lib / "cubelet.log", keep_log)
        subprocess.run(
            [str(self.binary), "uninstall", "--config", str(self.config)],
            check=False,
            capture_output=True,
        )
        for d in (self.base_run, self.base_lib, self.cfg_dir):
            shutil.rmtree(d, ignore_errors=True)


class Kubelet:
    """One kubelet registered as `node` on `socket`, run for one round."""

    def __init__(self, binary: str, node: str, socket: str, kubeconfig: str, ctrd_ns: str):
        self.node = node
        self.dir = Path(f"/var/lib/cubelet-density-kubelet-{node}")
        self.root = self.dir / "root"
        self.manifests = self.dir / "manifests"
        for p in (self.root, self.manifests, self.dir / "volume-plugins"):
            p.mkdir(parents=True, exist_ok=True)
        self.ro_port = free_port()
        config = self.dir / "config.yaml"
        config.write_text(
            "apiVersion: kubelet.config.k8s.io/v1beta1\n"
            "kind: KubeletConfiguration\n"
            f"staticPodPath: {self.manifests}\n"
            "fileCheckFrequency: 1s\n"
            "address: 127.0.0.1\n"
            f"port: {free_port()}\n"
            f"readOnlyPort: {self.ro_port}\n"
            "healthzBindAddress: 127.0.0.1\n"
            f"healthzPort: {free_port()}\n"
            "authentication: { anonymous: { enabled: true }, webhook: { enabled: false } }\n"
            "authorization: { mode: AlwaysAllow }\n"
            f"containerRuntimeEndpoint: unix://{socket}\n"
            f"imageServiceEndpoint: unix://{socket}\n"
            "failSwapOn: false\n"
            "cgroupDriver: cgroupfs\n"
            "cgroupsPerQOS: false\n"
            "enforceNodeAllocatable: []\n"
            "makeIPTablesUtilChains: false\n"
            "maxPods: 250\n"
            "serializeImagePulls: false\n"
            f"volumePluginDir: {self.dir / 'volume-plugins'}\n"
            'evictionHard: { memory.available: "1Mi", nodefs.available: "0%", '
            'nodefs.inodesFree: "0%", imagefs.available: "0%" }\n'
        )
        self.sysctls = {}
        for k in SYSCTLS:
            try:
                self.sysctls[k] = Path(f"/proc/sys/{k}").read_text().strip()
            except OSError:
                pass
        self.host_paths = [
            p
            for p in ("/var/log/pods", "/var/log/containers", "/var/lib/kubelet")
            if not Path(p).exists()
        ]
        self.logf = open(self.dir / "kubelet.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.root}",
                f"--cert-dir={self.dir / 'certs'}",
                f"--hostname-override={node}",
                f"--containerd={CONTAINERD_SOCK}",
                f"--containerd-namespace={ctrd_ns}",
                "--v=1",
            ],
            stdout=self.logf,
            stderr=self.logf,
            stdin=subprocess.DEVNULL,
        )

    def scrape(self) -> str:
        return scrape(f"http://127.0.0.1:{self.ro_port}/metrics")

    def stop(self, keep_log: Path | None) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        if keep_log:
            shutil.copy(self.dir / "kubelet.log", keep_log)
        for k, v in self.sysctls.items():
            try:
                Path(f"/proc/sys/{k}").write_text(v)
            except OSError as e:
                log(f"restore {k}: {e}")
        mounts = [
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(self.root))
        ]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        for d, match in (("/var/log/pods", f"{NS}_"), ("/var/log/containers", f"_{NS}_")):
            for e in Path(d).glob("*") if Path(d).exists() else []:
                if (e.name.startswith(match) if d.endswith("pods") else match in e.name):
                    if e.is_dir() and not e.is_symlink():
                        shutil.rmtree(e, ignore_errors=True)
                    else:
                        e.unlink(missing_ok=True)
        for p in reversed(self.host_paths):
            shutil.rmtree(p, ignore_errors=True)


def deployment(node: str, replicas: int) -> str:
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "density", "namespace": NS},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": "density"}},
                "template": {
                    "metadata": {"labels": {"app": "density"}},
                    "spec": pod_spec(node),
                },
            },
        }
    )


def pod_spec(node: str | None) -> dict:
    spec = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "c",
                "image": IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "3600"],
                "resources": {"requests": {"cpu": "1m", "memory": "4Mi"}},
            }
        ],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return spec


def sandbox_failures(k, node: str) -> int:
    """FailedCreatePodSandBox events this node's kubelet reported (events
    outlive a round, so they are counted by their source host)."""
    out = k("-n", NS, "get", "events", "--field-selector", "reason=FailedCreatePodSandBox",
            "-o", "json", check=False)
    try:
        items = json.loads(out).get("items", [])
    except ValueError:
        return 0
    return sum(int(e.get("count") or 1) for e in items if e.get("source", {}).get("host") == node)


# kubelet's runtime calls whose durations are reported per phase, from
# kubelet_runtime_operations_duration_seconds (the same histogram for both
# runtimes: what kubelet waited for, queueing in the runtime included).
OPS = ["run_podsandbox", "create_container", "start_container", "stop_container",
       "stop_podsandbox", "remove_podsandbox"]


def op_quantiles(before: str, after: str, r: dict, phase: str) -> None:
    name = "kubelet_runtime_operations_duration_seconds"
    for op in OPS:
        b = buckets(before, name, operation_type=op)
        a = buckets(after, name, operation_type=op)
        for q in (0.5, 0.99):
            v = hist_quantile(b, a, q)
            if v is not None:
                r[f"op_{phase}_{op}_p{int(q * 100)}"] = v


def crictl_count(crictl: str, socket: str, what: str, *flags: str) -> int:
    out = run(
        crictl, "--runtime-endpoint", f"unix://{socket}", "--timeout", "10s",
        what, "-q", "--label", f"io.kubernetes.pod.namespace={NS}", *flags,
        check=False,
    )
    return len(out.split())


def wait_until(pred, timeout: float, step: float = 0.2, since: float | None = None) -> float | None:
    """Seconds from `since` (default: now) until `pred()` held, or None
    once `timeout` has passed since then."""
    t0 = time.monotonic() if since is None else since
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def remove_runtime_pods(crictl: str, socket: str) -> None:
    ids = run(
        crictl, "--runtime-endpoint", f"unix://{socket}", "pods", "-q",
        "--label", f"io.kubernetes.pod.namespace={NS}", check=False,
    ).split()
    for i in ids:
        run(crictl, "--runtime-endpoint", f"unix://{socket}", "stopp", i, check=False)
        run(crictl, "--runtime-endpoint", f"unix://{socket}", "rmp", "-f", i, check=False)


def one_round(
    rt: str, rnd: int, socket: str, args, tools, cluster: Cluster, cubelet, out_dir: Path
) -> dict:
    kubectl = tools["kubectl"]
    env = cluster.env
    k = lambda *a, **kw: run(kubectl, *a, env=env, **kw)  # noqa: E731
    # A node name per round: the last round's Node object may still be
    # going away when the next kubelet registers.
    node = f"cbdensity-{rt}-{rnd}"
    ctrd_ns = "cubelet-density" if rt == "cubelet" else "k8s.io"
    kubelet = Kubelet(tools["kubelet"], node, socket, env["KUBECONFIG"], ctrd_ns)
    r: dict = {"runtime": rt}
    try:
        if wait_until(lambda: "True" in k(
            "get", "node", node, "-o",
            'jsonpath={.status.conditions[?(@.type=="Ready")].status}', check=False,
        ), 120, 0.5) is None:
            raise RuntimeError(f"node {node} not Ready; see {kubelet.dir}/kubelet.log")
        # Pull once so the rounds time starts, not a pull.
        run(tools["crictl"], "--runtime-endpoint", f"unix://{socket}", "pull", IMAGE)

        # Deployment 0 -> N.
        k("apply", "-f", "-", input=deployment(node, 0))
        before_k = kubelet.scrape()
        before_c = cubelet.scrape() if cubelet else ""
        watch = Watch(kubectl, env)
        t0 = time.monotonic()
        k("-n", NS, "scale", "deploy/density", f"--replicas={args.pods}")
        all_ready = wait_until(lambda: watch.ready_count() >= args.pods, args.timeout, 0.05, t0)
        after_k = kubelet.scrape()
        after_c = cubelet.scrape() if cubelet else ""
        watch.stop()
        starts = [watch.ready[n] - watch.seen[n] for n in watch.ready if n in watch.seen]
        r["ready_s"] = all_ready
        r["pods_per_s"] = args.pods / all_ready if all_ready else None
        r["start_p50"] = pct(starts, 0.5)
        r["start_p99"] = pct(starts, 0.99)
        sli_b = buckets(before_k, "kubelet_pod_start_sli_duration_seconds")
        sli_a = buckets(after_k, "kubelet_pod_start_sli_duration_seconds")
        r["sli_p50"] = hist_quantile(sli_b, sli_a, 0.5)
        r["sli_p99"] = hist_quantile(sli_b, sli_a, 0.99)
        err = "kubelet_runtime_operations_errors_total"
        op_quantiles(before_k, after_k, r, "up")
        r["runpod_errors"] = metric_sum(after_k, err, operation_type="run_podsandbox") - metric_sum(
            before_k, err, operation_type="run_podsandbox"
        )
        r["failed_sandbox_events"] = sandbox_failures(k, node)
        r["curve"] = sorted(v - t0 for v in watch.ready.values())
        if cubelet:
            name = "cubelet_flow_admission_wait_seconds_count"
            rej = "cubelet_flow_rejections_total"
            r["rejected"] = metric_sum(after_c, rej, flow="create") - metric_sum(
                before_c, rej, flow="create"
            )
            # Requests admitted at once are not in the histogram: every
            # admitted sample waited for a slot.
            r["admitted_after_wait"] = metric_sum(
                after_c, name, flow="create", result="admitted"
            ) - metric_sum(before_c, name, flow="create", result="admitted")
            hits = metric_sum(after_c, "cubelet_pool_hits_total") - metric_sum(before_c, "cubelet_pool_hits_total")
            misses = metric_sum(after_c, "cubelet_pool_misses_total") - metric_sum(before_c, "cubelet_pool_misses_total")
            r["pool_hit_rate"] = hits / (hits + misses) if hits + misses else None
            anchors = "cubelet_stats_anchors_total"
            r["anchors_during_up"] = metric_sum(after_c, anchors) - metric_sum(before_c, anchors)

        # Deployment N -> 0.
        t0 = time.monotonic()
        k("-n", NS, "scale", "deploy/density", "--replicas=0")
        r["api_empty_s"] = wait_until(
            lambda: not k("-n", NS, "get", "pods", "-o", "name", check=False).split(),
            args.timeout, 0.5, t0,
        )
        r["runtime_no_ready_s"] = wait_until(
            lambda: crictl_count(tools["crictl"], socket, "pods", "--state", "ready") == 0,
            args.timeout, 0.2, t0,
        )
        op_quantiles(after_k, kubelet.scrape(), r, "down")
        r["runtime_empty_s"] = wait_until(
            lambda: crictl_count(tools["crictl"], socket, "pods") == 0, args.timeout, 0.5, t0
        )
        k("-n", NS, "delete", "deploy/density", "--wait=true", check=False)

        # N static pods at once, then removed at once.
        if args.static:
            static_k = kubelet.scrape()
            t0 = time.monotonic()
            for i in range(args.static):
                spec = pod_spec(None)
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"static-{i}", "namespace": NS},
                    "spec": spec,
                }
                (kubelet.manifests / f"static-{i}.json").write_text(json.dumps(pod))
            r["static_running_s"] = wait_until(
                lambda: crictl_count(tools["crictl"], socket, "ps", "--state", "running") >= args.static,
                args.timeout, 0.2, t0,
            )
            static_up_k = kubelet.scrape()
            op_quantiles(static_k, static_up_k, r, "static_up")
            t0 = time.monotonic()
            for f in kubelet.manifests.glob("static-*.json"):
                f.unlink()
            r["static_gone_s"] = wait_until(
                lambda: crictl_count(tools["crictl"], socket, "pods", "--state", "ready") == 0,
                args.timeout, 0.2, t0,
            )
            op_quantiles(static_up_k, kubelet.scrape(), r, "static_down")
    finally:
        kubelet.stop(out_dir / f"kubelet-{rt}-{int(time.time())}.log" if args.keep_logs else None)
        remove_runtime_pods(tools["crictl"], socket)
        k("delete", "node", node, "--wait=false", check=False)
        k("-n", NS, "delete", "pods", "--all", "--force", "--grace-period=0", "--wait=false",
          check=False)
    return r


def fmt(v, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}{unit}" if abs(v) < 1 else f"{v:.2f}{unit}"
    return f"{v}{unit}"


def report(results: list[dict], rts: list[str]) -> str:
    rows = [
        ("Deployment 0→N: all Ready (s)", "ready_s"),
        ("pods/s", "pods_per_s"),
        ("per pod, seen → Ready p50 (s)", "start_p50"),
        ("per pod, seen → Ready p99 (s)", "start_p99"),
        ("kubelet pod-start SLI p50 (s)", "sli_p50"),
        ("kubelet pod-start SLI p99 (s)", "sli_p99"),
        ("kubelet RunPodSandbox errors", "runpod_errors"),
        ("FailedCreatePodSandBox events", "failed_sandbox_events"),
        ("N→0: API lists no pod (s)", "api_empty_s"),
        ("N→0: runtime lists no ready pod (s)", "runtime_no_ready_s"),
        ("N→0: runtime lists no pod (s)", "runtime_empty_s"),
        ("static pods: all running (s)", "static_running_s"),
        ("static pods removed: no ready pod (s)", "static_gone_s"),
        ("Cubelet create rejections", "rejected"),
        ("Cubelet creates admitted after a wait", "admitted_after_wait"),
        ("Cubelet pool hit rate", "pool_hit_rate"),
        ("Cubelet stats anchors made while scaling up", "anchors_during_up"),
    ]
    for phase, what in (("up", "0→N"), ("down", "N→0"), ("static_up", "static up"),
                        ("static_down", "static down")):
        for op in OPS:
            for q in (50, 99):
                key = f"op_{phase}_{op}_p{q}"
                if any(key in r for r in results):
                    rows.append((f"{what}: kubelet's {op} p{q} (s)", key))
    base = "containerd"
    lines = ["| | " + " | ".join(f"{rt} (median of rounds)" for rt in rts) + " | × containerd |",
             "|---|" + "---|" * (len(rts) + 1)]
    for label, key in rows:
        vals = {}
        for rt in rts:
            xs = [r[key] for r in results if r["runtime"] == rt and r.get(key) is not None]
            vals[rt] = statistics.median(xs) if xs else None
        ratio = ""
        if key.endswith("_s") or key.startswith(("sli", "start", "op_")) or key == "pods_per_s":
            a, b = vals.get("cubelet"), vals.get(base)
            if a is not None and b:
                ratio = f"{a / b:.2f}"
        lines.append(f"| {label} | " + " | ".join(fmt(vals[rt]) for rt in rts) + f" | {ratio} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, pods: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: `pip install matplotlib` to plot (the CSV is written anyway)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"cubelet": "tab:blue", "containerd": "tab:orange"}
    seen = set()
    for r in results:
        xs = r.get("curve") or []
        label = r["runtime"] if r["runtime"] not in seen else None
        seen.add(r["runtime"])
        ax.step([0] + xs, list(range(len(xs) + 1)), where="post",
                color=colors.get(r["runtime"]), label=label, alpha=0.8)
    ax.set_xlabel("seconds since the Deployment was scaled to %d" % pods)
    ax.set_ylabel("pods Ready")
    ax.set_title("Deployment 0 → %d on one node, kubelet v1.28.7 (each round)" % pods)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--static", type=int, default=100, help="static pods (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runtimes", default="cubelet,containerd")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, default=REPO / "target" / "density")
    ap.add_argument("--plot", type=Path, help="write the ready-count curves as a PNG")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--cubelet-config", type=Path, help="a drop-in for the bench's Cubelet")
    args = ap.parse_args()
    # A background start (`cmd &` without job control) ignores SIGINT: make
    # both SIGINT and SIGTERM unwind through the cleanup.
    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    if os.geteuid() != 0:
        print("density: run as root", file=sys.stderr)
        return 2
    rts = args.runtimes.split(",")
    tools = {
        "kubelet": which("KUBELET_BIN", "kubelet-v1.28.7", "kubelet"),
        "kubectl": which("KUBECTL_BIN", "kubectl"),
        "crictl": which("CRICTL_BIN", "crictl"),
    }
    missing = [n for n, p in tools.items() if not p]
    cubelet_bin = REPO / "target" / "release" / "cubelet"
    pause = Path(os.environ.get("PAUSE_BIN", REPO / "target" / "cubelet-pause"))
    if "cubelet" in rts and not cubelet_bin.exists():
        missing.append(f"{cubelet_bin} (cargo build --release -p cubelet)")
    if "cubelet" in rts and not pause.exists():
        missing.append(f"{pause} (hack/build-pause.sh)")
    if missing:
        print(f"density: skipped, missing: {', '.join(missing)}", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster()
    cni_up = False
    cubelet = None
    results: list[dict] = []
    try:
        cluster.start()
        run(tools["kubectl"], "create", "namespace", NS, env=cluster.env, check=False)
        if "containerd" in rts and subprocess.run(
            [str(HACK / "bench-containerd-cni.sh"), "status"], capture_output=True
        ).returncode != 0:
            run(str(HACK / "bench-containerd-cni.sh"), "up")
            cni_up = True
        if "cubelet" in rts:
            cubelet = CubeletDaemon(cubelet_bin, pause)
            if args.cubelet_config:
                shutil.copy(args.cubelet_config, cubelet.cfg_dir / "config.d" / "50-bench.yaml")
            cubelet.start()
        for rnd in range(args.rounds):
            order = rts if rnd % 2 == 0 else list(reversed(rts))
            for rt in order:
                socket = str(cubelet.socket) if rt == "cubelet" else CONTAINERD_SOCK
                log(f"round {rnd + 1}/{args.rounds}: {rt}")
                r = one_round(rt, rnd + 1, socket, args, tools, cluster,
                              cubelet if rt == "cubelet" else None, args.out)
                r["round"] = rnd + 1
                log(json.dumps({k: v for k, v in r.items() if k != "curve"}))
                results.append(r)
    except Missing as e:
        print(f"density: skipped, missing: {e}", file=sys.stderr)
        return 3
    finally:
        if cubelet:
            cubelet.stop(args.out / "cubelet.log" if args.keep_logs else None)
        if cni_up:
            run(str(HACK / "bench-containerd-cni.sh"), "down", check=False)
        cluster.stop()
    csv = args.out / "density.csv"
    with csv.open("w") as f:
        f.write("runtime,round,pod,ready_s\n")
        for r in results:
            for i, t in enumerate(r.get("curve") or []):
                f.write(f"{r['runtime']},{r['round']},{i + 1},{t:.3f}\n")
    (args.out / "density.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in results], indent=1)
    )
    print(f"\n{args.pods}-pod Deployment and {args.static} static pods on one node, "
          f"{args.rounds} round(s) per runtime, alternating\n")
    print(report(results, rts))
    if args.plot:
        plot(results, args.plot, args.pods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
