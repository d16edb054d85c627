//! A real kubelet against a Cubelet of its own: the upstream kubelet
//! v1.28.7 (`../shared/tools/kubelet-v1.28.7`, standalone, static pods, no
//! API server) drives the daemon over its CRI socket, as on a node.
//!
//! Static pods cover what kubelet does every day: two containers sharing an
//! emptyDir; env with the downward API; requests and limits (checked in the
//! containers' cgroups); exec, httpGet and tcpSocket probes; restartPolicy
//! Always with a container that exits (restart count, last state, the
//! previous run's log file); a hostPort on 127.0.0.1; images the node does
//! not have yet (kubelet pulls them); a pod removed from the manifest
//! directory (teardown). Everything is asserted from kubelet's side: its
//! read-only API (`/pods`, `/stats/summary`), its
//! `kubelet_runtime_operations_errors_total` (0 for every operation) and its
//! log (no runtime error line beyond the few listed in [`KNOWN_E_LINES`],
//! which it prints against containerd 1.6 on this machine too).
//!
//! Kubelet's cAdvisor is pointed at the daemon's containerd namespace
//! (`--containerd`, `--containerd-namespace`), so pod network stats come
//! from the containerd container with the sandbox's id, as they do for
//! containerd's own pods. In the daemon's default `runtime.sandbox: auto`
//! only the pod that shares its process namespace (`shared`) has an infra
//! container; the others run without an infra process and get a *stats
//! anchor* in the background once a container runs (docs/infraless.md), so
//! every pod has every `/stats/summary` field, `network` included, with
//! traffic counted, and `container_network_*` series in
//! `/metrics/cadvisor`: the suite asserts exactly that.
//! `CUBELET_KUBELET_STATS_ANCHOR=0` runs the daemon with
//! `runtime.stats_anchor: false`, where the pods without an infra process
//! have every field but `network`, and no network series.
//! `CUBELET_KUBELET_SANDBOX=pause` runs the daemon with `runtime.sandbox:
//! pause`, where every pod has an infra container.
//! `CUBELET_KUBELET_CRI_STATS=1` turns on kubelet's alpha
//! `PodAndContainerStatsFromCRI`: every pod's network then comes from
//! Cubelet's `ListPodSandboxStats` (read through the netns pin), and the
//! fields in [`CRI_STATS_ABSENT`] go.
//!
//! `CUBELET_KUBELET_TARGET=containerd` runs the same suite with kubelet
//! pointed at the private containerd's own CRI plugin instead (a CNI bridge
//! config of the test's, removed afterwards), for the comparison by hand.
//!
//! Prints SKIP and passes without the kubelet binary (a machine without
//! `../shared`) or without the private containerd.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::image_service_client::ImageServiceClient;
use cubelet_e2e::cri::runtime_service_client::RuntimeServiceClient;
use cubelet_e2e::cri::{
    ContainerStatusRequest, ImageStatusRequest, ListContainersRequest, ListImagesRequest,
    ListPodSandboxRequest, PodSandboxStatusRequest, RemoveImageRequest, RemovePodSandboxRequest,
    StatusRequest, StopPodSandboxRequest,
};
use cubelet_e2e::{
    connect, eventually, http_get, image_spec, run, with_daemon, workspace_root, Daemon, DaemonOpts,
};
use serde_json::Value;
use tonic::transport::Channel;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// Pulled by kubelet for the `pulled` pod; no other pod uses it.
const BUSYBOX_OCI: &str = "127.0.0.1:5000/busybox-oci:test";
const NODE: &str = "cubelet-e2e-node";

/// Error lines kubelet v1.28.7 logs on this machine whatever the runtime
/// (seen against containerd 1.6.20 with the same configuration), matched by
/// substring:
/// - it cannot raise its own fd limit (root lacks CAP_SYS_RESOURCE);
/// - it skips pod syncs until its first PLEG relist, by design;
/// - cAdvisor has no fs data yet for the image filesystem in the first
///   seconds, so the first image GC and `ImageFsInfo` stats fail once;
/// - it cannot move itself into an OOM-protected container (no systemd, and
///   kubelet runs in a container's pid namespace here);
/// - the CPU manager drops the state of containers it saw in a previous run;
/// - the crash-looping pod's back-off is logged as a sync error on purpose;
/// - cAdvisor is asked for a container it has just started watching and has
///   no sample of yet, and its kernel-log OOM watcher may stop reading
///   `/dev/kmsg` (both seen with containerd's own CRI here);
/// - on an emulated machine (the qemu guest of `hack/vm.sh`, about 4x
///   slower) kubelet's own housekeeping pass can take over its 1 s budget:
///   a statement about kubelet's speed, no runtime call failed;
/// - when the test removes a static pod's manifest while kubelet's 20 s
///   re-list of the manifest directory is between its glob and its stat,
///   kubelet logs the vanished file, and the inotify delete that follows
///   finds the pod already gone from its cache (`pkg/kubelet/config`,
///   `file.go` and `file_linux.go`): kubelet's own race, no runtime call.
const KNOWN_E_LINES: &[&str] = &[
    "Failed to set rlimit on max file handles",
    "Skipping pod synchronization",
    "Failed to get the info of the filesystem with mountpoint",
    "Image garbage collection failed once",
    "Failed to ensure process in container with oom score",
    "RemoveStaleState: removing container",
    "CrashLoopBackOff",
    "RecentStats: unable to find data in memory cache",
    "OOM events will not be reported",
    "Housekeeping took longer than expected",
    "\"Could not get metadata\" err=\"stat /var/lib/cubelet-e2e-",
    "\"Unable to process watch event\" err=\"the pod with key ",
];

/// The error lines of kubelet log `log` that neither [`KNOWN_E_LINES`] nor
/// kubelet's own double removal explains.
///
/// When a pod goes, kubelet v1.28 can queue the removal of one exited
/// container twice (the PLEG's `ContainerDied` clean-up and the pod worker's
/// both log `"RemoveContainer" containerID="<id>"`). The second one asks
/// `ContainerStatus` for a container the first has already removed, gets
/// `NotFound` (the right answer) and logs it as an error; containerd's CRI
/// draws the same line (containerd/containerd#8303). Such a line is
/// explained only when it names an id kubelet had asked to remove twice
/// before it.
fn unexplained_errors(log: &str) -> Vec<String> {
    let mut removals: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut errors = Vec::new();
    for line in log.lines() {
        if line.contains("\"RemoveContainer\"") {
            if let Some(id) = quoted_field(line, "containerID=") {
                *removals.entry(id).or_default() += 1;
            }
        }
        if !line.starts_with('E') || KNOWN_E_LINES.iter().any(|k| line.contains(k)) {
            continue;
        }
        let double_removal = line.contains("\"ContainerStatus from runtime service failed\"")
            && line.contains("code = NotFound")
            && quoted_field(line, "containerID=")
                .is_some_and(|id| removals.get(id).is_some_and(|n| *n >= 2));
        if !double_removal {
            errors.push(line.to_owned());
        }
    }
    errors
}

/// The value of `key"..."` in a klog line.
fn quoted_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!("{key}\""))? + key.len() + 1;
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// Kernel tunables kubelet sets at start; restored when it stops.
const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Fields `/stats/summary` gives for every pod of this suite when kubelet
/// runs against containerd 1.6 here (JSON paths, `[]` for list items);
/// a pod with a memory limit also has `.containers[].memory.availableBytes`.
const POD_SUMMARY_FIELDS: &[&str] = &[
    ".containers[].cpu.time",
    ".containers[].cpu.usageCoreNanoSeconds",
    ".containers[].cpu.usageNanoCores",
    ".containers[].logs.availableBytes",
    ".containers[].logs.capacityBytes",
    ".containers[].logs.inodes",
    ".containers[].logs.inodesFree",
    ".containers[].logs.inodesUsed",
    ".containers[].logs.time",
    ".containers[].logs.usedBytes",
    ".containers[].memory.majorPageFaults",
    ".containers[].memory.pageFaults",
    ".containers[].memory.rssBytes",
    ".containers[].memory.time",
    ".containers[].memory.usageBytes",
    ".containers[].memory.workingSetBytes",
    ".containers[].name",
    ".containers[].rootfs.availableBytes",
    ".containers[].rootfs.capacityBytes",
    ".containers[].rootfs.inodes",
    ".containers[].rootfs.inodesFree",
    ".containers[].rootfs.inodesUsed",
    ".containers[].rootfs.time",
    ".containers[].rootfs.usedBytes",
    ".containers[].startTime",
    ".containers[].swap.swapAvailableBytes",
    ".containers[].swap.swapUsageBytes",
    ".containers[].swap.time",
    ".cpu.time",
    ".cpu.usageCoreNanoSeconds",
    ".cpu.usageNanoCores",
    ".ephemeral-storage.availableBytes",
    ".ephemeral-storage.capacityBytes",
    ".ephemeral-storage.inodes",
    ".ephemeral-storage.inodesFree",
    ".ephemeral-storage.inodesUsed",
    ".ephemeral-storage.time",
    ".ephemeral-storage.usedBytes",
    ".memory.availableBytes",
    ".memory.majorPageFaults",
    ".memory.pageFaults",
    ".memory.rssBytes",
    ".memory.time",
    ".memory.usageBytes",
    ".memory.workingSetBytes",
    ".network.interfaces[].name",
    ".network.interfaces[].rxBytes",
    ".network.interfaces[].rxErrors",
    ".network.interfaces[].txBytes",
    ".network.interfaces[].txErrors",
    ".network.name",
    ".network.rxBytes",
    ".network.rxErrors",
    ".network.time",
    ".network.txBytes",
    ".network.txErrors",
    ".podRef.name",
    ".podRef.namespace",
    ".podRef.uid",
    ".startTime",
    ".swap.swapAvailableBytes",
    ".swap.swapUsageBytes",
    ".swap.time",
];

/// Fields of [`POD_SUMMARY_FIELDS`] kubelet v1.28.7 leaves out with the CRI
/// stats provider (`PodAndContainerStatsFromCRI`), whatever the runtime
/// sends: it copies only the working set of a container's memory and no
/// swap. The pod's available memory is Cubelet's gap: with no pod cgroup
/// (this suite runs kubelet with `cgroupsPerQOS: false`) the pod's memory
/// is the sum of its containers', which has no limit to subtract from.
const CRI_STATS_ABSENT: &[&str] = &[
    ".containers[].memory.availableBytes",
    ".containers[].memory.majorPageFaults",
    ".containers[].memory.pageFaults",
    ".containers[].memory.rssBytes",
    ".containers[].memory.usageBytes",
    ".memory.availableBytes",
    ".swap.swapAvailableBytes",
    ".swap.swapUsageBytes",
    ".swap.time",
];

/// The kubelet under test: `$CUBELET_KUBELET_BIN`, else `kubelet-v1.28.7` on
/// PATH (built by hand outside the repository, see `docs/clients.md`), else
/// `../shared/tools/kubelet-v1.28.7`.
fn kubelet_bin() -> PathBuf {
    const NAME: &str = "kubelet-v1.28.7";
    if let Some(bin) = std::env::var_os("CUBELET_KUBELET_BIN") {
        return PathBuf::from(bin);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(NAME))
        .find(|p| p.is_file())
        .unwrap_or_else(|| workspace_root().join("../shared/tools").join(NAME))
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// The CRI endpoint kubelet is pointed at: the daemon under test, or (for
/// a comparison by hand, `CUBELET_KUBELET_TARGET=containerd`) the CRI
/// plugin of the private test containerd, with a CNI bridge of the test's.
struct Target {
    name: &'static str,
    socket: PathBuf,
    /// containerd namespace of its containers, for kubelet's cAdvisor.
    containerd_namespace: String,
    /// The runtime name kubelet puts before container ids.
    id_scheme: &'static str,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    /// Whether the host's nat table had CNI portmap chains before; portmap
    /// leaves its base chains behind after the last DEL.
    cni_chains_before: bool,
    /// Whether every pod gets an infra container (containerd; Cubelet in
    /// `pause` mode); else only a pod that shares its process namespace.
    infra_for_every_pod: bool,
    /// Whether a pod without an infra container gets a stats anchor
    /// (Cubelet's `runtime.stats_anchor`, on by default).
    stats_anchors: bool,
}

/// The host nat table's rules and chains made by CNI plugins.
async fn cni_nat_lines() -> anyhow::Result<Vec<String>> {
    Ok(run("iptables-save", &["-t", "nat"])
        .await?
        .lines()
        .filter(|l| l.contains("CNI-"))
        .map(str::to_owned)
        .collect())
}

/// Deletes the CNI rules and chains of the host's nat table.
async fn remove_cni_chains() -> anyhow::Result<()> {
    let lines = cni_nat_lines().await?;
    for rule in lines.iter().filter_map(|l| l.strip_prefix("-A ")) {
        let mut args = vec!["-t", "nat", "-D"];
        args.extend(split_rule(rule));
        run("iptables", &args).await?;
    }
    for chain in lines.iter().filter_map(|l| l.strip_prefix(':')) {
        let name = chain.split(' ').next().unwrap_or("");
        run("iptables", &["-t", "nat", "-X", name]).await?;
    }
    Ok(())
}

/// An iptables-save rule split into arguments (quoted comments kept whole).
fn split_rule(rule: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = rule.trim();
    while !rest.is_empty() {
        if let Some(q) = rest.strip_prefix('"') {
            let end = q.find('"').unwrap_or(q.len());
            out.push(&q[..end]);
            rest = q.get(end + 1..).unwrap_or("").trim_start();
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            out.push(&rest[..end]);
            rest = rest[end..].trim_start();
        }
    }
    out
}

/// containerd's CRI plugin reads CNI configs from here (`hack/containerd.sh`).
const CONTAINERD_CNI_CONF: &str = "/var/lib/cubelet-test/cni-conf/10-cubelet-e2e-kubelet.conflist";
const CONTAINERD_CNI_BRIDGE: &str = "cbe2ectrd";
const CONTAINERD_CNI_IPAM: &str = "/run/cubelet-test/cni-ipam-kubelet-e2e";

/// `CUBELET_KUBELET_SANDBOX=pause`: the daemon runs with
/// `runtime.sandbox: pause`.
fn pause_mode() -> bool {
    std::env::var("CUBELET_KUBELET_SANDBOX").as_deref() == Ok("pause")
}

/// `CUBELET_KUBELET_STATS_ANCHOR=0`: the daemon runs with
/// `runtime.stats_anchor: false`.
fn stats_anchor() -> bool {
    std::env::var("CUBELET_KUBELET_STATS_ANCHOR").as_deref() != Ok("0")
}

/// `CUBELET_KUBELET_CRI_STATS=1`: kubelet runs with the alpha feature gate
/// `PodAndContainerStatsFromCRI` and takes every stat from the runtime's
/// `ListPodSandboxStats`/`ListContainerStats` instead of cAdvisor.
fn cri_stats() -> bool {
    std::env::var("CUBELET_KUBELET_CRI_STATS").as_deref() == Ok("1")
}

impl Target {
    /// Whether `pod` gets an infra container.
    fn has_infra(&self, pod: &str) -> bool {
        self.infra_for_every_pod || pod == "shared"
    }

    /// Whether kubelet reports `pod`'s network: from the runtime with the
    /// CRI stats provider; else from cAdvisor, which reads it only from a
    /// containerd container with the sandbox's id: an infra container or
    /// a stats anchor.
    fn pod_network(&self, pod: &str) -> bool {
        cri_stats() || self.has_infra(pod) || self.stats_anchors
    }

    fn cubelet(d: &Daemon) -> Target {
        Target {
            name: "cubelet",
            socket: d.socket.clone(),
            containerd_namespace: d.namespace.clone(),
            id_scheme: "cubelet://",
            runtime: d.runtime.clone(),
            images: d.images.clone(),
            cni_chains_before: true,
            infra_for_every_pod: pause_mode(),
            stats_anchors: stats_anchor(),
        }
    }

    async fn containerd(d: &Daemon) -> anyhow::Result<Target> {
        let conf = format!(
            r#"{{"cniVersion":"0.4.0","name":"cubelet-e2e-kubelet","plugins":[
 {{"type":"bridge","bridge":"{CONTAINERD_CNI_BRIDGE}","isGateway":true,"ipMasq":false,
   "ipam":{{"type":"host-local","ranges":[[{{"subnet":"10.203.77.0/24"}}]],"dataDir":"{CONTAINERD_CNI_IPAM}"}}}},
 {{"type":"portmap","capabilities":{{"portMappings":true}}}}]}}"#
        );
        let cni_chains_before = !cni_nat_lines().await?.is_empty();
        std::fs::write(CONTAINERD_CNI_CONF, conf)?;
        let channel = connect(&d.containerd).await?;
        let mut images = ImageServiceClient::new(channel.clone());
        // The image kubelet must pull may be left from an earlier run.
        let _ = images
            .remove_image(RemoveImageRequest {
                image: Some(image_spec(BUSYBOX_OCI)),
            })
            .await;
        Ok(Target {
            name: "containerd",
            socket: d.containerd.clone(),
            containerd_namespace: "k8s.io".to_owned(),
            id_scheme: "containerd://",
            runtime: RuntimeServiceClient::new(channel),
            images,
            cni_chains_before,
            infra_for_every_pod: true,
            stats_anchors: false,
        })
    }

    /// Removes the suite's pods and what else the target got from it: for
    /// containerd, its pulled image, CNI config, bridge and IPAM state.
    async fn clean(&self, ns: &str, d: &Daemon) -> anyhow::Result<()> {
        if self.name == "cubelet" {
            return d.remove_all().await;
        }
        let mut rt = self.runtime.clone();
        let pods = rt
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await?
            .into_inner()
            .items;
        for p in pods
            .iter()
            .filter(|p| p.metadata.as_ref().is_some_and(|m| m.namespace == ns))
        {
            rt.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await?;
            rt.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await?;
        }
        self.images
            .clone()
            .remove_image(RemoveImageRequest {
                image: Some(image_spec(BUSYBOX_OCI)),
            })
            .await?;
        std::fs::remove_file(CONTAINERD_CNI_CONF)?;
        if Path::new(&format!("/sys/class/net/{CONTAINERD_CNI_BRIDGE}")).exists() {
            run("ip", &["link", "del", CONTAINERD_CNI_BRIDGE]).await?;
        }
        let _ = std::fs::remove_dir_all(CONTAINERD_CNI_IPAM);
        if !self.cni_chains_before {
            remove_cni_chains().await?;
        }
        Ok(())
    }

    async fn container_log_path(&self, id: &str) -> anyhow::Result<PathBuf> {
        let status = self
            .runtime
            .clone()
            .container_status(ContainerStatusRequest {
                container_id: id.to_owned(),
                verbose: false,
            })
            .await?
            .into_inner()
            .status
            .context("no container status")?;
        Ok(PathBuf::from(status.log_path))
    }
}

/// A standalone kubelet with its own directories and ports.
struct Kubelet {
    child: tokio::process::Child,
    dir: PathBuf,
    root_dir: PathBuf,
    manifests: PathBuf,
    read_only: SocketAddr,
    log: PathBuf,
    sysctls: Vec<(String, String)>,
    /// The pods' namespace: unique per run, so pod UIDs (a hash of the
    /// manifest) and kubelet's log directories never meet an earlier run's.
    namespace: String,
    /// Host paths kubelet creates whatever its flags, that were not there
    /// before it started (removed when it stops).
    created: Vec<&'static str>,
}

/// Paths kubelet makes outside its root dir: the pod log directories and
/// its device-plugin socket.
const HOST_PATHS: &[&str] = &[
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/kubelet",
    "/var/lib/kubelet/device-plugins/kubelet.sock",
];

impl Kubelet {
    async fn start(d: &Daemon, target: &Target) -> anyhow::Result<Kubelet> {
        let dir = d.lib_base.join("kubelet");
        let root_dir = dir.join("root");
        let manifests = dir.join("manifests");
        for p in [&root_dir, &manifests, &dir.join("volume-plugins")] {
            std::fs::create_dir_all(p)?;
        }
        let read_only: SocketAddr = (Ipv4Addr::LOCALHOST, free_port()?).into();
        let config = format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\n\
             kind: KubeletConfiguration\n\
             staticPodPath: {manifests}\n\
             fileCheckFrequency: 1s\n\
             syncFrequency: 10s\n\
             address: 127.0.0.1\n\
             port: {port}\n\
             readOnlyPort: {ro}\n\
             healthzBindAddress: 127.0.0.1\n\
             healthzPort: {healthz}\n\
             authentication: {{ anonymous: {{ enabled: true }}, webhook: {{ enabled: false }} }}\n\
             authorization: {{ mode: AlwaysAllow }}\n\
             containerRuntimeEndpoint: unix://{socket}\n\
             imageServiceEndpoint: unix://{socket}\n\
             failSwapOn: false\n\
             cgroupDriver: {driver}\n\
             cgroupsPerQOS: false\n\
             enforceNodeAllocatable: []\n\
             makeIPTablesUtilChains: false\n\
             volumePluginDir: {plugins}\n\
             evictionHard: {{ memory.available: \"1Mi\", nodefs.available: \"0%\", nodefs.inodesFree: \"0%\", imagefs.available: \"0%\" }}\n",
            manifests = manifests.display(),
            port = free_port()?,
            ro = read_only.port(),
            healthz = free_port()?,
            socket = target.socket.display(),
            plugins = dir.join("volume-plugins").display(),
            driver = kubelet_cgroup_driver(),
        );
        let config = if cri_stats() {
            format!("{config}featureGates: {{ PodAndContainerStatsFromCRI: true }}\n")
        } else {
            config
        };
        let config_file = dir.join("config.yaml");
        std::fs::write(&config_file, config)?;
        let sysctls = KUBELET_SYSCTLS
            .iter()
            .filter_map(|k| {
                let v = std::fs::read_to_string(format!("/proc/sys/{k}")).ok()?;
                Some(((*k).to_owned(), v.trim().to_owned()))
            })
            .collect();
        let log = dir.join("kubelet.log");
        let out = std::fs::File::create(&log)?;
        let child = tokio::process::Command::new(kubelet_bin())
            .arg(format!("--config={}", config_file.display()))
            .arg(format!("--root-dir={}", root_dir.display()))
            .arg(format!("--cert-dir={}", dir.join("certs").display()))
            .arg(format!("--hostname-override={NODE}"))
            .arg(format!("--containerd={}", d.containerd.display()))
            .arg(format!(
                "--containerd-namespace={}",
                target.containerd_namespace
            ))
            .arg("--v=2")
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("spawn kubelet")?;
        let k = Kubelet {
            child,
            dir,
            root_dir,
            manifests,
            read_only,
            log,
            sysctls,
            namespace: format!("kl-{}", std::process::id()),
            created: HOST_PATHS
                .iter()
                .copied()
                .filter(|p| std::fs::symlink_metadata(p).is_err())
                .collect(),
        };
        let healthy = eventually(
            "kubelet's read-only API",
            Duration::from_secs(60),
            || async {
                Ok(http_get(k.read_only, "/healthz")
                    .await
                    .is_ok_and(|(c, _)| c == 200))
            },
        )
        .await;
        match healthy {
            Ok(()) => Ok(k),
            // A kubelet that never came up has still changed tunables and
            // mounted its root dir: undo that before failing.
            Err(e) => match k.stop().await {
                Ok(()) => Err(e),
                Err(s) => Err(e.context(format!("and stopping kubelet failed: {s:#}"))),
            },
        }
    }

    async fn get(&self, path: &str) -> anyhow::Result<String> {
        let (code, body) = http_get(self.read_only, path).await?;
        ensure!(code == 200, "kubelet {path}: HTTP {code}");
        Ok(body)
    }

    async fn json(&self, path: &str) -> anyhow::Result<Value> {
        serde_json::from_str(&self.get(path).await?).with_context(|| format!("kubelet {path}"))
    }

    /// Kubelet's pods by their manifest name (without the `-<node>` suffix).
    async fn pods(&self) -> anyhow::Result<Vec<(String, Value)>> {
        let pods = self.json("/pods").await?;
        Ok(pods["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| {
                let name = p["metadata"]["name"].as_str()?;
                let short = name.strip_suffix(&format!("-{NODE}"))?.to_owned();
                Some((short, p))
            })
            .collect())
    }

    async fn pod(&self, name: &str) -> anyhow::Result<Value> {
        self.pods()
            .await?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p)
            .with_context(|| format!("kubelet has no pod {name}"))
    }

    /// Writes a manifest whole: through a hidden file (kubelet skips
    /// names starting with `.`) renamed into place, so kubelet's watcher
    /// never reads one half written (it logs an error for an empty file).
    fn write_manifest(&self, name: &str, yaml: &str) -> anyhow::Result<()> {
        let tmp = self.manifests.join(format!(".{name}.yaml.tmp"));
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, self.manifests.join(format!("{name}.yaml")))?;
        Ok(())
    }

    fn error_lines(&self) -> Vec<String> {
        let log = std::fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        unexplained_errors(&log)
    }

    /// Stops kubelet (SIGTERM, then SIGKILL), restores the tunables it
    /// changed, unmounts its root dir (it bind-mounts it onto itself) and
    /// removes its files and the pods' log directories.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
        }
        for (k, v) in &self.sysctls {
            std::fs::write(format!("/proc/sys/{k}"), v).with_context(|| format!("restore {k}"))?;
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts")?;
        let mut under: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split(' ').nth(1))
            .filter(|m| Path::new(m).starts_with(&self.root_dir))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in under {
            nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH)
                .with_context(|| format!("umount {m}"))?;
        }
        std::fs::remove_dir_all(&self.dir)?;
        let prefix = format!("{}_", self.namespace);
        if let Ok(entries) = std::fs::read_dir("/var/log/pods") {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    std::fs::remove_dir_all(e.path())?;
                }
            }
        }
        let infix = format!("_{}_", self.namespace);
        if let Ok(entries) = std::fs::read_dir("/var/log/containers") {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().contains(&infix) {
                    std::fs::remove_file(e.path())?;
                }
            }
        }
        for p in &self.created {
            let gone = match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
                Ok(_) => std::fs::remove_file(p),
                Err(_) => Ok(()),
            };
            gone.with_context(|| format!("remove {p}"))?;
        }
        Ok(())
    }
}

/// The pods of the suite, in the run's namespace.
fn manifests(ns: &str, host_port: u16) -> Vec<(&'static str, String)> {
    vec![
        (
            "web",
            format!(
                r#"apiVersion: v1
kind: Pod
metadata: {{ name: web, namespace: {ns} }}
spec:
  volumes: [{{ name: data, emptyDir: {{}} }}]
  containers:
  - name: writer
    image: {BUSYBOX}
    command: ["sh", "-c", "env | sort > /data/env.txt; echo hello > /data/index.html; mkdir -p /w; echo t > /w/index.html; exec httpd -f -p 9090 -h /w"]
    env:
    - {{ name: POD_NAME, valueFrom: {{ fieldRef: {{ fieldPath: metadata.name }} }} }}
    - {{ name: POD_NAMESPACE, valueFrom: {{ fieldRef: {{ fieldPath: metadata.namespace }} }} }}
    - {{ name: POD_UID, valueFrom: {{ fieldRef: {{ fieldPath: metadata.uid }} }} }}
    - {{ name: POD_IP, valueFrom: {{ fieldRef: {{ fieldPath: status.podIP }} }} }}
    - {{ name: NODE_NAME, valueFrom: {{ fieldRef: {{ fieldPath: spec.nodeName }} }} }}
    - {{ name: MEM_LIMIT, valueFrom: {{ resourceFieldRef: {{ resource: limits.memory }} }} }}
    - {{ name: PLAIN, value: plain-value }}
    volumeMounts: [{{ name: data, mountPath: /data }}]
    resources: {{ requests: {{ cpu: 50m, memory: 16Mi }}, limits: {{ cpu: 200m, memory: 64Mi }} }}
    readinessProbe: {{ tcpSocket: {{ port: 9090 }}, initialDelaySeconds: 1, periodSeconds: 2 }}
  - name: reader
    image: {BUSYBOX}
    command: ["sh", "-c", "exec httpd -f -p 8080 -h /data"]
    volumeMounts: [{{ name: data, mountPath: /data, readOnly: true }}]
    resources: {{ requests: {{ cpu: 10m, memory: 8Mi }} }}
    readinessProbe: {{ httpGet: {{ path: /index.html, port: 8080 }}, initialDelaySeconds: 1, periodSeconds: 2 }}
    livenessProbe: {{ exec: {{ command: ["cat", "/data/index.html"] }}, initialDelaySeconds: 1, periodSeconds: 3 }}
"#
            ),
        ),
        (
            "crash",
            format!(
                r#"apiVersion: v1
kind: Pod
metadata: {{ name: crash, namespace: {ns} }}
spec:
  restartPolicy: Always
  containers:
  - name: crash
    image: {BUSYBOX}
    command: ["sh", "-c", "echo run started; sleep 1; exit 3"]
"#
            ),
        ),
        (
            "hostport",
            format!(
                r#"apiVersion: v1
kind: Pod
metadata: {{ name: hostport, namespace: {ns} }}
spec:
  containers:
  - name: web
    image: {BUSYBOX}
    command: ["sh", "-c", "mkdir -p /www && echo via-hostport > /www/index.html && exec httpd -f -p 80 -h /www"]
    ports: [{{ containerPort: 80, hostPort: {host_port}, hostIP: 127.0.0.1 }}]
"#
            ),
        ),
        (
            "shared",
            format!(
                r#"apiVersion: v1
kind: Pod
metadata: {{ name: shared, namespace: {ns} }}
spec:
  shareProcessNamespace: true
  containers:
  - name: main
    image: {BUSYBOX}
    command: ["sh", "-c", "exec sleep 3600"]
"#
            ),
        ),
        (
            "pulled",
            format!(
                r#"apiVersion: v1
kind: Pod
metadata: {{ name: pulled, namespace: {ns} }}
spec:
  containers:
  - name: main
    image: {BUSYBOX_OCI}
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo pulled ok; exec sleep 3600"]
"#
            ),
        ),
    ]
}

fn statuses(pod: &Value) -> Vec<Value> {
    pod["status"]["containerStatuses"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn status_of(pod: &Value, container: &str) -> anyhow::Result<Value> {
    statuses(pod)
        .into_iter()
        .find(|c| c["name"] == container)
        .with_context(|| format!("no status of {container}"))
}

/// The containers kubelet sees running, per pod name.
async fn running(k: &Kubelet, want: &[(&str, usize)]) -> anyhow::Result<bool> {
    let pods = k.pods().await?;
    Ok(want.iter().all(|(name, n)| {
        pods.iter().any(|(p, v)| {
            p == name
                && statuses(v)
                    .iter()
                    .filter(|c| c["state"]["running"].is_object())
                    .count()
                    == *n
        })
    }))
}

/// kubelet's `cgroupDriver`: `systemd` when the daemons under test use it
/// (`CUBELET_E2E_CGROUP_DRIVER=systemd`, as in the systemd guest of
/// `hack/vm.sh`), else `cgroupfs`. Kubelet and the runtime must agree.
fn kubelet_cgroup_driver() -> &'static str {
    match cubelet_e2e::e2e_cgroup_driver().as_deref() {
        Some("systemd") => "systemd",
        _ => "cgroupfs",
    }
}

/// The directory of container `id`'s cgroup under a v1 controller mount (or
/// the v2 root): named `<id>` (cgroupfs) or `cubelet-<id>.scope` (systemd).
fn find_cgroup(root: &Path, id: &str, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    let scope = format!("cubelet-{id}.scope");
    for e in entries.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = e.file_name();
        if name.to_string_lossy() == id || name.to_string_lossy() == scope {
            return Some(e.path());
        }
        if depth > 0 {
            if let Some(p) = find_cgroup(&e.path(), id, depth - 1) {
                return Some(p);
            }
        }
    }
    None
}

/// Whether `e` is the runtime's `NotFound`.
fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<tonic::Status>()
        .is_some_and(|s| s.code() == tonic::Code::NotFound)
}

fn read_trim(p: &Path) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(p)
        .with_context(|| format!("read {}", p.display()))?
        .trim()
        .to_owned())
}

/// The writer's limits as its cgroup has them: 50m/200m CPU, 64Mi memory.
fn check_limits(container_id: &str) -> anyhow::Result<()> {
    if Path::new("/sys/fs/cgroup/memory").is_dir() {
        let mem = find_cgroup(Path::new("/sys/fs/cgroup/memory"), container_id, 4)
            .context("the writer's memory cgroup")?;
        ensure!(read_trim(&mem.join("memory.limit_in_bytes"))? == (64u64 << 20).to_string());
        let cpu = find_cgroup(Path::new("/sys/fs/cgroup/cpu"), container_id, 4)
            .context("the writer's cpu cgroup")?;
        ensure!(read_trim(&cpu.join("cpu.cfs_quota_us"))? == "20000");
        ensure!(read_trim(&cpu.join("cpu.cfs_period_us"))? == "100000");
        ensure!(read_trim(&cpu.join("cpu.shares"))? == "51");
    } else {
        let dir = find_cgroup(Path::new("/sys/fs/cgroup"), container_id, 4)
            .context("the writer's cgroup")?;
        ensure!(read_trim(&dir.join("memory.max"))? == (64u64 << 20).to_string());
        ensure!(read_trim(&dir.join("cpu.max"))? == "20000 100000");
    }
    Ok(())
}

/// JSON paths of the leaves of `v`, `[]` for list items.
fn field_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                field_paths(v, &format!("{prefix}.{k}"), out);
            }
        }
        Value::Array(a) => {
            for v in a {
                field_paths(v, &format!("{prefix}[]"), out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// `name value` of every sample of metric `name` in a Prometheus text.
fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .collect()
}

/// Prints, per pod, the time from its sandbox's creation to its last
/// container's start as the runtime recorded them (nanoseconds over CRI):
/// what the runtime spends, without kubelet's 1 s manifest scan.
async fn print_start_times(t: &Target, ns: &str) -> anyhow::Result<()> {
    let mut rt = t.runtime.clone();
    let pods = rt
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await?
        .into_inner()
        .items;
    let containers = rt
        .list_containers(ListContainersRequest::default())
        .await?
        .into_inner()
        .containers;
    let mut figures = Vec::new();
    for p in pods
        .iter()
        .filter(|p| p.metadata.as_ref().is_some_and(|m| m.namespace == ns))
    {
        let mut last = 0;
        for c in containers.iter().filter(|c| c.pod_sandbox_id == p.id) {
            let status = match rt
                .container_status(ContainerStatusRequest {
                    container_id: c.id.clone(),
                    verbose: false,
                })
                .await
            {
                Ok(r) => r.into_inner().status.context("no container status")?,
                // Removed by kubelet since the list (the crash-looping
                // pod's earlier attempt): nothing to time.
                Err(s) if s.code() == tonic::Code::NotFound => continue,
                Err(s) => return Err(s.into()),
            };
            last = last.max(status.started_at);
        }
        let name = p.metadata.as_ref().map_or("", |m| m.name.as_str());
        if last > 0 {
            figures.push(format!(
                "{name} {:.0} ms",
                (last - p.created_at) as f64 / 1e6
            ));
        }
    }
    figures.sort();
    println!(
        "kubelet on {}: sandbox created to last container started: {}",
        t.name,
        figures.join(", ")
    );
    Ok(())
}

/// Each of the suite's sandboxes has an infra container exactly when the
/// mode says so (in `auto` mode: only the pod sharing its process namespace).
async fn check_infra_containers(t: &Target, ns: &str) -> anyhow::Result<()> {
    let mut rt = t.runtime.clone();
    let pods = rt
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await?
        .into_inner()
        .items;
    let mut seen = Vec::new();
    for p in pods
        .iter()
        .filter(|p| p.metadata.as_ref().is_some_and(|m| m.namespace == ns))
        .filter(|p| p.state == 0)
    {
        let name = p.metadata.as_ref().map_or("", |m| m.name.as_str());
        let short = name.strip_suffix(&format!("-{NODE}")).unwrap_or(name);
        let status = rt
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: p.id.clone(),
                verbose: true,
            })
            .await?
            .into_inner();
        let info: Value = serde_json::from_str(status.info.get("info").context("no info")?)?;
        let infra = info["infraContainer"] == true;
        ensure!(
            infra == t.has_infra(short),
            "{short}: infra container {infra}, expected {}",
            t.has_infra(short)
        );
        seen.push(format!("{short} {}", if infra { "pause" } else { "none" }));
    }
    seen.sort();
    println!("kubelet: infra containers: {}", seen.join(", "));
    Ok(())
}

/// What the pods in `want` lack in `/stats/summary`, as `pod: field`;
/// prints the field counts once nothing is missing. Every pod has every
/// field, `network` with traffic counted included, unless it has neither
/// an infra container nor a stats anchor (`runtime.stats_anchor: false`):
/// then it has every field but `network`, and no `network`, since
/// kubelet's default stats provider reads pod network from cAdvisor, which
/// reads it only from the containerd container labelled as the sandbox.
async fn summary_gaps(
    t: &Target,
    k: &Kubelet,
    want: &[(&str, usize)],
) -> anyhow::Result<Vec<String>> {
    let summary = k.json("/stats/summary").await?;
    let pods = summary["pods"].as_array().cloned().unwrap_or_default();
    let mut gaps = Vec::new();
    let mut counts = Vec::new();
    for (name, _) in want {
        let Some(pod) = pods
            .iter()
            .find(|p| p["podRef"]["name"] == format!("{name}-{NODE}"))
        else {
            gaps.push(format!("{name}: the whole pod"));
            continue;
        };
        let mut have = BTreeSet::new();
        field_paths(pod, "", &mut have);
        let infra = t.pod_network(name);
        let mut need: BTreeSet<String> = POD_SUMMARY_FIELDS
            .iter()
            .filter(|f| infra || !f.starts_with(".network"))
            .map(|s| (*s).to_owned())
            .collect();
        if *name == "web" {
            need.insert(".containers[].memory.availableBytes".to_owned());
        }
        if cri_stats() {
            need.retain(|f| !CRI_STATS_ABSENT.contains(&f.as_str()));
        }
        gaps.extend(need.difference(&have).map(|f| format!("{name}: {f}")));
        if infra
            && (pod["network"]["rxBytes"].as_u64().unwrap_or(0) == 0
                || pod["network"]["txBytes"].as_u64().unwrap_or(0) == 0)
        {
            gaps.push(format!("{name}: no network traffic counted"));
        }
        if !infra && !pod["network"].is_null() {
            gaps.push(format!(
                "{name}: network stats without an infra container or a stats anchor (docs/infraless.md says none)"
            ));
        }
        counts.push(format!("{name} {}", have.len()));
    }
    if gaps.is_empty() {
        println!(
            "kubelet: /stats/summary fields per pod: {}",
            counts.join(", ")
        );
    }
    Ok(gaps)
}

async fn scenario(t: &Target, k: &Kubelet) -> anyhow::Result<()> {
    let ns = &k.namespace;
    let host_port = free_port()?;
    let present = t
        .images
        .clone()
        .image_status(ImageStatusRequest {
            image: Some(image_spec(BUSYBOX_OCI)),
            verbose: false,
        })
        .await?
        .into_inner()
        .image;
    ensure!(
        present.is_none(),
        "{BUSYBOX_OCI} is on the node before kubelet pulls it"
    );

    let started = Instant::now();
    for (name, yaml) in manifests(ns, host_port) {
        k.write_manifest(name, &yaml)?;
    }
    let want = [("web", 2), ("hostport", 1), ("pulled", 1), ("shared", 1)];
    eventually(
        "every container running in kubelet's /pods",
        Duration::from_secs(120),
        || running(k, &want),
    )
    .await?;
    println!(
        "kubelet on {}: manifest to all containers running: {:.2} s",
        t.name,
        started.elapsed().as_secs_f64()
    );

    print_start_times(t, ns).await?;
    if t.name == "cubelet" {
        check_infra_containers(t, ns).await?;
    }

    // Ready: all three probe kinds pass.
    eventually("web ready", Duration::from_secs(60), || async {
        let web = k.pod("web").await?;
        Ok(statuses(&web).iter().all(|c| c["ready"] == true) && statuses(&web).len() == 2)
    })
    .await?;

    // The downward API, the shared emptyDir and the pod IP on the bridge.
    let web = k.pod("web").await?;
    let ip: Ipv4Addr = web["status"]["podIP"]
        .as_str()
        .context("web has no podIP")?
        .parse()?;
    let uid = web["metadata"]["uid"]
        .as_str()
        .context("web uid")?
        .to_owned();
    let (code, body) = http_get((ip, 8080).into(), "/index.html").await?;
    ensure!(
        code == 200 && body.trim() == "hello",
        "emptyDir: {code} {body:?}"
    );
    let (_, env) = http_get((ip, 8080).into(), "/env.txt").await?;
    for want in [
        format!("POD_NAME=web-{NODE}"),
        format!("POD_NAMESPACE={ns}"),
        format!("POD_UID={uid}"),
        format!("POD_IP={ip}"),
        format!("NODE_NAME={NODE}"),
        format!("HOSTNAME=web-{NODE}"),
        "MEM_LIMIT=67108864".to_owned(),
        "PLAIN=plain-value".to_owned(),
    ] {
        ensure!(env.lines().any(|l| l == want), "env lacks {want}:\n{env}");
    }
    let writer = status_of(&web, "writer")?;
    ensure!(
        writer["image"] == BUSYBOX,
        "status image {} (want the name, not the id)",
        writer["image"]
    );
    let writer_id = writer["containerID"]
        .as_str()
        .and_then(|c| c.strip_prefix(t.id_scheme))
        .context("writer containerID")?;
    check_limits(writer_id)?;

    // hostPort on 127.0.0.1.
    let (code, body) = http_get((Ipv4Addr::LOCALHOST, host_port).into(), "/").await?;
    ensure!(
        code == 200 && body.trim() == "via-hostport",
        "hostPort: {code} {body:?}"
    );

    // The image kubelet pulled is on the node now.
    let images = t
        .images
        .clone()
        .list_images(ListImagesRequest::default())
        .await?
        .into_inner()
        .images;
    ensure!(
        images
            .iter()
            .any(|i| i.repo_tags.iter().any(|t| t == BUSYBOX_OCI)),
        "kubelet's pull of {BUSYBOX_OCI} left no image"
    );

    // restartPolicy Always: restarts counted, last state kept, and the
    // previous run's log is where `kubectl logs --previous` reads it.
    eventually("crash restarted twice", Duration::from_secs(90), || async {
        let crash = k.pod("crash").await?;
        Ok(status_of(&crash, "crash")?["restartCount"].as_u64() >= Some(2))
    })
    .await?;
    // `kubectl logs --previous`: kubelet reads the log path of the
    // container its last state names. The container crashes again at once,
    // and kubelet's GC keeps one dead attempt per container: the attempt a
    // status read names can be removed, log and all, before the test reads
    // it (as `kubectl logs --previous` would then fail on any runtime). Read
    // the status again then.
    let since = Instant::now();
    let log = loop {
        let crash = k.pod("crash").await?;
        let c = status_of(&crash, "crash")?;
        ensure!(
            c["lastState"]["terminated"]["exitCode"] == 3,
            "last state: {}",
            c["lastState"]
        );
        let previous_id = c["lastState"]["terminated"]["containerID"]
            .as_str()
            .and_then(|c| c.strip_prefix(t.id_scheme))
            .context("last state has no container id")?;
        let gone = match t.container_log_path(previous_id).await {
            Ok(previous) => {
                let crash_uid = crash["metadata"]["uid"].as_str().context("crash uid")?;
                let dir = format!("/var/log/pods/{ns}_crash-{NODE}_{crash_uid}/crash/");
                ensure!(
                    previous.starts_with(&dir) && previous.extension().is_some_and(|e| e == "log"),
                    "previous log at {}",
                    previous.display()
                );
                match std::fs::read_to_string(&previous) {
                    Ok(log) => break log.trim().to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        format!("log {}", previous.display())
                    }
                    Err(e) => return Err(anyhow::anyhow!("{}: {e}", previous.display())),
                }
            }
            Err(e) if is_not_found(&e) => format!("container {previous_id}"),
            Err(e) => return Err(e),
        };
        ensure!(
            since.elapsed() < cubelet_e2e::scaled(Duration::from_secs(60)),
            "the previous attempt kept vanishing ({gone} removed since the status read)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let line = log.lines().next().context("empty previous log")?;
    let mut parts = line.splitn(4, ' ');
    let (ts, stream, tag, text) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
    );
    ensure!(
        ts.contains('T') && stream == "stdout" && tag == "F" && text == "run started",
        "previous log line {line:?}"
    );

    // No restarts elsewhere, no liveness failures.
    for (name, _) in &want {
        let pod = k.pod(name).await?;
        for c in statuses(&pod) {
            ensure!(c["restartCount"] == 0, "{name}/{} restarted", c["name"]);
            ensure!(c["ready"] == true, "{name}/{} not ready", c["name"]);
        }
    }

    // /stats/summary: every field containerd's pods get, network included.
    // cAdvisor picks new containers up on its own housekeeping period, so
    // the fields it contributes can take a few seconds to appear.
    let since = Instant::now();
    loop {
        let missing = summary_gaps(t, k, &want).await?;
        if missing.is_empty() {
            break;
        }
        ensure!(
            since.elapsed() < cubelet_e2e::scaled(Duration::from_secs(60)),
            "/stats/summary lacks {missing:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // /metrics/cadvisor: network series where kubelet's stats have the
    // pod's network. cAdvisor reads it only from an infra container or a
    // stats anchor; with the CRI stats provider kubelet serves this
    // endpoint from the runtime's ListPodSandboxMetrics, which has it for
    // every pod.
    let cadvisor = k.get("/metrics/cadvisor").await?;
    let rx = samples(&cadvisor, "container_network_receive_bytes_total");
    let tx = samples(&cadvisor, "container_network_transmit_bytes_total");
    for (name, _) in &want {
        let pod = format!("pod=\"{name}-{NODE}\"");
        let has_rx = rx.iter().any(|l| l.contains(&pod));
        let has = has_rx && tx.iter().any(|l| l.contains(&pod));
        ensure!(
            has_rx == has,
            "{name}: receive series without transmit series"
        );
        ensure!(
            has == t.pod_network(name),
            "{name}: cAdvisor network series {has}, expected {} (infra container {}, stats anchor {}, CRI stats {})",
            t.pod_network(name),
            t.has_infra(name),
            t.stats_anchors,
            cri_stats()
        );
    }

    // Kubelet's own verdict on the runtime.
    let metrics = k.get("/metrics").await?;
    let errors = samples(&metrics, "kubelet_runtime_operations_errors_total");
    ensure!(errors.is_empty(), "runtime operation errors: {errors:?}");
    let failed_probes: Vec<_> = samples(&metrics, "prober_probe_total")
        .into_iter()
        .filter(|l| l.contains("result=\"failed\""))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    println!("kubelet: failed probes: {failed_probes:?}");
    ensure!(
        !failed_probes
            .iter()
            .any(|l| l.contains("probe_type=\"Liveness\"")),
        "liveness probe failed: {failed_probes:?}"
    );

    // Teardown: a pod removed from the manifest directory is stopped.
    std::fs::remove_file(k.manifests.join("hostport.yaml"))?;
    eventually("hostport pod stopped", Duration::from_secs(60), || async {
        let sandboxes = t
            .runtime
            .clone()
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await?
            .into_inner()
            .items;
        let ours: Vec<_> = sandboxes
            .iter()
            .filter(|s| {
                s.metadata
                    .as_ref()
                    .is_some_and(|m| m.name == format!("hostport-{NODE}"))
            })
            .collect();
        Ok(!ours.is_empty() && ours.iter().all(|s| s.state != 0))
    })
    .await?;
    let running = t
        .runtime
        .clone()
        .list_containers(ListContainersRequest::default())
        .await?
        .into_inner()
        .containers
        .into_iter()
        .filter(|c| c.labels.get("io.kubernetes.pod.name") == Some(&format!("hostport-{NODE}")))
        .filter(|c| c.state == 1)
        .count();
    ensure!(
        running == 0,
        "the removed pod still has a running container"
    );
    ensure!(
        http_get((Ipv4Addr::LOCALHOST, host_port).into(), "/")
            .await
            .is_err(),
        "the removed pod's host port still answers"
    );

    // Cubelet says in Status what it left out of specs for want of a
    // controller: on a node whose containers cannot get hugetlb, kubelet's
    // zero hugepage limits.
    if t.name == "cubelet" {
        let info = t
            .runtime
            .clone()
            .status(StatusRequest { verbose: true })
            .await?
            .into_inner()
            .info;
        let cgroups: Value =
            serde_json::from_str(info.get("cgroups").context("no cgroups in Status info")?)?;
        let has_hugetlb = cgroups["controllers"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c == "hugetlb"));
        let hugepages =
            std::fs::read_dir("/sys/kernel/mm/hugepages").is_ok_and(|mut d| d.next().is_some());
        if hugepages && !has_hugetlb {
            ensure!(
                cgroups["dropped"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|k| k == "hugetlb")),
                "Status cgroups info: {cgroups}"
            );
        }
        println!("kubelet: Status cgroups info: {cgroups}");
    }

    let errors = k.error_lines();
    if !errors.is_empty() {
        bail!("kubelet logged runtime errors:\n{}", errors.join("\n"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_runs_static_pods() {
    let bin = kubelet_bin();
    if !bin.is_file() {
        println!(
            "SKIP: {} not found (set CUBELET_KUBELET_BIN or put kubelet-v1.28.7 on PATH)",
            bin.display()
        );
        return;
    }
    let opts = DaemonOpts {
        extra_config: match (pause_mode(), stats_anchor()) {
            (true, _) => Some("runtime: { sandbox: pause }\n".to_owned()),
            (false, false) => Some("runtime: { stats_anchor: false }\n".to_owned()),
            (false, true) => None,
        },
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(600), |d| {
        Box::pin(async move {
            let target = match std::env::var("CUBELET_KUBELET_TARGET").as_deref() {
                Ok("containerd") => Target::containerd(d).await?,
                _ => Target::cubelet(d),
            };
            let k = Kubelet::start(d, &target).await?;
            let ns = k.namespace.clone();
            let result = scenario(&target, &k).await;
            if result.is_err() {
                let log = std::fs::read(&k.log).unwrap_or_default();
                let text = String::from_utf8_lossy(&log);
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                println!("--- kubelet log tail ---");
                for l in tail.iter().rev() {
                    println!("{l}");
                }
            }
            // Stop kubelet before removing pods, or it re-creates them.
            let stopped = k.stop().await;
            let cleaned = target.clean(&ns, d).await;
            result?;
            stopped?;
            cleaned
        })
    })
    .await;
}

#[test]
fn a_double_removal_explains_only_its_own_not_found() {
    // From a CI run: kubelet removes one container twice as its pod goes.
    let id = "c0fc9d049e22de058440d5f7b1c8e9450dd2758f0b8b0db65fa39fecf919c2a2";
    let removal = format!(
        r#"I1201 23:52:11.217727    6798 scope.go:117] "RemoveContainer" containerID="{id}""#
    );
    let not_found = format!(
        r#"E1201 23:52:11.227212    6798 remote_runtime.go:432] "ContainerStatus from runtime service failed" err="rpc error: code = NotFound desc = container \"{id}\" not found" containerID="{id}""#
    );
    let twice = [removal.as_str(), &removal, &not_found].join("\n");
    assert!(unexplained_errors(&twice).is_empty());
    // Removed once only, or never: the NotFound is the runtime's to explain.
    let once = [removal.as_str(), &not_found].join("\n");
    assert_eq!(unexplained_errors(&once), vec![not_found.clone()]);
    assert_eq!(unexplained_errors(&not_found), vec![not_found.clone()]);
    // Another error about the same container is never explained.
    let other = not_found.replace("code = NotFound", "code = Internal");
    let internal = [removal.as_str(), &removal, &other].join("\n");
    assert_eq!(unexplained_errors(&internal), vec![other]);
    // The known lines still are.
    assert!(unexplained_errors(r#"E1201 x.go:1] "Skipping pod synchronization""#).is_empty());
}

#[test]
fn kubelets_manifest_removal_race_is_explained() {
    // From a CI run in the qemu guest: the manifest went between the 20 s
    // re-list's glob and its stat.
    let log = r#"E1207 19:11:27.842365    1536 file.go:176] "Could not get metadata" err="stat /var/lib/cubelet-e2e-1515-0/kubelet/manifests/hostport.yaml: no such file or directory" path="/var/lib/cubelet-e2e-1515-0/kubelet/manifests/hostport.yaml"
E1207 19:11:27.859892    1536 file.go:108] "Unable to process watch event" err="the pod with key kl-1515/hostport-cubelet-e2e-node doesn't exist in cache""#;
    assert!(unexplained_errors(log).is_empty());
    // A manifest kubelet cannot read for another reason is not explained.
    let other = r#"E1207 19:11:27.842365    1536 file.go:176] "Could not get metadata" err="stat /etc/kubernetes/manifests/x.yaml: permission denied""#;
    assert_eq!(unexplained_errors(other), vec![other.to_owned()]);
}
