//! `cubelet ctl`: a small client of the admin API on `<state_dir>/admin.sock`
//! that prints readable tables (flows and limits, sandboxes with their flow
//! history, GC results).

use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::admin::proto::admin_client::AdminClient;
use crate::admin::proto::{
    FlowLimit, FlowRun, ListFlowsRequest, ListSandboxesRequest, ListShellsRequest, RunGcRequest,
    RunGcResponse, Sandbox, SetFlowLimitRequest,
};
use crate::admin::{AdminError, SOCKET_NAME};
use crate::config::Config;

/// Default configuration file, used to find the socket when none is given.
const DEFAULT_CONFIG: &str = "/etc/cubelet/config.yaml";

/// Arguments of `cubelet ctl`.
#[derive(Debug, Clone, clap::Args)]
pub struct CtlArgs {
    /// Admin socket; default `<state_dir>/admin.sock` of the configuration.
    #[arg(long, conflicts_with = "config")]
    pub socket: Option<PathBuf>,
    /// Configuration file whose `state_dir` holds the socket
    /// (default /etc/cubelet/config.yaml if it exists).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Drop-in directory of that configuration.
    #[arg(long, requires = "config")]
    pub config_dir: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// Commands of `cubelet ctl`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CtlCommand {
    /// Flows with their limit, in-flight, peak and rejection counts.
    Flows,
    /// Changes a flow's concurrency limit at run time (0 = unlimited).
    SetLimit {
        /// create, destroy, cleanup or prewarm.
        flow: String,
        /// New limit.
        limit: u64,
    },
    /// Sandboxes with the flows the journal recorded for them.
    Sandboxes {
        /// Only sandboxes whose id starts with this.
        #[arg(long)]
        id: Option<String>,
    },
    /// Runs a garbage-collection pass now and shows what it reclaimed.
    Gc,
    /// Warm-pool shells the node holds (no pod's yet), one id a line.
    Shells,
}

impl CtlArgs {
    /// The socket to talk to: `--socket`, else the configuration's state dir.
    pub fn socket_path(&self) -> Result<PathBuf, AdminError> {
        if let Some(s) = &self.socket {
            return Ok(s.clone());
        }
        let config = match &self.config {
            Some(file) => {
                Config::load(file, self.config_dir.as_deref()).map_err(AdminError::Config)?
            }
            None if Path::new(DEFAULT_CONFIG).is_file() => {
                Config::load(Path::new(DEFAULT_CONFIG), None).map_err(AdminError::Config)?
            }
            None => Config::default(),
        };
        Ok(config.state_dir.join(SOCKET_NAME))
    }
}

/// Opens a client on the admin socket (authority `localhost`).
pub async fn connect(socket: &Path) -> Result<AdminClient<Channel>, AdminError> {
    let path = socket.to_path_buf();
    let channel = Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|source| AdminError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
    Ok(AdminClient::new(channel))
}

/// Runs one `cubelet ctl` command; returns the text to print.
pub async fn run(args: &CtlArgs) -> Result<String, AdminError> {
    let socket = args.socket_path()?;
    let mut client = connect(&socket).await?;
    let call = |call: &'static str| move |status| AdminError::Call { call, status };
    match &args.command {
        CtlCommand::Flows => {
            let resp = client
                .list_flows(ListFlowsRequest {})
                .await
                .map_err(call("list flows"))?;
            Ok(flows_table(&resp.into_inner().flows))
        }
        CtlCommand::SetLimit { flow, limit } => {
            let resp = client
                .set_flow_limit(SetFlowLimitRequest {
                    flow: flow.clone(),
                    limit: *limit,
                })
                .await
                .map_err(call("set flow limit"))?;
            let rows: Vec<FlowLimit> = resp.into_inner().flow.into_iter().collect();
            Ok(format!(
                "{flow} limit set to {}\n{}",
                limit_text(*limit),
                flows_table(&rows)
            ))
        }
        CtlCommand::Sandboxes { id } => {
            let resp = client
                .list_sandboxes(ListSandboxesRequest {
                    id_prefix: id.clone().unwrap_or_default(),
                })
                .await
                .map_err(call("list sandboxes"))?;
            Ok(sandboxes_text(&resp.into_inner().sandboxes))
        }
        CtlCommand::Gc => {
            let resp = client
                .run_gc(RunGcRequest {})
                .await
                .map_err(call("run gc"))?;
            Ok(gc_table(&resp.into_inner()))
        }
        CtlCommand::Shells => {
            let resp = client
                .list_shells(ListShellsRequest {})
                .await
                .map_err(call("list shells"))?;
            Ok(resp
                .into_inner()
                .shells
                .iter()
                .map(|s| format!("{}\n", s.id))
                .collect())
        }
    }
}

/// Left-aligned columns separated by two spaces, one line per row.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                out.push_str("  ");
            }
            out.push_str(cell);
            let pad = w.saturating_sub(cell.chars().count());
            out.extend(std::iter::repeat_n(' ', pad));
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let mut out = line(&mut header.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

fn limit_text(limit: u64) -> String {
    if limit == 0 {
        "unlimited".to_owned()
    } else {
        limit.to_string()
    }
}

/// The `flows` table.
fn flows_table(flows: &[FlowLimit]) -> String {
    let rows: Vec<Vec<String>> = flows
        .iter()
        .map(|f| {
            vec![
                f.flow.clone(),
                limit_text(f.limit),
                f.inflight.to_string(),
                f.peak.to_string(),
                f.rejected.to_string(),
            ]
        })
        .collect();
    table(&["FLOW", "LIMIT", "INFLIGHT", "PEAK", "REJECTED"], &rows)
}

fn time_text(ms: i64) -> String {
    let Ok(ms) = u64::try_from(ms) else {
        return "-".to_owned();
    };
    let t = UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn duration_text(us: u64) -> String {
    if us < 1_000 {
        format!("{us}µs")
    } else if us < 1_000_000 {
        format!("{:.1}ms", us as f64 / 1e3)
    } else {
        format!("{:.2}s", us as f64 / 1e6)
    }
}

fn flow_took(f: &FlowRun) -> String {
    match f.finished_at_ms {
        Some(end) => {
            let us = u64::try_from(end.saturating_sub(f.started_at_ms)).unwrap_or(0) * 1000;
            duration_text(us)
        }
        None => "-".to_owned(),
    }
}

/// The `sandboxes` listing: a table of sandboxes, then each one's flows and
/// their steps.
fn sandboxes_text(sandboxes: &[Sandbox]) -> String {
    if sandboxes.is_empty() {
        return "no sandboxes\n".to_owned();
    }
    let short = |id: &str| id.chars().take(13).collect::<String>();
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| {
            vec![
                short(&s.id),
                s.state.clone(),
                format!("{}/{}", s.namespace, s.name),
                s.attempt.to_string(),
                if s.ips.is_empty() {
                    "-".to_owned()
                } else {
                    s.ips.join(",")
                },
                time_text(s.created_at_ms),
                s.flows.len().to_string(),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "SANDBOX", "STATE", "POD", "ATTEMPT", "IP", "CREATED", "FLOWS",
        ],
        &rows,
    );
    for s in sandboxes {
        out.push_str(&format!("\n{}  {}/{}\n", s.id, s.namespace, s.name));
        if !s.last_error.is_empty() {
            out.push_str(&format!("  last error: {}\n", s.last_error));
        }
        let mut rows = Vec::new();
        for f in &s.flows {
            let mut flow = format!("#{} {}", f.id, f.kind);
            if let Some(c) = f.compensates {
                flow.push_str(&format!(" (undoes #{c})"));
            }
            rows.push(vec![
                flow,
                String::new(),
                String::new(),
                f.state.clone(),
                time_text(f.started_at_ms),
                flow_took(f),
                f.error.clone(),
            ]);
            for st in &f.steps {
                let result = match (&st.duration_us, st.error.is_empty()) {
                    (None, _) => "running",
                    (Some(_), true) => "ok",
                    (Some(_), false) => "error",
                };
                rows.push(vec![
                    String::new(),
                    st.stage.to_string(),
                    st.step.clone(),
                    result.to_owned(),
                    time_text(st.started_at_ms),
                    st.duration_us.map_or_else(|| "-".to_owned(), duration_text),
                    st.error.clone(),
                ]);
            }
        }
        if rows.is_empty() {
            out.push_str("  no journalled flows\n");
            continue;
        }
        let t = table(
            &[
                "FLOW", "STAGE", "STEP", "RESULT", "STARTED", "TOOK", "ERROR",
            ],
            &rows,
        );
        for line in t.lines() {
            out.push_str("  ");
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The `gc` table: reclaimed and failed counts by kind.
fn gc_table(report: &RunGcResponse) -> String {
    let mut kinds: Vec<&String> = report
        .reclaimed
        .keys()
        .chain(report.failures.keys())
        .collect();
    kinds.sort();
    kinds.dedup();
    if kinds.is_empty() {
        return "gc pass done: nothing to reclaim\n".to_owned();
    }
    let rows: Vec<Vec<String>> = kinds
        .iter()
        .map(|k| {
            vec![
                (*k).clone(),
                report.reclaimed.get(*k).copied().unwrap_or(0).to_string(),
                report.failures.get(*k).copied().unwrap_or(0).to_string(),
            ]
        })
        .collect();
    format!(
        "gc pass done\n{}",
        table(&["KIND", "RECLAIMED", "FAILURES"], &rows)
    )
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::admin::proto::StepRun;

    fn ms(t: SystemTime) -> i64 {
        i64::try_from(t.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
    }

    #[test]
    fn tables_align_columns() {
        let t = table(
            &["A", "BB"],
            &[
                vec!["long-cell".into(), "x".into()],
                vec!["y".into(), "z".into()],
            ],
        );
        assert_eq!(t, "A          BB\nlong-cell  x\ny          z\n");
    }

    #[test]
    fn durations_are_readable() {
        assert_eq!(duration_text(12), "12µs");
        assert_eq!(duration_text(1_500), "1.5ms");
        assert_eq!(duration_text(2_500_000), "2.50s");
    }

    #[test]
    fn sandboxes_list_steps_under_their_flow() {
        let now = ms(SystemTime::now());
        let sb = Sandbox {
            id: "0123456789abcdef".repeat(4),
            name: "web".into(),
            namespace: "default".into(),
            state: "ready".into(),
            created_at_ms: now,
            ips: vec!["10.86.0.2".into()],
            flows: vec![FlowRun {
                id: 7,
                kind: "create".into(),
                state: "failed".into(),
                started_at_ms: now,
                finished_at_ms: Some(now + 20),
                error: "network: boom".into(),
                steps: vec![
                    StepRun {
                        step: "network".into(),
                        stage: 0,
                        started_at_ms: now,
                        duration_us: Some(900),
                        error: "boom".into(),
                    },
                    StepRun {
                        step: "storage".into(),
                        stage: 0,
                        started_at_ms: now,
                        duration_us: None,
                        error: String::new(),
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let out = sandboxes_text(&[sb]);
        assert!(out.starts_with("SANDBOX"), "{out}");
        assert!(out.contains("0123456789abc  ready  default/web"), "{out}");
        assert!(out.contains("10.86.0.2"), "{out}");
        let step = out.lines().find(|l| l.contains("network  error")).unwrap();
        assert!(step.contains("900µs") && step.ends_with("boom"), "{out}");
        assert!(out.lines().any(|l| l.contains("storage  running")), "{out}");
        assert!(out.contains("#7 create"), "{out}");
        assert!(out.contains("20.0ms"), "{out}");
        assert_eq!(sandboxes_text(&[]), "no sandboxes\n");
    }

    #[test]
    fn gc_without_work_says_so() {
        assert_eq!(
            gc_table(&RunGcResponse::default()),
            "gc pass done: nothing to reclaim\n"
        );
    }

    #[test]
    fn socket_comes_from_the_configured_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, "state_dir: /run/test-cubelet-ctl\n").unwrap();
        let args = CtlArgs {
            socket: None,
            config: Some(file),
            config_dir: None,
            command: CtlCommand::Flows,
        };
        assert_eq!(
            args.socket_path().unwrap(),
            Path::new("/run/test-cubelet-ctl/admin.sock")
        );
        let bad = CtlArgs {
            config: Some(dir.path().join("missing.yaml")),
            ..args
        };
        assert!(matches!(bad.socket_path(), Err(AdminError::Config(_))));
    }
}
