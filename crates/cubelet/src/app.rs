//! Wiring: the only place that names concrete providers. Builds the store,
//! metrics, containerd clients, providers and engine from the config,
//! reconciles after a restart, then serves until a signal arrives.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cubelet_cri::{Cri, CriDeps};
use cubelet_engine::{EngineBuilder, EngineOptions, Flow};
use cubelet_metrics::{AdminServer, Metrics, Readiness};
use cubelet_pod::{PodDeps, PodService};
use cubelet_runtime::container::{ContainerRuntime, HandlerConfig, RuntimeConfig};
use cubelet_runtime::events::{ContainerEventKind, EventMonitor};
use cubelet_runtime::image::{DirectContent, ImageService};
use cubelet_runtime::sandbox::anchor::StatsAnchor;
use cubelet_runtime::sandbox::podns::PodNamespaces;
use cubelet_runtime::sandbox::{PauseImage, SandboxMode, SandboxProvider};
use cubelet_runtime::stats::cgroups::{CgroupSupport, CgroupVersion};
use cubelet_runtime::Containerd;
use cubelet_storage::{LocalStorage, ScratchConfig, StorageConfig};
use cubelet_store::{SandboxState, Store};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::adapters::{Conditions, CriMetrics};
use crate::config::{CgroupDriver, Config};
use crate::failpoint::Failpoints;
use crate::gc::Gc;
use crate::network::PodNetwork;

/// Provider names the flows may use.
pub const PROVIDERS: [&str; 3] = ["storage", "network", "sandbox"];

/// How long shutdown waits for in-flight requests: with the second the
/// async runtime then gets (`main`), SIGTERM stops the agent within 10 s
/// whatever it is doing.
const GRACE: Duration = Duration::from_secs(8);

/// Everything the running agent holds.
pub(crate) struct Parts {
    pub(crate) config: Config,
    pub(crate) store: Arc<Store>,
    pub(crate) metrics: Metrics,
    pub(crate) pods: PodService,
    pub(crate) network: PodNetwork,
    pub(crate) storage: Arc<LocalStorage>,
    pub(crate) runtime: Arc<ContainerRuntime>,
    /// Pinned namespaces of sandboxes without an infra process.
    pub(crate) podns: PodNamespaces,
}

/// Connects to containerd, trying `containerd.connect_attempts` times: each
/// failed try is logged at once at WARN with the address and the cause in
/// one line, the last one's cause ends start-up.
async fn connect_containerd(config: &Config, readiness: &Readiness) -> Result<Containerd> {
    let address = &config.containerd.address;
    let attempts = config.containerd.connect_attempts.max(1);
    let mut delay = Duration::from_millis(100);
    let mut attempt = 1;
    loop {
        let cause = match crate::check::containerd_version(
            address,
            &config.containerd.namespace,
            crate::check::CONTAINERD_TIMEOUT,
        )
        .await
        {
            Ok((cd, version)) => {
                info!(address = %address.display(), %version, "connected to containerd");
                return Ok(cd);
            }
            Err(cause) => cause,
        };
        if attempt >= attempts {
            bail!(
                "containerd at {} does not answer after {attempts} attempts: {cause}",
                address.display()
            );
        }
        warn!(
            "containerd at {} does not answer (attempt {attempt} of {attempts}, next in {delay:?}): {cause}",
            address.display()
        );
        readiness.set_not_ready(format!(
            "containerd at {} does not answer: {cause}",
            address.display()
        ));
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(2));
        attempt += 1;
    }
}

fn pause_binary(config: &Config) -> Result<PathBuf> {
    if !config.images.pause_binary.as_os_str().is_empty() {
        return Ok(config.images.pause_binary.clone());
    }
    let exe = std::env::current_exe().context("locate the cubelet executable")?;
    Ok(exe.with_file_name("cubelet-pause"))
}

/// The cgroup driver `requested` (`runtime.cgroup_driver`) comes to on a
/// node whose init is systemd or not, with cgroup hierarchy `version`
/// (`None`: unknown, which `auto` takes for cgroupfs).
fn resolve_cgroup_driver(
    requested: CgroupDriver,
    systemd_booted: bool,
    version: Option<CgroupVersion>,
) -> cubelet_runtime::cgroup::CgroupDriver {
    use cubelet_runtime::cgroup::{auto_driver, CgroupDriver as Effective};
    match requested {
        CgroupDriver::Cgroupfs => Effective::Cgroupfs,
        CgroupDriver::Systemd => Effective::Systemd,
        CgroupDriver::Auto => {
            version.map_or(Effective::Cgroupfs, |v| auto_driver(systemd_booted, v))
        }
    }
}

/// The cgroup driver in effect: `runtime.cgroup_driver`, with `auto`
/// decided from this node (`/run/systemd/system`, the file system type of
/// `/sys/fs/cgroup`), logged with what it was decided from.
fn effective_cgroup_driver(
    requested: CgroupDriver,
) -> Result<cubelet_runtime::cgroup::CgroupDriver> {
    use cubelet_runtime::cgroup::{detect_version, systemd_booted, CGROUP_ROOT, SYSTEMD_RUN_DIR};
    let systemd = systemd_booted(std::path::Path::new(SYSTEMD_RUN_DIR));
    let version = match detect_version(std::path::Path::new(CGROUP_ROOT)) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(error = %e, "cgroup hierarchy unknown");
            None
        }
    };
    let driver = resolve_cgroup_driver(requested, systemd, version);
    info!(
        requested = requested.as_str(),
        driver = driver.as_str(),
        systemd_init = systemd,
        hierarchy = ?version,
        "cgroup driver"
    );
    if driver == cubelet_runtime::cgroup::CgroupDriver::Systemd && !systemd {
        tracing::warn!(
            "runtime.cgroup_driver is systemd but systemd is not the init system \
             ({SYSTEMD_RUN_DIR} is missing): runc will fail to create containers"
        );
    }
    Ok(driver)
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(config: Config) -> Result<()> {
    // Before anything is bound or made: a bad failpoint list, or one given
    // to a build without the hook, stops startup here.
    let failpoints = Failpoints::from_env().map_err(anyhow::Error::msg)?;
    let shutdown = CancellationToken::new();
    for dir in [&config.root_dir, &config.state_dir] {
        ensure_agent_dir(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    // Before the database or anything else is touched: a second Cubelet on
    // the same state_dir names the first instead of failing on a lock.
    let _pid_lock = crate::pidfile::PidLock::acquire(&config.state_dir)?;

    let store = Arc::new(Store::open(&config.root_dir.join("cubelet.redb"))?);
    let registry = prometheus::Registry::new();
    let metrics = Metrics::new(&registry, env!("CARGO_PKG_VERSION"))?;
    let readiness = Readiness::new();
    let admin = AdminServer::bind(config.metrics.address, registry.clone(), readiness.clone())?;
    info!(address = %admin.local_addr(), "admin endpoint (/metrics /healthz /readyz)");
    let admin_task = tokio::spawn(admin.serve(shutdown.clone()).in_current_span());

    let cd = connect_containerd(&config, &readiness).await?;
    let mut image_service = ImageService::new(cd.clone(), &config.images.registry_config_dir)
        .with_pull_progress_timeout(config.images.pull_progress_timeout)
        .with_max_concurrent_downloads(config.images.max_concurrent_downloads)
        .with_pull_observer(Arc::new(crate::adapters::PullMetrics(metrics.clone())));
    if config.images.direct_content_write {
        let content_root = config
            .containerd
            .root
            .join("io.containerd.content.v1.content");
        if let Some(direct) = DirectContent::open(&content_root, &config.root_dir.join("ingest")) {
            image_service = image_service.with_direct_content(Arc::new(direct)).await;
        }
    }
    let images = Arc::new(image_service);
    let pause = Arc::new(PauseImage::configured(
        (*images).clone(),
        &config.images.pause_image,
        pause_binary(&config)?,
    ));
    let runtime_state = config.state_dir.join("runtime");
    ensure_agent_dir(&runtime_state)
        .with_context(|| format!("create {}", runtime_state.display()))?;
    let mut rt_config = RuntimeConfig::new(runtime_state);
    rt_config.task_at_create = config.runtime.task_at_create;
    rt_config.log_rate_limit = config.runtime.log_rate()?;
    rt_config.handlers = config
        .runtime
        .handlers
        .iter()
        .map(|(name, h)| {
            let handler = HandlerConfig {
                runtime_type: h.runtime_type.clone(),
                binary: h.binary.clone(),
                root: h.root.clone(),
            };
            (name.clone(), handler)
        })
        .collect();
    rt_config.default_handler = config.runtime.default_handler.clone();
    rt_config.restrict_oom_score_adj = config.runtime.restrict_oom_score_adj;
    let cgroups = CgroupSupport::detect(config.runtime.tolerate_missing_hugetlb_controller)
        .context("detect the node's cgroup controllers")?;
    tracing::info!(
        version = ?cgroups.version(),
        controllers = ?cgroups.report().controllers,
        "cgroup controllers for containers"
    );
    rt_config.cgroup_driver = effective_cgroup_driver(config.runtime.cgroup_driver)?;
    let cgroup_driver = rt_config.cgroup_driver;
    let runtime = Arc::new(ContainerRuntime::with_cgroups(
        cd.clone(),
        rt_config,
        Arc::new(cgroups),
    ));

    let storage = Arc::new(LocalStorage::new(StorageConfig {
        root_dir: config.root_dir.clone(),
        shm_size: config.storage.shm_size.0,
        host_resolv_conf: "/etc/resolv.conf".into(),
        scratch: config.storage.scratch.enabled.then(|| ScratchConfig {
            pool_dir: config.root_dir.join("scratch-pool"),
            pool_size: config.storage.scratch.pool_size,
            image_size: config.storage.scratch.size.0,
        }),
    }));
    let network = PodNetwork::build(&config, &store)?;
    let podns = PodNamespaces::new(config.state_dir.join("podns"));
    let sandbox_mode = match config.runtime.sandbox {
        crate::config::SandboxMode::Auto => SandboxMode::Auto,
        crate::config::SandboxMode::Pause => SandboxMode::Pause,
    };
    let sandbox = Arc::new(
        SandboxProvider::new(Arc::clone(&runtime), pause.clone())
            .with_pinned_namespaces(podns.clone(), sandbox_mode)
            .with_shell_shims(config.pools.sandbox.shim && config.pools.sandbox.size > 0),
    );

    let engine = EngineBuilder::new()
        .provider(
            "storage",
            failpoints.wrap("storage", Arc::clone(&storage) as Arc<dyn Flow>),
        )
        .provider("network", failpoints.wrap("network", network.flow()))
        .provider(
            "sandbox",
            failpoints.wrap("sandbox", sandbox as Arc<dyn Flow>),
        )
        .journal(store.clone())
        .observer(metrics.observer())
        .options(EngineOptions {
            rollback_timeout: config.engine.rollback_timeout,
            rollback_concurrency: config.engine.rollback_concurrency,
        })
        .build(&config.flows)?;

    readiness.set_not_ready("initialising providers");
    engine.init().await.context("initialise providers")?;
    let conditions = Arc::new(Conditions {
        readiness: readiness.clone(),
        network: network.clone(),
        handlers: config.runtime.handlers.clone(),
    });
    let pause_ref = {
        use cubelet_runtime::sandbox::PauseImageSource;
        let info = pause
            .pause_image()
            .await
            .context("prepare the pod infra image")?;
        info!(image = %pause.reference(), id = %info.id, "pod infra image ready");
        pause.reference()
    };

    let mut status_info = HashMap::new();
    status_info.insert(
        "config".to_owned(),
        serde_json::to_string(&config).unwrap_or_default(),
    );
    // The driver in effect (the config may say `auto`), as a JSON string.
    status_info.insert(
        "cgroupDriver".to_owned(),
        serde_json::to_string(cgroup_driver.as_str()).unwrap_or_default(),
    );
    let streaming = cubelet_streaming::StreamingServer::bind(&cubelet_streaming::StreamingConfig {
        address: config.streaming.address,
        port: config.streaming.port,
        idle_timeout: config.streaming.idle_timeout,
        tls: config.streaming.tls()?,
        limits: config.streaming.limits()?,
    })
    .await
    .context("bind the streaming server")?;
    info!(addr = %streaming.local_addr(), "streaming server bound");
    let pods = PodService::with_pool(
        PodDeps {
            engine: engine.clone(),
            store: Arc::clone(&store),
            runtime: Arc::new({
                let containerd = cubelet_pod::Containerd::new(
                    Arc::clone(&runtime),
                    Arc::clone(&images),
                    Arc::new(crate::adapters::NetnsCounters),
                );
                if config.runtime.stats_anchor {
                    containerd.with_stats_anchor(
                        StatsAnchor::new(Arc::clone(&runtime), pause.clone()),
                        Arc::new(crate::adapters::AnchorMetrics(metrics.clone())),
                    )
                } else {
                    containerd
                }
            }),
            shutdown: shutdown.clone(),
        },
        cubelet_pod::PoolConfig {
            size: config.pools.sandbox.size,
        },
        Arc::new(crate::adapters::PoolMetrics(metrics.clone())),
    );
    let cri = Cri::new(CriDeps {
        pods: pods.clone(),
        runtime: Arc::clone(&runtime),
        images,
        conditions: conditions.clone(),
        observer: Arc::new(CriMetrics(metrics.clone())),
        // The driver in effect (`auto` resolved), as kubelet must match it.
        cgroup_driver: match cgroup_driver {
            cubelet_runtime::cgroup::CgroupDriver::Cgroupfs => {
                cubelet_cri_api::v1::CgroupDriver::Cgroupfs
            }
            cubelet_runtime::cgroup::CgroupDriver::Systemd => {
                cubelet_cri_api::v1::CgroupDriver::Systemd
            }
        },
        pause_image: pause_ref,
        image_fs: (
            config
                .containerd
                .root
                .join("io.containerd.snapshotter.v1.overlayfs"),
            config
                .containerd
                .root
                .join("io.containerd.content.v1.content"),
        ),
        status_info,
        streaming: Some(streaming.clone()),
    });

    let parts = Arc::new(Parts {
        config: config.clone(),
        store: Arc::clone(&store),
        metrics: metrics.clone(),
        pods,
        network,
        storage,
        runtime: Arc::clone(&runtime),
        podns,
    });

    // Events first, so no exit is missed between reconciliation and serving.
    let monitor = EventMonitor::spawn(cd.clone(), 1024);
    let events_task =
        tokio::spawn(event_loop(Arc::clone(&parts), monitor, shutdown.clone()).in_current_span());

    readiness.set_not_ready("reconciling");
    reconcile(&parts).await?;
    // Both sockets are bound before the agent says it is ready, so a client
    // that saw `/readyz` (or READY=1) never finds no socket; served below.
    let cri_socket = cubelet_cri::CriSocket::bind(&config.socket)
        .with_context(|| format!("bind the CRI socket {}", config.socket.display()))?;
    let admin_socket = config.state_dir.join(crate::admin::SOCKET_NAME);
    let admin_listener = crate::admin::bind(&admin_socket)?;
    readiness.set_ready();
    info!("reconciliation done; ready");
    crate::notify::notify_systemd("READY=1");
    let watchdog_task = crate::notify::spawn_watchdog(readiness.clone(), shutdown.clone());

    let usage_task = tokio::spawn(
        Arc::clone(&runtime)
            .refresh_snapshot_usage_every(
                cubelet_runtime::stats::SNAPSHOT_USAGE_PERIOD,
                shutdown.clone(),
            )
            .in_current_span(),
    );

    let gc = Arc::new(Gc::new(Arc::clone(&parts)));
    let gc_task = tokio::spawn(Arc::clone(&gc).run(shutdown.clone()).in_current_span());

    let admin_service = crate::admin::AdminService::new(engine.clone(), Arc::clone(&store), gc);
    let admin_api_task = tokio::spawn(
        crate::admin::serve(
            admin_listener,
            admin_socket.clone(),
            admin_service,
            shutdown.clone(),
        )
        .in_current_span(),
    );
    info!(socket = %admin_socket.display(), "serving the admin api (cubelet ctl)");

    let cri_task = tokio::spawn(
        cubelet_cri::serve_unix(
            cri_socket,
            cri,
            cubelet_cri::transport::TransportOptions {
                rewrite_invalid_authority: config.cri.rewrite_invalid_authority,
            },
            shutdown.clone(),
        )
        .in_current_span(),
    );
    info!(socket = %config.socket.display(), "serving CRI");
    let streaming_task = {
        let backend = Arc::new(crate::adapters::RuntimeStreams(Arc::clone(&runtime)));
        let shutdown = shutdown.clone();
        tokio::spawn(async move { streaming.serve(backend, shutdown).await }.in_current_span())
    };

    // Last: after reconciliation (which destroys the last run's shells) and
    // once every server is under way, so refilling never competes with the
    // startup a client waits for.
    parts.pods.start_pool();

    wait_for_signal(&shutdown).await?;
    info!("shutting down");
    readiness.set_not_ready("shutting down");
    shutdown.cancel();
    let drained = tokio::time::timeout(GRACE, async {
        let _ = cri_task.await;
        // Containers RemoveContainer forgot leave containerd before exit.
        parts.pods.drain_removals().await;
        // Ready shells are destroyed, not kept for the next start (which
        // would destroy them anyway: see the pod crate's `pool`).
        parts.pods.close_pool().await;
        engine.drain().await;
        let _ = streaming_task.await;
        let _ = gc_task.await;
        let _ = usage_task.await;
        let _ = events_task.await;
        let _ = admin_task.await;
        let _ = admin_api_task.await;
        if let Some(t) = watchdog_task {
            let _ = t.await;
        }
    })
    .await;
    if drained.is_err() {
        warn!("shutdown grace period of {GRACE:?} elapsed");
    }
    Ok(())
}

/// Mode of `root_dir` and `state_dir`, as containerd's root and state:
/// only root lists or writes them; others may only traverse them (a pod in
/// its own user namespace reaches its sandbox files through them).
pub(crate) const AGENT_DIR_MODE: u32 = 0o711;

/// Creates `dir` (and its parents) with [`AGENT_DIR_MODE`], and tightens
/// the mode of one an older version made wider (0755).
pub(crate) fn ensure_agent_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(AGENT_DIR_MODE)
        .create(dir)?;
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode & !AGENT_DIR_MODE != 0 {
        info!(dir = %dir.display(), from = format!("{mode:o}"), to = format!("{AGENT_DIR_MODE:o}"), "tightening the mode of an agent directory");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & AGENT_DIR_MODE))?;
    }
    Ok(())
}

async fn wait_for_signal(shutdown: &CancellationToken) -> Result<()> {
    let mut term = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("install SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        () = shutdown.cancelled() => {}
    }
    Ok(())
}

/// Settles interrupted flows, then brings the store in line with containerd
/// (the pod service does both).
async fn reconcile(parts: &Parts) -> Result<()> {
    let report = parts
        .pods
        .reconcile()
        .await
        .context("reconcile with containerd")?;
    info!(
        settled = report.settled.len(),
        failed = report.failed.len(),
        abandoned = report.abandoned,
        not_ready = report.not_ready,
        reattached = report.reattached,
        lost = report.lost,
        shims_reaped = report.shims_reaped,
        shells_destroyed = report.shells_destroyed,
        "reconciled"
    );
    parts.metrics_sandboxes();
    Ok(())
}

impl Parts {
    /// Updates the `cubelet_sandboxes{state}` gauge from the store.
    pub(crate) fn metrics_sandboxes(&self) {
        let Ok(all) = self.store.list_sandboxes() else {
            return;
        };
        for state in [
            SandboxState::Creating,
            SandboxState::Ready,
            SandboxState::NotReady,
            SandboxState::NeedsCleanup,
        ] {
            let n = all.iter().filter(|r| r.state == state).count();
            self.metrics
                .set_sandboxes(state.as_str(), i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}

/// Asks the pod service, on a task of its own, for the exits that events
/// lost (after a resubscription or a lag) would have brought.
fn resync(parts: &Arc<Parts>) {
    let parts = Arc::clone(parts);
    tokio::spawn(
        async move {
            let applied = parts.pods.resync_exits().await;
            info!(applied, "container events resynced");
        }
        .in_current_span(),
    );
}

/// Applies containerd's exit/OOM events through the pod service.
async fn event_loop(parts: Arc<Parts>, monitor: EventMonitor, shutdown: CancellationToken) {
    let mut rx = monitor.subscribe();
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            e = rx.recv() => e,
        };
        match event {
            Ok(ev) if ev.kind == ContainerEventKind::Reconnected => resync(&parts),
            Ok(ev) => parts.pods.apply_event(&ev),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                error!(missed = n, "container events lagged");
                resync(&parts);
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn auto_resolves_to_systemd_only_on_systemd_with_cgroup_v2() {
        use cubelet_runtime::cgroup::CgroupDriver as E;
        let v2 = Some(CgroupVersion::V2);
        let hybrid = Some(CgroupVersion::Hybrid);
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Auto, true, v2),
            E::Systemd
        );
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Auto, false, v2),
            E::Cgroupfs
        );
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Auto, true, hybrid),
            E::Cgroupfs
        );
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Auto, true, None),
            E::Cgroupfs
        );
        // An explicit choice is kept whatever the node.
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Systemd, false, hybrid),
            E::Systemd
        );
        assert_eq!(
            resolve_cgroup_driver(CgroupDriver::Cgroupfs, true, v2),
            E::Cgroupfs
        );
    }

    /// `root_dir` and `state_dir` were 0755 (anyone listed every sandbox
    /// and pin); they are made 0711 as containerd's root and state, and an
    /// existing 0755 one is tightened at start-up.
    #[test]
    fn agent_dirs_are_made_and_tightened_to_0711() {
        let tmp = tempfile::tempdir().unwrap();
        let mode =
            |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let fresh = tmp.path().join("a/b");
        ensure_agent_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o711);
        let old = tmp.path().join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_agent_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o711);
        // Narrower is left narrower.
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o700)).unwrap();
        ensure_agent_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
    }
}
