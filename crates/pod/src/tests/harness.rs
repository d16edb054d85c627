//! The rig every lifecycle test runs on.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use cubelet_engine::fake::FakeFlow;
use cubelet_engine::{EngineBuilder, FlowConfig, SandboxId, SandboxSpec, WorkflowConfig};
use cubelet_runtime::types::ImageInfo;
use cubelet_store::Store;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::fake::FakeRuntime;
use crate::{ContainerRequest, PodDeps, PodEvent, PodEventKind, PodService};

pub(super) const PROVIDERS: [&str; 3] = ["storage", "network", "sandbox"];

pub(super) struct Rig {
    pub(super) pods: PodService,
    pub(super) runtime: FakeRuntime,
    pub(super) store: Arc<Store>,
    pub(super) fakes: HashMap<&'static str, Arc<FakeFlow>>,
    pub(super) shutdown: CancellationToken,
    _dir: tempfile::TempDir,
}

fn workflows(create_limit: i64, cleanup_limit: i64) -> WorkflowConfig {
    let names = |s: &[&str]| s.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut flows = BTreeMap::new();
    flows.insert(
        "create".into(),
        FlowConfig {
            concurrent: create_limit,
            steps: vec![names(&["storage", "network"]), names(&["sandbox"])],
            admission_wait: std::time::Duration::ZERO,
        },
    );
    flows.insert(
        "destroy".into(),
        FlowConfig {
            concurrent: 32,
            steps: vec![names(&["sandbox"]), names(&["storage", "network"])],
            admission_wait: std::time::Duration::ZERO,
        },
    );
    flows.insert(
        "cleanup".into(),
        FlowConfig {
            concurrent: cleanup_limit,
            steps: vec![names(&PROVIDERS)],
            admission_wait: std::time::Duration::ZERO,
        },
    );
    WorkflowConfig { flows }
}

/// The image every test container uses.
pub(super) fn busybox() -> ImageInfo {
    ImageInfo {
        id: "sha256:1111".into(),
        repo_tags: vec!["127.0.0.1:5000/busybox:latest".into()],
        repo_digests: vec!["127.0.0.1:5000/busybox@sha256:2222".into()],
        chain_id: "sha256:3333".into(),
        ..Default::default()
    }
}

impl Rig {
    pub(super) fn new() -> Rig {
        Rig::with_limits(16, 4)
    }

    pub(super) fn with_limits(create: i64, cleanup: i64) -> Rig {
        Rig::build(create, cleanup, 0, Arc::new(crate::NoopPoolObserver))
    }

    /// A rig whose service keeps `size` warm-pool shells (filled once
    /// `pods.start_pool()` is called), reporting to `observer`.
    pub(super) fn with_pool(size: usize, observer: Arc<dyn crate::PoolObserver>) -> Rig {
        Rig::build(16, 4, size, observer)
    }

    fn build(
        create: i64,
        cleanup: i64,
        pool: usize,
        observer: Arc<dyn crate::PoolObserver>,
    ) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(&dir.path().join("cubelet.redb")).expect("store"));
        let mut builder = EngineBuilder::new().journal(store.clone());
        let mut fakes = HashMap::new();
        for name in PROVIDERS {
            let fake = FakeFlow::new(name);
            builder = builder.provider(name, fake.clone());
            fakes.insert(name, fake);
        }
        let engine = builder.build(&workflows(create, cleanup)).expect("engine");
        let runtime = FakeRuntime::new();
        runtime.add_image("busybox", busybox());
        let shutdown = CancellationToken::new();
        let pods = PodService::with_pool(
            PodDeps {
                engine,
                store: Arc::clone(&store),
                runtime: Arc::new(runtime.clone()),
                shutdown: shutdown.clone(),
            },
            crate::PoolConfig { size: pool },
            observer,
        );
        Rig {
            pods,
            runtime,
            store,
            fakes,
            shutdown,
            _dir: dir,
        }
    }

    pub(super) fn fake(&self, name: &str) -> &FakeFlow {
        &self.fakes[name]
    }

    /// Resources the fake providers hold, over all sandboxes.
    pub(super) fn held(&self) -> usize {
        self.fakes.values().map(|f| f.held()).sum()
    }

    pub(super) async fn ready_pod(&self, name: &str) -> SandboxId {
        self.pods
            .run_sandbox(spec(name))
            .await
            .expect("run sandbox")
    }

    pub(super) async fn created(&self, sandbox: &SandboxId, name: &str) -> String {
        self.pods
            .create_container(sandbox.as_str(), request(name))
            .await
            .expect("create container")
    }

    pub(super) async fn running(&self, sandbox: &SandboxId, name: &str) -> String {
        let id = self.created(sandbox, name).await;
        self.pods.start_container(&id).await.expect("start");
        id
    }

    /// A ready pod (pid namespace per container) whose sandbox step, as
    /// `runtime.sandbox: auto` does, pinned its IPC and UTS namespaces
    /// under `/pins/<name>` instead of starting an infra process; the
    /// network step pinned `/netns/<name>`. The fake runtime reports the
    /// pins alive.
    pub(super) async fn infraless_pod(&self, name: &str) -> SandboxId {
        let mut s = spec(name);
        s.namespaces.pid = cubelet_engine::spec::NamespaceMode::Container;
        let id = self.pods.run_sandbox(s).await.expect("run sandbox");
        let dir = std::path::PathBuf::from(format!("/pins/{name}"));
        self.store
            .update_sandbox(&id, |r| {
                r.process = Some(cubelet_engine::spec::SandboxProcess {
                    pid: None,
                    runtime_handler: "runc".to_owned(),
                    ipc_path: Some(dir.join("ipc")),
                    uts_path: Some(dir.join("uts")),
                    pins_dir: Some(dir.clone()),
                });
                r.network = Some(cubelet_engine::spec::NetworkStatus {
                    netns_path: Some(format!("/netns/{name}").into()),
                    ..Default::default()
                });
            })
            .expect("store");
        self.runtime.set_pins_alive(dir, true);
        id
    }

    pub(super) fn sandbox(&self, id: &SandboxId) -> Option<cubelet_store::SandboxRecord> {
        self.store.get_sandbox(id).expect("store")
    }

    pub(super) fn container(&self, id: &str) -> Option<cubelet_store::ContainerRecord> {
        self.store.get_container(id).expect("store")
    }
}

pub(super) fn spec(name: &str) -> SandboxSpec {
    SandboxSpec {
        name: name.to_owned(),
        namespace: "test".to_owned(),
        uid: format!("uid-{name}"),
        attempt: 0,
        log_directory: Some(format!("/var/log/pods/test_{name}").into()),
        runtime_handler: "runc".to_owned(),
        cgroup_parent: Some("/kubepods/pod-test".to_owned()),
        sysctls: [(
            "net.ipv4.ip_unprivileged_port_start".to_owned(),
            "0".to_owned(),
        )]
        .into(),
        ..Default::default()
    }
}

pub(super) fn request(name: &str) -> ContainerRequest {
    ContainerRequest {
        name: name.to_owned(),
        attempt: 0,
        image: "busybox".to_owned(),
        log_path: Some(format!("{name}/0.log").into()),
        ..Default::default()
    }
}

/// Every event waiting on `rx`, as (container id, kind).
pub(super) fn drain(rx: &mut broadcast::Receiver<PodEvent>) -> Vec<(String, PodEventKind)> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push((e.container_id, e.kind));
    }
    out
}

/// Waits until `cond` holds (checked every millisecond, for up to 10 s),
/// so a test acts at a known point of a call in flight and not after a
/// guessed sleep, which a loaded machine overruns.
pub(super) async fn until(what: &str, cond: impl Fn() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
}

pub(super) async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish"))
}
