//! One pod lifecycle over CRI, timed call by call, with the configs a
//! kubelet sends: the same requests go to every endpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use cubelet_e2e::cri::runtime_service_client::RuntimeServiceClient;
use cubelet_e2e::cri::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, DnsConfig, ImageSpec,
    LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};
use tonic::transport::Channel;

/// The timed calls of one lifecycle, in the order they are made.
pub(crate) const CALLS: [&str; 7] = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
];

/// Kubernetes namespace of the bench's pods.
const POD_NAMESPACE: &str = "cri-bench";

/// How long each call of one lifecycle took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Lifecycle {
    /// Per call, in [`CALLS`] order.
    pub(crate) calls: [Duration; CALLS.len()],
    /// First call to last answer.
    pub(crate) total: Duration,
}

impl Lifecycle {
    /// RunPodSandbox + CreateContainer + StartContainer: a pod to running.
    pub(crate) fn pod_to_running(&self) -> Duration {
        self.calls[0] + self.calls[1] + self.calls[2]
    }
}

/// What the lifecycles send: image, handler, stop timeout, log root.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    /// Container image (pulled beforehand).
    pub(crate) image: String,
    /// RuntimeClass handler (empty = the runtime's default).
    pub(crate) runtime_handler: String,
    /// StopContainer timeout in seconds.
    pub(crate) stop_timeout: i64,
    /// Where pod log directories go (a temporary dir, removed afterwards).
    pub(crate) log_root: PathBuf,
}

/// The sandbox config a kubelet sends for a plain pod: metadata, hostname,
/// log directory (`<namespace>_<name>_<uid>`), kubelet's labels, ClusterFirst
/// DNS (written into the pod's resolv.conf; nothing is sent there), and
/// namespace options with the pod's own network and IPC but a PID
/// namespace per container (`shareProcessNamespace: false`).
pub(crate) fn pod_config(name: &str, uid: &str, log_root: &Path) -> PodSandboxConfig {
    let labels = HashMap::from([
        ("io.kubernetes.pod.name".to_owned(), name.to_owned()),
        (
            "io.kubernetes.pod.namespace".to_owned(),
            POD_NAMESPACE.to_owned(),
        ),
        ("io.kubernetes.pod.uid".to_owned(), uid.to_owned()),
        ("app".to_owned(), "cri-bench".to_owned()),
    ]);
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.to_owned(),
            uid: uid.to_owned(),
            namespace: POD_NAMESPACE.to_owned(),
            attempt: 0,
        }),
        hostname: name.chars().take(63).collect(),
        log_directory: log_root
            .join(format!("{POD_NAMESPACE}_{name}_{uid}"))
            .display()
            .to_string(),
        dns_config: Some(DnsConfig {
            servers: vec!["10.96.0.10".to_owned()],
            searches: vec![
                format!("{POD_NAMESPACE}.svc.cluster.local"),
                "svc.cluster.local".to_owned(),
                "cluster.local".to_owned(),
            ],
            options: vec!["ndots:5".to_owned()],
        }),
        labels,
        annotations: HashMap::from([("kubernetes.io/config.source".to_owned(), "api".to_owned())]),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(pod_namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pod_namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// The container config a kubelet sends: `sleep 3600`, log path
/// `<name>/<restart count>.log` under the pod's log directory, kubelet's
/// labels, the pod's namespace options.
pub(crate) fn container_config(pod: &PodSandboxConfig, image: &str) -> ContainerConfig {
    let meta = pod.metadata.clone().unwrap_or_default();
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: "sleep".to_owned(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        }),
        command: vec!["sleep".to_owned(), "3600".to_owned()],
        log_path: "sleep/0.log".to_owned(),
        labels: HashMap::from([
            (
                "io.kubernetes.container.name".to_owned(),
                "sleep".to_owned(),
            ),
            ("io.kubernetes.pod.name".to_owned(), meta.name),
            ("io.kubernetes.pod.namespace".to_owned(), meta.namespace),
            ("io.kubernetes.pod.uid".to_owned(), meta.uid),
        ]),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(pod_namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A unique pod name for lifecycle `i` of endpoint `endpoint` in `phase`.
pub(crate) fn pod_name(phase: &str, endpoint: usize, i: usize) -> String {
    format!("{phase}-{}-{endpoint}-{i}", std::process::id())
}

/// Creates the pod's log directory and its container's, as a kubelet does
/// before RunPodSandbox and CreateContainer.
fn make_log_dirs(cfg: &PodSandboxConfig) -> anyhow::Result<()> {
    let dir = Path::new(&cfg.log_directory).join("sleep");
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))
}

/// RunPodSandbox of `cfg`; the pod id and how long the call took.
pub(crate) async fn run_pod(
    rt: &mut RuntimeServiceClient<Channel>,
    w: &Workload,
    cfg: &PodSandboxConfig,
) -> anyhow::Result<(String, Duration)> {
    make_log_dirs(cfg)?;
    let t = Instant::now();
    let id = rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: w.runtime_handler.clone(),
        })
        .await
        .context("RunPodSandbox")?
        .into_inner()
        .pod_sandbox_id;
    Ok((id, t.elapsed()))
}

/// StopPodSandbox and RemovePodSandbox of `pod` (both tried); their times.
pub(crate) async fn remove_pod(
    rt: &mut RuntimeServiceClient<Channel>,
    pod: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let t = Instant::now();
    let stop = rt
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.to_owned(),
        })
        .await;
    let stopped = t.elapsed();
    let t = Instant::now();
    let remove = rt
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod.to_owned(),
        })
        .await;
    let removed = t.elapsed();
    stop.context("StopPodSandbox")?;
    remove.context("RemovePodSandbox")?;
    Ok((stopped, removed))
}

/// One full lifecycle of pod `name`, each call timed: RunPodSandbox,
/// CreateContainer, StartContainer, StopContainer, RemoveContainer,
/// StopPodSandbox, RemovePodSandbox. The pod is torn down even when a
/// container call fails.
pub(crate) async fn lifecycle(
    mut rt: RuntimeServiceClient<Channel>,
    w: &Workload,
    name: &str,
) -> anyhow::Result<Lifecycle> {
    let start = Instant::now();
    let mut out = Lifecycle::default();
    let cfg = pod_config(name, &format!("uid-{name}"), &w.log_root);
    let (pod, run) = run_pod(&mut rt, w, &cfg).await?;
    out.calls[0] = run;
    let body = async {
        let mut last = Instant::now();
        let mut lap = |k: usize| {
            let now = Instant::now();
            out.calls[k] = now - last;
            last = now;
        };
        let cid = rt
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(container_config(&cfg, &w.image)),
                sandbox_config: Some(cfg.clone()),
            })
            .await
            .context("CreateContainer")?
            .into_inner()
            .container_id;
        lap(1);
        rt.start_container(StartContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .context("StartContainer")?;
        lap(2);
        rt.stop_container(StopContainerRequest {
            container_id: cid.clone(),
            timeout: w.stop_timeout,
        })
        .await
        .context("StopContainer")?;
        lap(3);
        rt.remove_container(RemoveContainerRequest { container_id: cid })
            .await
            .context("RemoveContainer")?;
        lap(4);
        anyhow::Ok(())
    }
    .await;
    let teardown = remove_pod(&mut rt, &pod).await;
    body.with_context(|| format!("pod {name}"))?;
    let (stop, remove) = teardown.with_context(|| format!("pod {name}"))?;
    out.calls[5] = stop;
    out.calls[6] = remove;
    out.total = start.elapsed();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_config_is_a_kubelets() {
        let cfg = pod_config("p", "u", Path::new("/tmp/x"));
        assert_eq!(cfg.log_directory, "/tmp/x/cri-bench_p_u");
        let ns = cfg
            .linux
            .and_then(|l| l.security_context)
            .and_then(|s| s.namespace_options)
            .unwrap();
        // A kubelet asks for a PID namespace per container unless the pod
        // shares one; the runtimes' default (0) would be POD.
        assert_eq!(ns.pid, NamespaceMode::Container as i32);
        assert_eq!(ns.network, NamespaceMode::Pod as i32);
        assert_eq!(cfg.labels["io.kubernetes.pod.uid"], "u");
    }

    #[test]
    fn container_config_logs_under_its_name() {
        let pod = pod_config("p", "u", Path::new("/tmp/x"));
        let c = container_config(&pod, "img");
        assert_eq!(c.log_path, "sleep/0.log");
        assert_eq!(c.labels["io.kubernetes.pod.name"], "p");
        assert_eq!(c.image.unwrap().image, "img");
    }

    #[test]
    fn pod_to_running_is_the_first_three_calls() {
        let mut l = Lifecycle::default();
        for (k, c) in l.calls.iter_mut().enumerate() {
            *c = Duration::from_millis(k as u64 + 1);
        }
        assert_eq!(l.pod_to_running(), Duration::from_millis(6));
    }
}
