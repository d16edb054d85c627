//! Cubelet's own admin API (`proto/cubelet/admin/v1/admin.proto`), served on
//! the unix socket `<state_dir>/admin.sock` (mode 0600) for `cubelet ctl`:
//! flow limits and counters, run-time limit changes, sandboxes with their
//! journalled flow history, and on-demand GC passes.
//!
//! The service reads the engine's limiters, the store and the journal, and
//! triggers the agent's own `Gc` (`crate::gc`); it never changes a sandbox
//! itself.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use cubelet_engine::{Engine, FlowKind, FlowRecord, LimiterSnapshot, StepRecord};
use cubelet_store::{SandboxRecord, Store};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::gc::{Gc, PassReport};

/// Generated messages, server and client of `cubelet.admin.v1`.
#[allow(
    missing_docs,
    unreachable_pub,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod proto {
    tonic::include_proto!("cubelet.admin.v1");
}

use proto::admin_server::{Admin, AdminServer};

/// File name of the admin socket inside `state_dir`.
pub const SOCKET_NAME: &str = "admin.sock";

/// Errors of the admin API, on either side of the socket.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The socket could not be created.
    #[error("bind admin socket {path}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The server stopped with an error.
    #[error("serve the admin api")]
    Serve(#[source] tonic::transport::Error),
    /// The client could not reach the socket.
    #[error("connect to {path} (is cubelet running?)")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server answered with an error (its status carries the cause as text).
    #[error("{call}: {}: {}", .status.code(), .status.message())]
    Call {
        /// RPC name.
        call: &'static str,
        /// The status returned.
        status: Status,
    },
    /// The configuration naming the socket could not be loaded.
    #[error("load configuration")]
    Config(#[source] crate::config::ConfigError),
    /// A command-line argument is wrong.
    #[error("{0}")]
    Usage(String),
}

/// Runs a garbage-collection pass on demand.
#[async_trait]
pub(crate) trait GcTrigger: Send + Sync + 'static {
    /// One full pass, as the periodic collector runs it.
    async fn pass(&self) -> PassReport;
}

#[async_trait]
impl GcTrigger for Gc {
    async fn pass(&self) -> PassReport {
        Gc::pass(self).await
    }
}

/// The `cubelet.admin.v1.Admin` service over the agent's handles.
#[derive(Clone)]
pub(crate) struct AdminService {
    engine: Engine,
    store: Arc<Store>,
    gc: Arc<dyn GcTrigger>,
    /// One on-demand pass at a time.
    gc_lock: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for AdminService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminService").finish_non_exhaustive()
    }
}

impl AdminService {
    /// A service over the engine (limits), the store (sandboxes; the engine's
    /// journal gives their history) and the collector.
    pub(crate) fn new(engine: Engine, store: Arc<Store>, gc: Arc<dyn GcTrigger>) -> Self {
        Self {
            engine,
            store,
            gc,
            gc_lock: Arc::default(),
        }
    }

    fn flow_row(kind: FlowKind, s: LimiterSnapshot) -> proto::FlowLimit {
        proto::FlowLimit {
            flow: kind.as_str().to_owned(),
            limit: s.limit as u64,
            inflight: s.inflight as u64,
            peak: s.peak as u64,
            rejected: s.rejected,
        }
    }
}

#[async_trait]
impl Admin for AdminService {
    async fn list_flows(
        &self,
        _request: Request<proto::ListFlowsRequest>,
    ) -> Result<Response<proto::ListFlowsResponse>, Status> {
        let flows = self
            .engine
            .limits()
            .into_iter()
            .map(|(k, s)| Self::flow_row(k, s))
            .collect();
        Ok(Response::new(proto::ListFlowsResponse { flows }))
    }

    async fn set_flow_limit(
        &self,
        request: Request<proto::SetFlowLimitRequest>,
    ) -> Result<Response<proto::SetFlowLimitResponse>, Status> {
        let req = request.into_inner();
        let kind: FlowKind = req.flow.parse().map_err(Status::invalid_argument)?;
        let limit = usize::try_from(req.limit)
            .map_err(|_| Status::invalid_argument(format!("limit {} is too large", req.limit)))?;
        self.engine
            .set_limit(kind, limit)
            .map_err(|e| Status::failed_precondition(cubelet_engine::chain(&e)))?;
        tracing::info!(flow = %kind, limit, "flow limit changed through the admin api");
        let flow = self
            .engine
            .limits()
            .into_iter()
            .find(|(k, _)| *k == kind)
            .map(|(k, s)| Self::flow_row(k, s));
        Ok(Response::new(proto::SetFlowLimitResponse { flow }))
    }

    async fn list_shells(
        &self,
        _request: Request<proto::ListShellsRequest>,
    ) -> Result<Response<proto::ListShellsResponse>, Status> {
        let store = Arc::clone(&self.store);
        let mut records = tokio::task::spawn_blocking(move || store.list_shells())
            .await
            .map_err(|e| Status::internal(format!("list shells: {e}")))?
            .map_err(|e| Status::internal(cubelet_engine::chain(&e)))?;
        records.sort_by_key(|r| r.created_at);
        let shells = records
            .into_iter()
            .map(|r| proto::Shell {
                id: r.id.to_string(),
                created_at_ms: millis(r.created_at),
            })
            .collect();
        Ok(Response::new(proto::ListShellsResponse { shells }))
    }

    async fn list_sandboxes(
        &self,
        request: Request<proto::ListSandboxesRequest>,
    ) -> Result<Response<proto::ListSandboxesResponse>, Status> {
        let prefix = request.into_inner().id_prefix;
        let store = Arc::clone(&self.store);
        let journal = Arc::clone(self.engine.journal());
        // redb reads are synchronous; keep them off the async workers.
        let sandboxes = tokio::task::spawn_blocking(move || {
            let mut records = store
                .list_sandboxes()
                .map_err(|e| Status::internal(cubelet_engine::chain(&e)))?;
            records.retain(|r| r.id.as_str().starts_with(&prefix));
            records.sort_by_key(|r| r.created_at);
            records
                .into_iter()
                .map(|rec| {
                    let history = journal
                        .sandbox_history(&rec.id)
                        .map_err(|e| Status::internal(cubelet_engine::chain(&e)))?;
                    Ok(sandbox_message(&rec, &history))
                })
                .collect::<Result<Vec<_>, Status>>()
        })
        .await
        .map_err(|e| Status::internal(format!("list sandboxes: {e}")))??;
        Ok(Response::new(proto::ListSandboxesResponse { sandboxes }))
    }

    async fn run_gc(
        &self,
        _request: Request<proto::RunGcRequest>,
    ) -> Result<Response<proto::RunGcResponse>, Status> {
        let _one = self.gc_lock.lock().await;
        tracing::info!("gc pass requested through the admin api");
        let report = self.gc.pass().await;
        let owned = |m: std::collections::HashMap<&'static str, u64>| {
            m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
        };
        Ok(Response::new(proto::RunGcResponse {
            reclaimed: owned(report.reclaimed),
            failures: owned(report.failures),
        }))
    }
}

/// Milliseconds since the Unix epoch (negative before it).
fn millis(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn step_message(s: &StepRecord) -> proto::StepRun {
    proto::StepRun {
        step: s.step.clone(),
        stage: u32::try_from(s.stage).unwrap_or(u32::MAX),
        started_at_ms: millis(s.started_at),
        duration_us: s.duration.map(micros),
        error: s.error.clone().unwrap_or_default(),
    }
}

fn flow_message(f: &FlowRecord) -> proto::FlowRun {
    let state = serde_json::to_value(f.state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{:?}", f.state).to_lowercase());
    proto::FlowRun {
        id: f.id,
        kind: f.kind.as_str().to_owned(),
        state,
        started_at_ms: millis(f.started_at),
        finished_at_ms: f.finished_at.map(millis),
        error: f.error.clone().unwrap_or_default(),
        compensates: f.compensates,
        steps: f.steps.iter().map(step_message).collect(),
    }
}

/// A stored sandbox and its journal history as an admin API message.
pub(crate) fn sandbox_message(rec: &SandboxRecord, history: &[FlowRecord]) -> proto::Sandbox {
    proto::Sandbox {
        id: rec.id.as_str().to_owned(),
        name: rec.spec.name.clone(),
        namespace: rec.spec.namespace.clone(),
        uid: rec.spec.uid.clone(),
        attempt: rec.spec.attempt,
        state: rec.state.as_str().to_owned(),
        created_at_ms: millis(rec.created_at),
        ips: rec
            .network
            .as_ref()
            .map(|n| n.ips.iter().map(ToString::to_string).collect())
            .unwrap_or_default(),
        last_error: rec.last_error.clone().unwrap_or_default(),
        flows: history.iter().map(flow_message).collect(),
    }
}

/// Binds `socket` with mode 0600, removing a stale socket file first.
pub(crate) fn bind(socket: &Path) -> Result<UnixListener, AdminError> {
    let err = |source| AdminError::Bind {
        path: socket.to_path_buf(),
        source,
    };
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = UnixListener::bind(socket).map_err(err)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Serves the admin API on `listener` until `shutdown`, then removes `socket`.
pub(crate) async fn serve(
    listener: UnixListener,
    socket: PathBuf,
    service: AdminService,
    shutdown: CancellationToken,
) -> Result<(), AdminError> {
    let result = tonic::transport::Server::builder()
        .add_service(AdminServer::new(service))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(AdminError::Serve);
    let _ = std::fs::remove_file(&socket);
    result
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, Ordering};

    use cubelet_engine::fake::FakeFlow;
    use cubelet_engine::{
        EngineBuilder, Flow, FlowContext, SandboxId, SandboxSpec, WorkflowConfig,
    };

    use super::*;
    use crate::ctl;

    struct FakeGc(AtomicU32);

    #[async_trait]
    impl GcTrigger for FakeGc {
        async fn pass(&self) -> PassReport {
            self.0.fetch_add(1, Ordering::SeqCst);
            PassReport {
                reclaimed: HashMap::from([("sandbox", 2), ("veth", 1)]),
                failures: HashMap::from([("storage", 1)]),
            }
        }
    }

    struct Fixture {
        dir: tempfile::TempDir,
        engine: Engine,
        store: Arc<Store>,
        gc: Arc<FakeGc>,
        shutdown: CancellationToken,
        server: tokio::task::JoinHandle<Result<(), AdminError>>,
    }

    impl Fixture {
        fn socket(&self) -> PathBuf {
            self.dir.path().join("state").join(SOCKET_NAME)
        }
    }

    async fn start() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("cubelet.redb")).unwrap());
        let mut builder = EngineBuilder::new().journal(store.clone());
        for name in crate::PROVIDERS {
            builder = builder.provider(name, FakeFlow::new(name) as Arc<dyn Flow>);
        }
        let engine = builder.build(&WorkflowConfig::default()).unwrap();
        let gc = Arc::new(FakeGc(AtomicU32::new(0)));
        let socket = dir.path().join("state").join(SOCKET_NAME);
        // A stale file where the socket goes is replaced.
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        std::fs::write(&socket, b"stale").unwrap();
        let listener = bind(&socket).unwrap();
        let service = AdminService::new(engine.clone(), store.clone(), gc.clone());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, socket, service, shutdown.clone()));
        Fixture {
            dir,
            engine,
            store,
            gc,
            shutdown,
            server,
        }
    }

    async fn stop(f: Fixture) {
        let socket = f.socket();
        f.shutdown.cancel();
        f.server.await.unwrap().unwrap();
        assert!(!socket.exists(), "socket removed at shutdown");
    }

    fn ctl_args(socket: &Path, command: &[&str]) -> ctl::CtlArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ctl::CtlArgs,
        }
        let mut argv = vec!["ctl", "--socket", socket.to_str().unwrap()];
        argv.extend_from_slice(command);
        Cli::parse_from(argv).args
    }

    #[tokio::test]
    async fn socket_is_private_and_flows_are_listed() {
        let f = start().await;
        let mode = std::fs::metadata(f.socket()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let out = ctl::run(&ctl_args(&f.socket(), &["flows"])).await.unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("FLOW"), "{out}");
        assert!(lines[0].contains("LIMIT") && lines[0].contains("REJECTED"));
        let create: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(create, ["create", "16", "0", "0", "0"], "{out}");
        assert!(lines[2].starts_with("destroy"), "{out}");
        assert!(lines[3].starts_with("cleanup"), "{out}");
        stop(f).await;
    }

    #[tokio::test]
    async fn set_limit_changes_the_engine_and_rejects_bad_flows() {
        let f = start().await;
        let out = ctl::run(&ctl_args(&f.socket(), &["set-limit", "create", "4"]))
            .await
            .unwrap();
        assert!(out.contains("create"), "{out}");
        let create = f
            .engine
            .limits()
            .into_iter()
            .find(|(k, _)| *k == FlowKind::Create)
            .unwrap()
            .1;
        assert_eq!(create.limit, 4);
        let flows = ctl::run(&ctl_args(&f.socket(), &["flows"])).await.unwrap();
        let row: Vec<&str> = flows.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row[..2], ["create", "4"], "{flows}");

        // `0` shows as unlimited.
        ctl::run(&ctl_args(&f.socket(), &["set-limit", "cleanup", "0"]))
            .await
            .unwrap();
        let flows = ctl::run(&ctl_args(&f.socket(), &["flows"])).await.unwrap();
        assert!(
            flows
                .lines()
                .any(|l| l.starts_with("cleanup") && l.contains("unlimited")),
            "{flows}"
        );

        let err = ctl::run(&ctl_args(&f.socket(), &["set-limit", "bogus", "4"]))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, AdminError::Call { status, .. } if status.code() == tonic::Code::InvalidArgument),
            "{err:?}"
        );
        assert!(err.to_string().contains("unknown flow"), "{err}");
        stop(f).await;
    }

    #[tokio::test]
    async fn sandboxes_show_their_flow_history() {
        let f = start().await;
        let id = SandboxId::new_unchecked("ab".repeat(32));
        let spec = SandboxSpec {
            name: "web".into(),
            namespace: "default".into(),
            uid: "uid-1".into(),
            ..Default::default()
        };
        f.store
            .put_sandbox(&SandboxRecord::new(id.clone(), spec.clone()))
            .unwrap();
        let ctx = Arc::new(FlowContext::new(id.clone(), Arc::new(spec)));
        f.engine.run(FlowKind::Create, ctx).await.unwrap();

        let raw = {
            let mut client = ctl::connect(&f.socket()).await.unwrap();
            client
                .list_sandboxes(proto::ListSandboxesRequest::default())
                .await
                .unwrap()
                .into_inner()
        };
        assert_eq!(raw.sandboxes.len(), 1);
        let sb = &raw.sandboxes[0];
        assert_eq!(sb.id, id.as_str());
        assert_eq!(sb.flows.len(), 1);
        assert_eq!(sb.flows[0].kind, "create");
        assert_eq!(sb.flows[0].state, "succeeded");
        let mut steps: Vec<(u32, &str)> = sb.flows[0]
            .steps
            .iter()
            .map(|s| (s.stage, s.step.as_str()))
            .collect();
        steps.sort();
        assert_eq!(steps, [(0, "network"), (0, "storage"), (1, "sandbox")]);
        assert!(sb.flows[0].steps.iter().all(|s| s.duration_us.is_some()));

        let out = ctl::run(&ctl_args(&f.socket(), &["sandboxes"]))
            .await
            .unwrap();
        assert!(out.contains(&id.as_str()[..13]), "{out}");
        assert!(out.contains("default/web"), "{out}");
        assert!(out.contains("create") && out.contains("succeeded"), "{out}");
        for step in ["storage", "network", "sandbox"] {
            assert!(out.contains(step), "{out}");
        }

        let none = ctl::run(&ctl_args(&f.socket(), &["sandboxes", "--id", "ff"]))
            .await
            .unwrap();
        assert!(!none.contains(&id.as_str()[..13]), "{none}");
        stop(f).await;
    }

    #[tokio::test]
    async fn gc_runs_a_pass_and_reports_it() {
        let f = start().await;
        let out = ctl::run(&ctl_args(&f.socket(), &["gc"])).await.unwrap();
        assert_eq!(f.gc.0.load(Ordering::SeqCst), 1);
        let row = |kind: &str| -> Vec<String> {
            out.lines()
                .find(|l| l.split_whitespace().next() == Some(kind))
                .unwrap_or_else(|| panic!("no {kind} row in\n{out}"))
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(row("sandbox"), ["sandbox", "2", "0"]);
        assert_eq!(row("veth"), ["veth", "1", "0"]);
        assert_eq!(row("storage"), ["storage", "0", "1"]);
        stop(f).await;
    }

    #[tokio::test]
    async fn ctl_names_the_socket_when_nothing_listens() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join(SOCKET_NAME);
        let err = ctl::run(&ctl_args(&socket, &["flows"])).await.unwrap_err();
        assert!(matches!(err, AdminError::Connect { .. }), "{err:?}");
        assert!(err.to_string().contains(socket.to_str().unwrap()), "{err}");
    }
}
