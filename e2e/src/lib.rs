//! End-to-end harness for Cubelet: starts the real `cubelet` daemon against
//! the private test containerd and registry (see `hack/`), talks to it over
//! its real CRI socket with the generated `cubelet-cri-api` clients, audits the
//! kernel and containerd for leaks, and tears everything down afterwards.
//!
//! This crate knows only the daemon's external contract (its config keys,
//! its socket, `/readyz`, SIGTERM) and what it leaves on the host (netns
//! pins, mounts, veths, nft tables, containerd objects). It must not link
//! any Cubelet crate: what it tests is the binary, as kubelet sees it.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use cubelet_cri_api::v1::image_service_client::ImageServiceClient;
use cubelet_cri_api::v1::runtime_service_client::RuntimeServiceClient;
use cubelet_cri_api::v1::{
    AttachRequest, ContainerConfig, ContainerMetadata, ContainerStatus, ContainerStatusRequest,
    CreateContainerRequest, ImageSpec, ListContainersRequest, ListPodSandboxRequest,
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatus, PodSandboxStatusRequest,
    PullImageRequest, RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint, Uri};

pub use cubelet_cri_api::v1 as cri;

/// Default socket of the private test containerd (`hack/containerd.sh`).
pub const DEFAULT_CONTAINERD: &str = "/run/cubelet-test/containerd/containerd.sock";
/// Root directory of the private test containerd.
pub const CONTAINERD_ROOT: &str = "/var/lib/cubelet-test/containerd";
/// State root of runc for the default handler.
pub const RUNC_ROOT: &str = "/run/cubelet-test/runc";
/// State root of runc for the `runc-alt` handler.
pub const RUNC_ALT_ROOT: &str = "/run/cubelet-test/runc-alt";
/// The private registry (`hack/registry.sh`).
pub const REGISTRY: &str = "127.0.0.1:5000";
/// Prefix of the veths the bridge provider creates (`cubelet_network::VETH_PREFIX`).
pub const VETH_PREFIX: &str = "cb";

/// Socket of the test containerd: `$CUBELET_TEST_CONTAINERD` or the default.
pub fn containerd_socket() -> PathBuf {
    std::env::var_os("CUBELET_TEST_CONTAINERD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTAINERD))
}

/// `runtime.cgroup_driver` of the daemons the harness starts:
/// `$CUBELET_E2E_CGROUP_DRIVER` (`systemd`, `cgroupfs` or `auto`), or
/// `None` for the daemon's default (`auto`).
pub fn e2e_cgroup_driver() -> Option<String> {
    std::env::var("CUBELET_E2E_CGROUP_DRIVER")
        .ok()
        .filter(|d| !d.is_empty())
}

/// The CRI socket of an already running Cubelet to attach to instead of
/// starting one: `$CUBELET_E2E_SOCKET` (a systemd service in a guest). See
/// [`Daemon::attach`].
pub fn attach_socket() -> Option<PathBuf> {
    std::env::var_os("CUBELET_E2E_SOCKET")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// Why a test that attaches when `CUBELET_E2E_SOCKET` is set
/// ([`Daemon::start_or_attach`]) cannot run here, if it cannot: the
/// socket must answer (and the test run as root); without it, as
/// [`skip_reason`].
pub fn attach_skip_reason() -> Option<String> {
    let Some(sock) = attach_socket() else {
        return skip_reason();
    };
    if !nix::unistd::Uid::effective().is_root() {
        return Some("not running as root".to_owned());
    }
    match std::os::unix::net::UnixStream::connect(&sock) {
        Ok(_) => None,
        Err(e) => Some(format!(
            "CUBELET_E2E_SOCKET {} does not answer: {e}",
            sock.display()
        )),
    }
}

/// Why the end-to-end tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    let sock = containerd_socket();
    if !sock.exists() {
        return Some(format!(
            "containerd socket {} missing (run hack/containerd.sh start)",
            sock.display()
        ));
    }
    if let Err(e) = std::os::unix::net::UnixStream::connect(&sock) {
        return Some(format!(
            "containerd socket {} does not answer: {e} (run hack/containerd.sh start)",
            sock.display()
        ));
    }
    if !nix::unistd::Uid::effective().is_root() {
        return Some("not running as root".to_owned());
    }
    None
}

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The daemon binary: `$CUBELET_BIN` or `target/debug/cubelet`.
pub fn cubelet_bin() -> PathBuf {
    std::env::var_os("CUBELET_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("debug").join("cubelet"))
}

/// The daemon binary a benchmark starts: `flag`, `$CUBELET_BIN`, the
/// release build if there is one, else the debug build.
pub fn bench_cubelet_bin(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("CUBELET_BIN") {
        return PathBuf::from(p);
    }
    let release = target_dir().join("release").join("cubelet");
    if release.is_file() {
        release
    } else {
        cubelet_bin()
    }
}

/// Opens a tonic channel to a CRI endpoint on a unix socket.
pub async fn connect(socket: &Path) -> anyhow::Result<Channel> {
    let path = socket.to_path_buf();
    // The URI is ignored by the connector; tonic only needs a valid one.
    Endpoint::try_from("http://[::1]:50051")?
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .with_context(|| format!("connect to {}", socket.display()))
}

/// Options for [`Daemon::start`].
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    /// Distinguishes daemons of one process (bridge name, subnet, dirs).
    pub index: u8,
    /// Extra YAML appended as a drop-in (`config.d/50-extra.yaml`).
    pub extra_config: Option<String>,
    /// How long to wait for `/readyz`.
    pub ready_timeout: Duration,
    /// Keep the daemon's own GC interval (benchmarks) instead of the tests'
    /// 10 s, which makes a GC pass run every few lifecycles.
    pub default_gc: bool,
}

impl Default for DaemonOpts {
    fn default() -> Self {
        Self {
            index: 0,
            extra_config: None,
            ready_timeout: Duration::from_secs(90),
            default_gc: false,
        }
    }
}

/// A running `cubelet` daemon with its own dirs, bridge, containerd namespace
/// and CRI clients.
#[derive(Debug)]
pub struct Daemon {
    child: std::sync::Mutex<Option<tokio::process::Child>>,
    bin: PathBuf,
    config_file: PathBuf,
    drop_ins: PathBuf,
    /// The CRI socket.
    pub socket: PathBuf,
    /// `root_dir` of the daemon.
    pub root_dir: PathBuf,
    /// `state_dir` of the daemon.
    pub state_dir: PathBuf,
    /// `/var/lib/cubelet-e2e-<pid>-<n>`: root_dir, log dirs, daemon log.
    pub lib_base: PathBuf,
    /// `/run/cubelet-e2e-<pid>-<n>`: socket, state_dir.
    pub run_base: PathBuf,
    /// Where pods of the tests put their logs.
    pub log_base: PathBuf,
    /// The daemon's stdout and stderr.
    pub daemon_log: PathBuf,
    /// containerd namespace of this daemon.
    pub namespace: String,
    /// Test bridge name.
    pub bridge: String,
    /// Test pod subnet (a /24): network address.
    pub subnet: Ipv4Addr,
    /// The bridge's address (first host of the subnet).
    pub gateway: Ipv4Addr,
    /// Admin HTTP address (/readyz, /metrics).
    pub metrics: SocketAddr,
    /// The containerd socket the daemon uses.
    pub containerd: PathBuf,
    /// RuntimeService client.
    pub runtime: RuntimeServiceClient<Channel>,
    /// ImageService client.
    pub images: ImageServiceClient<Channel>,
    config_dir: tempfile::TempDir,
    ip_forward_before: Option<String>,
    /// Attached to a Cubelet the harness did not start ([`Daemon::attach`]):
    /// teardown removes only what the harness made (its log directory).
    attached: bool,
}

fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("bind a free port")?;
    Ok(l.local_addr()?.port())
}

/// A Cubelet for a tool run beside it (critest, the node e2e suite): fails
/// when the test infrastructure is missing, takes the drop-in at `drop_in`,
/// and waits up to 120 s for readiness.
pub async fn start_for_tool(index: u8, drop_in: Option<&Path>) -> anyhow::Result<Daemon> {
    if let Some(why) = skip_reason() {
        bail!("cannot run: {why}");
    }
    Daemon::start(DaemonOpts {
        index,
        extra_config: read_drop_in(drop_in)?,
        ready_timeout: Duration::from_secs(120),
        ..Default::default()
    })
    .await
}

/// The text of the config drop-in at `path`, for [`DaemonOpts::extra_config`]
/// (the benchmarks' and critest runner's `--drop-in`); `None` without one.
pub fn read_drop_in(path: Option<&Path>) -> anyhow::Result<Option<String>> {
    path.map(|p| {
        std::fs::read_to_string(p).with_context(|| format!("read drop-in {}", p.display()))
    })
    .transpose()
}

/// Picks a bridge index `n` whose `cbe2e<n>` does not exist yet.
fn pick_net(index: u8) -> u8 {
    let start = (std::process::id() % 200) as u8;
    (0..200u8)
        .map(|i| 20 + (start.wrapping_add(index).wrapping_add(i)) % 200)
        .find(|n| !Path::new(&format!("/sys/class/net/cbe2e{n}")).exists())
        .unwrap_or(20 + index)
}

impl Daemon {
    /// Writes a config, spawns the daemon, waits for `/readyz` and connects.
    pub async fn start(opts: DaemonOpts) -> anyhow::Result<Daemon> {
        // Everything that can fail without touching the host comes first;
        // from the directories on, a failed start cleans up after itself.
        let pause = std::env::var_os("CUBELET_PAUSE_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| target_dir().join("cubelet-pause"));
        let bin = cubelet_bin();
        if !bin.is_file() {
            bail!(
                "{} missing: run `cargo build -p cubelet` first",
                bin.display()
            );
        }
        if !pause.is_file() {
            bail!("{} missing: run hack/build-pause.sh first", pause.display());
        }
        let pid = std::process::id();
        let tag = format!("{pid}-{}", opts.index);
        let run_base = PathBuf::from(format!("/run/cubelet-e2e-{tag}"));
        let lib_base = PathBuf::from(format!("/var/lib/cubelet-e2e-{tag}"));
        let socket = run_base.join("cubelet.sock");
        let state_dir = run_base.join("state");
        let root_dir = lib_base.join("root");
        let log_base = lib_base.join("logs");
        let net = pick_net(opts.index);
        let bridge = format!("cbe2e{net}");
        let subnet = Ipv4Addr::new(10, 201, net, 0);
        let gateway = Ipv4Addr::new(10, 201, net, 1);
        let namespace = format!("cubelet-e2e-{tag}");
        let metrics: SocketAddr = (Ipv4Addr::LOCALHOST, free_port()?).into();
        let containerd = containerd_socket();
        let cgroup_driver = match e2e_cgroup_driver() {
            Some(d) if ["systemd", "cgroupfs", "auto"].contains(&d.as_str()) => {
                format!("  cgroup_driver: {d}\n")
            }
            Some(d) => bail!("CUBELET_E2E_CGROUP_DRIVER={d:?}: want systemd, cgroupfs or auto"),
            None => String::new(),
        };

        let config_dir = tempfile::Builder::new()
            .prefix("cubelet-e2e-config")
            .tempdir()?;
        let certs = config_dir.path().join("certs.d");
        write_registry_config(&certs)?;
        let config = format!(
            "socket: {socket}\n\
             root_dir: {root}\n\
             state_dir: {state}\n\
             containerd:\n  address: {ctrd}\n  namespace: {namespace}\n  root: {ctrd_root}\n\
             metrics:\n  address: {metrics}\n\
             images:\n  pause_binary: {pause}\n  registry_config_dir: {certs}\n\
             runtime:\n  default_handler: runc\n  handlers:\n\
             \x20   runc: {{ runtime_type: io.containerd.runc.v2, binary: /usr/sbin/runc, root: {runc} }}\n\
             \x20   runc-alt: {{ runtime_type: io.containerd.runc.v2, binary: /usr/sbin/runc, root: {runc_alt} }}\n\
             {cgroup_driver}\
             network:\n  provider: bridge\n  bridge: {{ name: {bridge}, subnet: {subnet}/24, mtu: 1500 }}\n\
             {gc}",
            socket = socket.display(),
            root = root_dir.display(),
            state = state_dir.display(),
            ctrd = containerd.display(),
            ctrd_root = CONTAINERD_ROOT,
            pause = pause.display(),
            certs = certs.display(),
            runc = RUNC_ROOT,
            runc_alt = RUNC_ALT_ROOT,
            gc = if opts.default_gc {
                ""
            } else {
                "gc:\n  interval: 10s\n"
            },
        );
        let config_file = config_dir.path().join("config.yaml");
        std::fs::write(&config_file, config)?;
        let drop_ins = config_dir.path().join("config.d");
        std::fs::create_dir_all(&drop_ins)?;
        if let Some(extra) = &opts.extra_config {
            std::fs::write(drop_ins.join("50-extra.yaml"), extra)?;
        }

        let ip_forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").ok();
        let daemon_log = lib_base.join("cubelet.log");
        let host = Host {
            run_base: run_base.clone(),
            lib_base: lib_base.clone(),
            bridge: bridge.clone(),
            namespace: namespace.clone(),
            containerd: containerd.clone(),
            ip_forward_before: ip_forward_before.clone(),
        };
        let ready = async {
            for d in [&run_base, &lib_base, &log_base] {
                std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
            }
            let child = spawn(&bin, &config_file, &drop_ins, &daemon_log)?;
            let mut partial = Partial {
                child: Some(child),
                log: daemon_log.clone(),
            };
            wait_ready(&mut partial, metrics, scaled(opts.ready_timeout)).await?;
            let channel = connect(&socket).await?;
            anyhow::Ok((partial, channel))
        }
        .await;
        // A failed start still cleans the host (Partial's drop kills the child).
        let (mut partial, channel) = match ready {
            Ok(r) => r,
            Err(e) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                return match host.cleanup().await {
                    Ok(()) => Err(e),
                    Err(c) => Err(e.context(format!("and the cleanup after it failed: {c:#}"))),
                };
            }
        };
        let child = std::sync::Mutex::new(partial.child.take());
        Ok(Daemon {
            child,
            bin,
            config_file,
            drop_ins,
            socket,
            root_dir,
            state_dir,
            lib_base,
            run_base,
            log_base,
            daemon_log,
            namespace,
            bridge,
            subnet,
            gateway,
            metrics,
            containerd,
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            config_dir,
            ip_forward_before,
            attached: false,
        })
    }

    /// Attaches to a Cubelet already serving CRI on `socket` (a systemd
    /// service in a guest) instead of starting one. What the harness
    /// cannot know of that daemon comes from the environment, with
    /// Cubelet's defaults: `CUBELET_TEST_CONTAINERD`
    /// (`/run/containerd/containerd.sock`), `CUBELET_E2E_NAMESPACE`
    /// (`k8s.cubelet.io`), `CUBELET_E2E_ROOT_DIR` (`/var/lib/cubelet`),
    /// `CUBELET_E2E_STATE_DIR` (`/run/cubelet`), `CUBELET_E2E_METRICS`
    /// (`127.0.0.1:9385`), `CUBELET_E2E_BRIDGE` (`cubelet0`). The pods'
    /// log directories go under `/var/lib/cubelet-e2e-attach-<pid>`, the
    /// only thing [`Daemon::teardown`] then removes: the daemon, its
    /// containerd namespace and its pods other than the test's are left
    /// alone, so a test removes what it made itself.
    pub async fn attach(socket: &Path) -> anyhow::Result<Daemon> {
        let env_path = |k: &str, d: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from(d), PathBuf::from)
        };
        let env = |k: &str, d: &str| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| d.to_owned())
        };
        let metrics: SocketAddr = env("CUBELET_E2E_METRICS", "127.0.0.1:9385")
            .parse()
            .context("CUBELET_E2E_METRICS")?;
        let lib_base = PathBuf::from(format!(
            "/var/lib/cubelet-e2e-attach-{}",
            std::process::id()
        ));
        let log_base = lib_base.join("logs");
        std::fs::create_dir_all(&log_base)
            .with_context(|| format!("create {}", log_base.display()))?;
        let channel = connect(socket).await?;
        let config_dir = tempfile::Builder::new()
            .prefix("cubelet-e2e-attach")
            .tempdir()?;
        Ok(Daemon {
            child: std::sync::Mutex::new(None),
            bin: cubelet_bin(),
            config_file: config_dir.path().join("config.yaml"),
            drop_ins: config_dir.path().join("config.d"),
            socket: socket.to_path_buf(),
            root_dir: env_path("CUBELET_E2E_ROOT_DIR", "/var/lib/cubelet"),
            state_dir: env_path("CUBELET_E2E_STATE_DIR", "/run/cubelet"),
            run_base: lib_base.clone(),
            daemon_log: lib_base.join("no-daemon-log"),
            lib_base,
            log_base,
            namespace: env("CUBELET_E2E_NAMESPACE", "k8s.cubelet.io"),
            bridge: env("CUBELET_E2E_BRIDGE", "cubelet0"),
            subnet: Ipv4Addr::UNSPECIFIED,
            gateway: Ipv4Addr::UNSPECIFIED,
            metrics,
            containerd: env_path("CUBELET_TEST_CONTAINERD", "/run/containerd/containerd.sock"),
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            config_dir,
            ip_forward_before: None,
            attached: true,
        })
    }

    /// Whether this is a daemon the harness attached to rather than
    /// started ([`Daemon::attach`]).
    pub fn is_attached(&self) -> bool {
        self.attached
    }

    /// [`Daemon::attach`] when `CUBELET_E2E_SOCKET` is set, else
    /// [`Daemon::start`] with `opts`.
    pub async fn start_or_attach(opts: DaemonOpts) -> anyhow::Result<Daemon> {
        match attach_socket() {
            Some(socket) => Daemon::attach(&socket).await,
            None => Daemon::start(opts).await,
        }
    }

    /// Where the daemon pins the IPC and UTS namespaces of sandboxes
    /// without an infra process (`<state_dir>/podns/<id>/{ipc,uts}`).
    pub fn podns_dir(&self) -> PathBuf {
        self.state_dir.join("podns")
    }

    /// The config file directory (config.yaml, config.d/, certs.d/).
    pub fn config_dir(&self) -> &Path {
        self.config_dir.path()
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .ok()
            .and_then(|c| c.as_ref().and_then(|c| c.id()))
    }

    fn take_child(&self) -> Option<tokio::process::Child> {
        self.child.lock().ok().and_then(|mut c| c.take())
    }

    /// The last `n` lines of the daemon's log (nothing for an attached
    /// daemon, whose log is its service's).
    pub fn log_tail(&self, n: usize) -> String {
        if self.attached {
            return "(attached daemon: see its service's journal)".to_owned();
        }
        tail(&self.daemon_log, n)
    }

    /// SIGTERMs the daemon and waits (30 s, then SIGKILL). Returns its exit code.
    pub async fn stop(&self) -> anyhow::Result<Option<i32>> {
        let Some(mut child) = self.take_child() else {
            return Ok(None);
        };
        terminate(&mut child, Duration::from_secs(30)).await
    }

    /// SIGKILLs the daemon (as a crash would) and reaps it. Containers and
    /// the kernel state it made stay behind for the next start to reconcile.
    pub async fn kill9(&self) -> anyhow::Result<()> {
        if let Some(mut child) = self.take_child() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Starts the (stopped or killed) daemon again with extra environment
    /// (e.g. `CUBELET_TEST_FAILPOINTS`) and waits for `/readyz`.
    pub async fn start_with_env(&self, env: &[(&str, &str)]) -> anyhow::Result<()> {
        let child = spawn_env(
            &self.bin,
            &self.config_file,
            &self.drop_ins,
            &self.daemon_log,
            env,
        )?;
        let mut partial = Partial {
            child: Some(child),
            log: self.daemon_log.clone(),
        };
        wait_ready(&mut partial, self.metrics, Duration::from_secs(90)).await?;
        if let Ok(mut c) = self.child.lock() {
            *c = partial.child.take();
        }
        Ok(())
    }

    /// SIGTERMs the daemon (it must exit 0), starts it again with the same
    /// config and dirs, and waits for `/readyz`. The clients reconnect.
    pub async fn restart(&self) -> anyhow::Result<()> {
        match self.stop().await? {
            Some(0) => {}
            other => bail!("daemon exited with {other:?} on SIGTERM"),
        }
        self.start_with_env(&[]).await
    }

    /// Stops and removes every container and pod sandbox through CRI.
    pub async fn remove_all(&self) -> anyhow::Result<()> {
        let mut rt = self.runtime.clone();
        let containers = rt
            .list_containers(ListContainersRequest::default())
            .await?
            .into_inner();
        for c in containers.containers {
            rt.stop_container(StopContainerRequest {
                container_id: c.id.clone(),
                timeout: 2,
            })
            .await
            .with_context(|| format!("stop container {}", c.id))?;
            rt.remove_container(RemoveContainerRequest {
                container_id: c.id.clone(),
            })
            .await
            .with_context(|| format!("remove container {}", c.id))?;
        }
        let pods = rt
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await?
            .into_inner();
        for p in pods.items {
            rt.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await
            .with_context(|| format!("stop pod {}", p.id))?;
            rt.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await
            .with_context(|| format!("remove pod {}", p.id))?;
        }
        Ok(())
    }

    /// Pulls `image`; returns its image ref.
    pub async fn pull(&self, image: &str) -> anyhow::Result<String> {
        let r = self
            .images
            .clone()
            .pull_image(PullImageRequest {
                image: Some(image_spec(image)),
                ..Default::default()
            })
            .await
            .with_context(|| format!("PullImage {image}"))?;
        Ok(r.into_inner().image_ref)
    }

    /// The config of pod `name`: uid `uid-<name>`, logs under
    /// `log_base/<name>`.
    pub fn pod_config(&self, name: &str) -> PodSandboxConfig {
        pod_config(name, &format!("uid-{name}"), &self.log_base.join(name))
    }

    /// RunPodSandbox with `config` on runtime `handler` (`""` for the
    /// default); returns the pod id.
    pub async fn run_pod(
        &self,
        config: &PodSandboxConfig,
        handler: &str,
    ) -> anyhow::Result<String> {
        let name = config.metadata.as_ref().map_or("", |m| m.name.as_str());
        let r = self
            .runtime
            .clone()
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.to_owned(),
            })
            .await
            .with_context(|| format!("RunPodSandbox {name}"))?;
        Ok(r.into_inner().pod_sandbox_id)
    }

    /// The ids of every pod sandbox ListPodSandbox lists.
    pub async fn pod_ids(&self) -> anyhow::Result<Vec<String>> {
        Ok(self
            .runtime
            .clone()
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await
            .context("ListPodSandbox")?
            .into_inner()
            .items
            .into_iter()
            .map(|p| p.id)
            .collect())
    }

    /// The (non-verbose) PodSandboxStatus of pod `id`.
    pub async fn pod_status(&self, id: &str) -> anyhow::Result<PodSandboxStatus> {
        self.runtime
            .clone()
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.to_owned(),
                verbose: false,
            })
            .await
            .with_context(|| format!("PodSandboxStatus {id}"))?
            .into_inner()
            .status
            .with_context(|| format!("PodSandboxStatus {id}: no status"))
    }

    /// Creates and starts `cfg` in pod `pod` (run from `pod_cfg`); returns
    /// the container id.
    pub async fn start_in(
        &self,
        pod: &str,
        pod_cfg: &PodSandboxConfig,
        cfg: ContainerConfig,
    ) -> anyhow::Result<String> {
        let name = cfg
            .metadata
            .as_ref()
            .map_or("", |m| m.name.as_str())
            .to_owned();
        let mut rt = self.runtime.clone();
        let id = rt
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.to_owned(),
                config: Some(cfg),
                sandbox_config: Some(pod_cfg.clone()),
            })
            .await
            .with_context(|| format!("CreateContainer {name}"))?
            .into_inner()
            .container_id;
        rt.start_container(StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .with_context(|| format!("StartContainer {name}"))?;
        Ok(id)
    }

    /// Pulls `cfg`'s image, runs pod `name` ([`Self::pod_config`]) and
    /// creates and starts `cfg` in it. Returns the pod and container ids.
    pub async fn pod_with(
        &self,
        name: &str,
        cfg: ContainerConfig,
    ) -> anyhow::Result<(String, String)> {
        let image = cfg
            .image
            .as_ref()
            .context("container config has no image")?;
        self.pull(&image.image).await?;
        let pod_cfg = self.pod_config(name);
        let pod = self.run_pod(&pod_cfg, "").await?;
        let cid = self.start_in(&pod, &pod_cfg, cfg).await?;
        Ok((pod, cid))
    }

    /// The (non-verbose) status of container `id`.
    pub async fn container_status(&self, id: &str) -> anyhow::Result<ContainerStatus> {
        self.runtime
            .clone()
            .container_status(ContainerStatusRequest {
                container_id: id.to_owned(),
                verbose: false,
            })
            .await
            .with_context(|| format!("ContainerStatus {id}"))?
            .into_inner()
            .status
            .context("no status in the ContainerStatus response")
    }

    /// An attach URL for container `id`: stdin, stdout and stderr, no TTY.
    pub async fn attach_url(&self, id: &str) -> anyhow::Result<String> {
        Ok(self
            .runtime
            .clone()
            .attach(AttachRequest {
                container_id: id.to_owned(),
                stdin: true,
                tty: false,
                stdout: true,
                stderr: true,
            })
            .await
            .with_context(|| format!("Attach {id}"))?
            .into_inner()
            .url)
    }

    /// Runs `ctr` against the test containerd in this daemon's namespace.
    pub async fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let sock = self.containerd.display().to_string();
        let mut full = vec!["--address", sock.as_str(), "-n", self.namespace.as_str()];
        full.extend_from_slice(args);
        run("ctr", &full).await
    }

    /// Runs `cubelet ctl` against the daemon's admin socket; returns stdout.
    pub async fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let socket = self.state_dir.join("admin.sock").display().to_string();
        let mut full = vec!["ctl", "--socket", socket.as_str()];
        full.extend_from_slice(args);
        run(&self.bin.display().to_string(), &full).await
    }

    /// The warm-pool shells the daemon holds now (ready or being made):
    /// their ids (`cubelet ctl shells`); none when the daemon is not running.
    pub async fn shells(&self) -> anyhow::Result<Vec<String>> {
        if self.pid().is_none() {
            return Ok(Vec::new());
        }
        Ok(self
            .ctl(&["shells"])
            .await?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// The netns pins under `<state_dir>/netns` that are not the warm-pool
    /// shells' the daemon holds (listed first, the shells asked after, so
    /// a shell begun meanwhile is left out too).
    pub async fn pod_netns_pins(&self) -> anyhow::Result<Vec<PathBuf>> {
        let dir = self.state_dir.join("netns");
        let pins: Vec<PathBuf> = dir_entries(&dir).into_iter().map(|n| dir.join(n)).collect();
        let shells = self.shells().await?;
        Ok(pins
            .into_iter()
            .filter(|p| !shells.iter().any(|s| p.ends_with(s)))
            .collect())
    }

    /// Full teardown: pods via CRI, the daemon, the bridge and its nft table,
    /// ip_forward, mounts and dirs, containerd objects and namespace.
    /// Every step runs; the errors are returned together.
    pub async fn teardown(self) -> anyhow::Result<()> {
        if self.attached {
            // Not ours: only the log directory the harness made goes.
            return match std::fs::remove_dir_all(&self.lib_base) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    bail!("teardown: remove {}: {e}", self.lib_base.display())
                }
                _ => Ok(()),
            };
        }
        let mut errors = Vec::new();
        if self.pid().is_some() {
            if let Err(e) = self.remove_all().await {
                errors.push(format!("remove pods via CRI: {e:#}"));
            }
        }
        match self.stop().await {
            Ok(Some(0)) | Ok(None) => {}
            Ok(Some(code)) => errors.push(format!("daemon exited with {code}")),
            Err(e) => errors.push(format!("stop daemon: {e:#}")),
        }
        if let Err(e) = self.host().cleanup().await {
            errors.push(format!("{e:#}"));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("teardown: {}", errors.join("; "))
        }
    }

    fn host(&self) -> Host {
        Host {
            run_base: self.run_base.clone(),
            lib_base: self.lib_base.clone(),
            bridge: self.bridge.clone(),
            namespace: self.namespace.clone(),
            containerd: self.containerd.clone(),
            ip_forward_before: self.ip_forward_before.clone(),
        }
    }
}

/// What one daemon put on the host, for cleanup with or without the daemon.
#[derive(Debug, Clone)]
struct Host {
    run_base: PathBuf,
    lib_base: PathBuf,
    bridge: String,
    namespace: String,
    containerd: PathBuf,
    ip_forward_before: Option<String>,
}

impl Host {
    async fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let sock = self.containerd.display().to_string();
        let mut full = vec!["--address", sock.as_str(), "-n", self.namespace.as_str()];
        full.extend_from_slice(args);
        run("ctr", &full).await
    }

    /// Mounts, bridge, nft table, ip_forward, containerd namespace, runc
    /// dirs, test dirs. Every step runs; errors are returned together.
    async fn cleanup(&self) -> anyhow::Result<()> {
        let mut errors = Vec::new();
        // Mounts the daemon left (the shared netns dir, anything leaked).
        let mut mounts = mounts_under(&[&self.run_base, &self.lib_base]);
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            if let Err(e) = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH) {
                errors.push(format!("umount {m}: {e}"));
            }
        }
        if Path::new("/sys/class/net").join(&self.bridge).exists() {
            if let Err(e) = run("ip", &["link", "del", &self.bridge]).await {
                errors.push(format!("{e:#}"));
            }
        }
        let table = format!("cubelet_{}", self.bridge);
        if run("nft", &["list", "table", "ip", &table]).await.is_ok() {
            if let Err(e) = run("nft", &["delete", "table", "ip", &table]).await {
                errors.push(format!("{e:#}"));
            }
        }
        if let Some(v) = &self.ip_forward_before {
            if let Err(e) = std::fs::write("/proc/sys/net/ipv4/ip_forward", v.trim()) {
                errors.push(format!("restore ip_forward: {e}"));
            }
        }
        if let Err(e) = self.clean_containerd().await {
            errors.push(format!("containerd namespace {}: {e:#}", self.namespace));
        }
        for root in [RUNC_ROOT, RUNC_ALT_ROOT] {
            // runc leaves an empty per-namespace dir behind.
            let _ = std::fs::remove_dir(Path::new(root).join(&self.namespace));
        }
        for d in [&self.run_base, &self.lib_base] {
            if let Err(e) = std::fs::remove_dir_all(d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    errors.push(format!("remove {}: {e}", d.display()));
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("host cleanup: {}", errors.join("; "))
        }
    }

    async fn clean_containerd(&self) -> anyhow::Result<()> {
        let list = |out: String| -> Vec<String> {
            out.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        };
        // Leftover tasks and containers (only after a failed test).
        for t in self
            .ctr(&["tasks", "ls", "-q"])
            .await
            .map(list)
            .unwrap_or_default()
        {
            let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", &t]).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let _ = self.ctr(&["tasks", "rm", "-f", &t]).await;
        }
        for c in self
            .ctr(&["containers", "ls", "-q"])
            .await
            .map(list)
            .unwrap_or_default()
        {
            let _ = self.ctr(&["containers", "rm", &c]).await;
        }
        let images = self.ctr(&["images", "ls", "-q"]).await.map(list)?;
        if !images.is_empty() {
            let mut args = vec!["images", "rm", "--sync"];
            args.extend(images.iter().map(String::as_str));
            self.ctr(&args).await?;
        }
        for l in self
            .ctr(&["leases", "ls", "-q"])
            .await
            .map(list)
            .unwrap_or_default()
        {
            let _ = self.ctr(&["leases", "rm", &l]).await;
        }
        // Snapshots: children before parents; repeat until stable.
        for _ in 0..20 {
            let snaps = snapshots(&self.ctr(&["snapshots", "ls"]).await?);
            if snaps.is_empty() {
                break;
            }
            for (key, _) in snaps {
                let _ = self.ctr(&["snapshots", "rm", &key]).await;
            }
        }
        for c in self
            .ctr(&["content", "ls", "-q"])
            .await
            .map(list)
            .unwrap_or_default()
        {
            let _ = self.ctr(&["content", "rm", &c]).await;
        }
        let sock = self.containerd.display().to_string();
        let mut last = None;
        for _ in 0..10 {
            match run(
                "ctr",
                &["--address", &sock, "namespaces", "rm", &self.namespace],
            )
            .await
            {
                Ok(_) => return Ok(()),
                Err(e) if format!("{e:#}").contains("not found") => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("namespace not removed")))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Never leave the daemon running when a test panics past teardown.
        if let Some(pid) = self.pid() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
    }
}

/// Spawns the daemon, appending its output to `log`.
fn spawn(
    bin: &Path,
    config: &Path,
    drop_ins: &Path,
    log: &Path,
) -> anyhow::Result<tokio::process::Child> {
    spawn_env(bin, config, drop_ins, log, &[])
}

/// Spawns the daemon with extra environment variables.
fn spawn_env(
    bin: &Path,
    config: &Path,
    drop_ins: &Path,
    log: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<tokio::process::Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(config)
        .arg("--config-dir")
        .arg(drop_ins)
        .env(
            "RUST_LOG",
            std::env::var("CUBELET_E2E_LOG").unwrap_or_else(|_| "info".into()),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))?;
    eprintln!(
        "e2e: started {} (pid {:?}), log {}",
        bin.display(),
        child.id(),
        log.display()
    );
    Ok(child)
}

/// A daemon being started: killed if start fails.
struct Partial {
    child: Option<tokio::process::Child>,
    log: PathBuf,
}

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(pid) = self.child.as_ref().and_then(|c| c.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

async fn wait_ready(p: &mut Partial, addr: SocketAddr, limit: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(child) = p.child.as_mut() {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "cubelet exited during startup ({status}); log tail:\n{}",
                    tail(&p.log, 30)
                );
            }
        }
        if http_status(addr, "/readyz").await.ok() == Some(200) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "cubelet not ready on http://{addr}/readyz within {limit:?}; log tail:\n{}",
                tail(&p.log, 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `GET path` on a plain HTTP/1.0 server; the status code.
pub async fn http_status(addr: SocketAddr, path: &str) -> anyhow::Result<u16> {
    Ok(http_get(addr, path).await?.0)
}

/// The value of the unlabelled metric `name` in the `/metrics` of the
/// admin endpoint at `addr`.
pub async fn metric(addr: SocketAddr, name: &str) -> anyhow::Result<f64> {
    let (_, body) = http_get(addr, "/metrics").await?;
    body.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {name} in /metrics"))
}

/// `GET path` on a plain HTTP/1.0 server; status code and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status line")?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        anyhow::Ok((code, body))
    };
    tokio::time::timeout(scaled(Duration::from_secs(3)), fut)
        .await
        .context("http timeout")?
}

/// How much slower than this host the tests' machine is:
/// `$CUBELET_E2E_TIME_SCALE` (1 to 20, default 1). An emulated guest (the
/// qemu rig, `hack/vm.sh`, runs about 4× slower) sets it so that the
/// tests' waits ([`eventually`], [`with_daemon`], HTTP timeouts) stretch
/// instead of failing on a slow machine.
pub fn time_scale() -> u32 {
    std::env::var("CUBELET_E2E_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(1, |v| v.clamp(1, 20))
}

/// `limit` stretched by [`time_scale`].
pub fn scaled(limit: Duration) -> Duration {
    limit * time_scale()
}

async fn terminate(
    child: &mut tokio::process::Child,
    grace: Duration,
) -> anyhow::Result<Option<i32>> {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => Ok(status?.code()),
        Err(_) => {
            child.kill().await?;
            bail!("daemon ignored SIGTERM for {grace:?}; killed")
        }
    }
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs a host command; stdout on success, an error with stderr otherwise.
pub async fn run(prog: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("run {prog}"))?;
    if !out.status.success() {
        bail!(
            "`{prog} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes containerd-style host configs: the local registry over plain HTTP,
/// and `registry.k8s.io`, `k8s.gcr.io` and `gcr.io` (the registries of
/// critest's images, stood in for by `hack/critest/images.py`) mirrored to it.
fn write_registry_config(dir: &Path) -> anyhow::Result<()> {
    let local = dir.join(REGISTRY);
    std::fs::create_dir_all(&local)?;
    std::fs::write(
        local.join("hosts.toml"),
        format!(
            "server = \"http://{REGISTRY}\"\n\n[host.\"http://{REGISTRY}\"]\n  \
             capabilities = [\"pull\", \"resolve\"]\n  skip_verify = true\n"
        ),
    )?;
    for upstream in ["registry.k8s.io", "k8s.gcr.io", "gcr.io"] {
        let mirror = dir.join(upstream);
        std::fs::create_dir_all(&mirror)?;
        std::fs::write(
            mirror.join("hosts.toml"),
            format!(
                "server = \"http://{REGISTRY}\"\n\n[host.\"http://{REGISTRY}\"]\n  \
                 capabilities = [\"pull\", \"resolve\"]\n"
            ),
        )?;
    }
    Ok(())
}

/// Parses `ctr snapshots ls` (KEY PARENT KIND) into (key, kind).
pub fn snapshots(listing: &str) -> Vec<(String, String)> {
    listing
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let key = cols.first()?;
            let kind = cols.last()?;
            Some(((*key).to_owned(), (*kind).to_owned()))
        })
        .collect()
}

/// Mount points at or under any of `dirs`, from /proc/self/mountinfo.
pub fn mounts_under(dirs: &[&Path]) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| dirs.iter().any(|d| Path::new(m).starts_with(d)))
        .map(str::to_owned)
        .collect()
}

fn dir_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Everything a clean daemon (no pods) must not have: one line per leak.
/// The parts of the warm-pool shells the daemon reports holding (its
/// netns, veth, sandbox directory with its shm, IPC/UTS pins) are the
/// daemon's by design and not leaks; they are asked for after everything
/// else is listed, as the daemon's own GC does, so a shell begun during
/// the audit is never counted as a leak.
pub async fn leaks(d: &Daemon) -> anyhow::Result<Vec<String>> {
    let out = leaks_with_shells(d).await?;
    let shells = d.shells().await?;
    Ok(out
        .into_iter()
        .filter(|line| !shells.iter().any(|id| is_shell_part(line, id)))
        .collect())
}

/// Whether leak line `line` names a part of shell `id`.
fn is_shell_part(line: &str, id: &str) -> bool {
    let veth: String = format!("{VETH_PREFIX}{}", &id[..id.len().min(11)]);
    // A shell's keeper (`pools.sandbox.shim`) is a containerd container,
    // task and snapshot with the shell's id.
    line.contains(&format!("/{id}"))
        || line.starts_with(&format!("veth {veth} "))
        || line.split_whitespace().any(|w| w == id)
}

/// [`leaks`] without the shells left out.
async fn leaks_with_shells(d: &Daemon) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut rt = d.runtime.clone();
    let pods = rt
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await?
        .into_inner();
    out.extend(
        pods.items
            .iter()
            .map(|p| format!("CRI pod sandbox {}", p.id)),
    );
    let cs = rt
        .list_containers(ListContainersRequest::default())
        .await?
        .into_inner();
    out.extend(
        cs.containers
            .iter()
            .map(|c| format!("CRI container {}", c.id)),
    );

    let containers = d.ctr(&["containers", "ls", "-q"]).await?;
    out.extend(
        containers
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|c| format!("containerd container {c}")),
    );
    let tasks = d.ctr(&["tasks", "ls", "-q"]).await?;
    out.extend(
        tasks
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|t| format!("containerd task {t}")),
    );
    for (key, kind) in snapshots(&d.ctr(&["snapshots", "ls"]).await?) {
        if kind != "Committed" {
            out.push(format!("containerd snapshot {key} ({kind})"));
        }
    }

    let netns = d.state_dir.join("netns");
    out.extend(
        dir_entries(&netns)
            .into_iter()
            .map(|n| format!("netns pin {}", netns.join(n).display())),
    );
    let userns = d.state_dir.join("userns");
    out.extend(
        dir_entries(&userns)
            .into_iter()
            .map(|n| format!("userns pin {}", userns.join(n).display())),
    );
    let staged = d.state_dir.join("runtime").join("staged");
    out.extend(
        dir_entries(&staged)
            .into_iter()
            .map(|n| format!("staged mounts of {}", staged.join(n).display())),
    );
    let podns = d.podns_dir();
    out.extend(
        dir_entries(&podns)
            .into_iter()
            .map(|n| format!("pod namespace pins {}", podns.join(n).display())),
    );
    let task_dir = format!("/io.containerd.runtime.v2.task/{}/", d.namespace);
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for m in info.lines().filter_map(|l| l.split(' ').nth(4)) {
        let under = [&d.root_dir, &d.state_dir, &d.lib_base]
            .iter()
            .any(|p| Path::new(m).starts_with(p));
        // The pin dirs themselves are shared bind mounts kept for the
        // daemon's life.
        let pin_dir = Path::new(m) == netns || Path::new(m) == userns || Path::new(m) == podns;
        if (under && !pin_dir) || m.contains(&task_dir) {
            out.push(format!("mount {m}"));
        }
    }
    let brif = Path::new("/sys/class/net").join(&d.bridge).join("brif");
    out.extend(
        dir_entries(&brif)
            .into_iter()
            .filter(|n| n.starts_with(VETH_PREFIX))
            .map(|n| format!("veth {n} on {}", d.bridge)),
    );
    let sandboxes = d.root_dir.join("sandboxes");
    out.extend(
        dir_entries(&sandboxes)
            .into_iter()
            .map(|s| format!("sandbox dir {}", sandboxes.join(s).display())),
    );
    // Shims of the daemon's namespace that containerd has no task for. A
    // shim exits a moment after its task is deleted, so give it that moment.
    let mut orphans = Vec::new();
    for _ in 0..20 {
        let tasks = d.ctr(&["tasks", "ls", "-q"]).await?;
        orphans = shims(&d.namespace)
            .into_iter()
            .filter(|(_, id)| !tasks.lines().any(|t| t.trim() == id))
            .collect();
        if orphans.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    out.extend(
        orphans
            .into_iter()
            .map(|(pid, id)| format!("shim process {pid} (-id {id}) without a task")),
    );
    Ok(out)
}

/// The resident set of process `pid` (`VmRSS` of `/proc/<pid>/status`), KiB.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS in /proc/<pid>/status")
}

/// User plus system CPU seconds process `pid` has used (`utime` and
/// `stime` of `/proc/<pid>/stat`, in USER_HZ, which is 100 on Linux).
pub fn cpu_secs(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command's closing parenthesis; utime and stime
    // are the 12th and 13th of them (14th and 15th of the line).
    let rest = stat.rsplit_once(')').context("/proc/<pid>/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks =
        f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?;
    Ok(ticks as f64 / 100.0)
}

/// `(pid, -id)` of the containerd shims running for `namespace`, found by
/// their command line in `/proc`.
pub fn shims(namespace: &str) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let name = args.first()?.rsplit('/').next()?.to_owned();
            if !name.starts_with("containerd-shim") {
                return None;
            }
            let value = |flag: &str| {
                args.iter()
                    .position(|a| a == flag)
                    .and_then(|i| args.get(i + 1))
                    .cloned()
            };
            (value("-namespace")? == namespace).then_some((pid, value("-id")?))
        })
        .collect()
}

/// The future of one scenario of a custom-runner test.
pub type ScenarioFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send + 'a>>;

/// A named scenario of a custom-runner test, with its time limit in seconds.
pub type Scenario = (
    &'static str,
    u64,
    for<'a> fn(&'a Daemon) -> ScenarioFuture<'a>,
);

/// `main` of a custom-runner (`harness = false`) test: runs the scenarios
/// whose names contain a command-line filter (all without one) in order
/// against one daemon started with `opts`; after each, removes every pod
/// through CRI and audits leaks; tears the daemon down at the end. Prints
/// libtest-like lines (`--list` lists), `SKIP:` without the private
/// containerd.
pub fn scenario_main(opts: DaemonOpts, scenarios: Vec<Scenario>) -> std::process::ExitCode {
    use std::process::ExitCode;
    let mut filters = Vec::new();
    let mut list = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--list" => list = true,
            "--test-threads" | "--skip" | "--format" | "--color" | "-Z" | "--logfile" => {
                args.next();
            }
            s if s.starts_with('-') => {}
            s => filters.push(s.to_owned()),
        }
    }
    let selected: Vec<Scenario> = scenarios
        .into_iter()
        .filter(|(n, _, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    if list {
        for (n, _, _) in &selected {
            println!("{n}: test");
        }
        return ExitCode::SUCCESS;
    }
    if let Some(reason) = skip_reason() {
        for (n, _, _) in &selected {
            println!("SKIP: {n}: {reason}");
        }
        println!(
            "\ntest result: ok. 0 passed; 0 failed; {} skipped",
            selected.len()
        );
        return ExitCode::SUCCESS;
    }
    if selected.is_empty() {
        println!("test result: ok. 0 passed; 0 failed (no scenario matches)");
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if rt.block_on(run_scenarios(opts, selected)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn run_scenarios(opts: DaemonOpts, selected: Vec<Scenario>) -> bool {
    use futures::FutureExt;
    let daemon = match Daemon::start(opts).await {
        Ok(d) => d,
        Err(e) => {
            println!("e2e: daemon did not start: {e:#}");
            return false;
        }
    };
    println!(
        "running {} scenarios against {}",
        selected.len(),
        daemon.socket.display()
    );
    let (mut passed, mut failed) = (0, Vec::new());
    for (name, secs, f) in selected {
        let body = std::panic::AssertUnwindSafe(f(&daemon)).catch_unwind();
        let result = match tokio::time::timeout(Duration::from_secs(secs), body).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(format!("{e:#}")),
            Ok(Err(panic)) => Err(panic_text(&panic)),
            Err(_) => Err(format!("timed out after {secs} s")),
        };
        // Cleanup always runs, then the audit is part of the verdict.
        let cleanup = tokio::time::timeout(Duration::from_secs(60), daemon.remove_all()).await;
        let audit = match cleanup {
            Ok(Ok(())) => std::panic::AssertUnwindSafe(assert_clean(&daemon))
                .catch_unwind()
                .await
                .map_err(|p| format!("leak audit: {}", panic_text(&p))),
            Ok(Err(e)) => Err(format!("cleanup via CRI failed: {e:#}")),
            Err(_) => Err("cleanup via CRI timed out".to_owned()),
        };
        match (result, audit) {
            (Ok(()), Ok(())) => {
                passed += 1;
                println!("test {name} ... ok");
            }
            (r, a) => {
                let why = [r.err(), a.err()].into_iter().flatten().collect::<Vec<_>>();
                println!("test {name} ... FAILED\n  {}", why.join("\n  then: "));
                failed.push(name);
            }
        }
    }
    if !failed.is_empty() {
        println!("--- daemon log tail ---\n{}\n---", daemon.log_tail(40));
    }
    let teardown = daemon.teardown().await;
    if let Err(e) = &teardown {
        println!("e2e: {e:#}");
    }
    let ok = failed.is_empty() && teardown.is_ok();
    println!(
        "\ntest result: {}. {passed} passed; {} failed{}",
        if ok { "ok" } else { "FAILED" },
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(" ({})", failed.join(", "))
        }
    );
    ok
}

/// The message of a caught panic.
fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panic".to_owned())
}

/// The `p`th percentile (nearest rank) of `sorted`; zero when empty.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `d` in milliseconds with one decimal, for the benches' tables.
pub fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// Polls `check` every 200 ms until it returns true; an error naming
/// `what` once `limit` has passed.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let start = std::time::Instant::now();
    let limit = scaled(limit);
    loop {
        if check().await? {
            return Ok(());
        }
        if start.elapsed() >= limit {
            bail!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs `scenario` against a daemon started with `opts`, for at most
/// `limit`; then audits leaks (see [`leaks`]) and tears the daemon down.
/// Panics with the daemon's log tail and then the failure if the scenario fails,
/// leaks or the teardown fails. Prints `SKIP:` and returns when the private
/// containerd is not there.
pub async fn with_daemon<F>(opts: DaemonOpts, limit: Duration, scenario: F)
where
    F: for<'a> FnOnce(&'a Daemon) -> futures::future::BoxFuture<'a, anyhow::Result<()>>,
{
    if let Some(reason) = skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let d = match Daemon::start(opts).await {
        Ok(d) => d,
        Err(e) => panic!("start daemon: {e:#}"),
    };
    let result = tokio::time::timeout(scaled(limit), scenario(&d))
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("scenario timed out after {limit:?}")));
    let result = match result {
        Ok(()) => match leaks(&d).await {
            Ok(l) if l.is_empty() => Ok(()),
            Ok(l) => Err(anyhow::anyhow!("leaked:\n  {}", l.join("\n  "))),
            Err(e) => Err(e.context("leak audit")),
        },
        Err(e) => Err(e),
    };
    let log = d.log_tail(60);
    let torn = d.teardown().await;
    if let Err(e) = result {
        // The failure last: CI keeps the tail of a run's output.
        panic!("daemon log tail:\n{log}\n--- failure ---\n{e:#}");
    }
    if let Err(e) = torn {
        panic!("teardown: {e:#}");
    }
}

/// Panics listing every leak [`leaks`] finds (test helper).
pub async fn assert_clean(d: &Daemon) {
    match leaks(d).await {
        Ok(l) if l.is_empty() => {}
        Ok(l) => panic!("leaked after cleanup:\n  {}", l.join("\n  ")),
        Err(e) => panic!("leak audit failed: {e:#}"),
    }
}

/// A `sh` that reads commands from a stdin it gets once (`stdin_once`), as
/// critest's attach spec runs.
pub fn stdin_once_shell(image: &str) -> ContainerConfig {
    let mut cfg = container_config("shell", image, &["sh"]);
    cfg.stdin = true;
    cfg.stdin_once = true;
    cfg
}

/// A pod config with metadata, labels and a log directory.
pub fn pod_config(name: &str, uid: &str, log_directory: &Path) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.to_owned(),
            uid: uid.to_owned(),
            namespace: "e2e".to_owned(),
            attempt: 0,
        }),
        hostname: name.chars().take(63).collect(),
        log_directory: log_directory.display().to_string(),
        labels: [("app".to_owned(), name.to_owned())].into_iter().collect(),
        ..Default::default()
    }
}

/// `cfg` with the namespaces kubelet asks for a pod that does not share
/// its process namespace: the pod's network and IPC, a PID namespace per
/// container (CRI's zero value is a pod-level one). In the daemon's default
/// `runtime.sandbox: auto` such a pod gets no infra container.
pub fn pid_per_container(mut cfg: PodSandboxConfig) -> PodSandboxConfig {
    let linux = cfg.linux.get_or_insert_with(Default::default);
    let sc = linux.security_context.get_or_insert_with(Default::default);
    sc.namespace_options = Some(cri::NamespaceOption {
        network: cri::NamespaceMode::Pod as i32,
        pid: cri::NamespaceMode::Container as i32,
        ipc: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    });
    cfg
}

/// A container config running `command` from `image`, logging to `<name>.log`.
pub fn container_config(name: &str, image: &str, command: &[&str]) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        }),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

/// An image spec for `image`.
pub fn image_spec(image: &str) -> ImageSpec {
    ImageSpec {
        image: image.to_owned(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_snapshot_listing() {
        let l = "KEY                    PARENT   KIND\nsha256:aa               Committed\nabc  sha256:aa  Active\n";
        assert_eq!(
            snapshots(l),
            vec![
                ("sha256:aa".to_owned(), "Committed".to_owned()),
                ("abc".to_owned(), "Active".to_owned())
            ]
        );
    }

    #[test]
    fn registry_config_marks_local_registry_plain_http() {
        let dir = tempfile::tempdir().unwrap();
        write_registry_config(dir.path()).unwrap();
        let local = std::fs::read_to_string(dir.path().join(REGISTRY).join("hosts.toml")).unwrap();
        assert!(
            local.contains("server = \"http://127.0.0.1:5000\""),
            "{local}"
        );
        let k8s = std::fs::read_to_string(dir.path().join("registry.k8s.io/hosts.toml")).unwrap();
        assert!(k8s.contains("[host.\"http://127.0.0.1:5000\"]"), "{k8s}");
    }
}
