//! `cri-bench`: measures pod lifecycles over CRI on several endpoints in one
//! run, alternating between them so drift and noise hit all alike, and
//! prints, per call, p50 with the ratio to a baseline endpoint, and p50 /
//! p90 / p99 (markdown tables).
//!
//! Endpoints are existing CRI sockets (`--endpoint containerd=unix:///…`,
//! e.g. containerd's own CRI plugin) or Cubelet daemons the bench starts
//! itself (`--cubelet cubelet-pool=pool.yaml`: a test-prefixed daemon of
//! its own, as the e2e suites start one, with an optional config drop-in),
//! torn down afterwards with all they made.
//!
//! Phases, each alternating between the endpoints:
//! 1. latency: `--n` lifecycles per endpoint at `--concurrency`, in rounds
//!    (one batch of `--concurrency` lifecycles per endpoint, the order
//!    rotated every round), after `--warmup` rounds not counted. One
//!    lifecycle: RunPodSandbox, CreateContainer, StartContainer (`sleep`),
//!    StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox, with
//!    the configs a kubelet sends;
//! 2. churn (`--churn N`): N lifecycles per endpoint at
//!    `--churn-concurrency`, in batches of `--churn-batch` taken in turn;
//!    pods/s over the batches' wall time;
//! 3. plot (`--plot out.png`): `--plot-pods` RunPodSandbox per endpoint,
//!    one endpoint after the other pod by pod, the pods kept running (a node
//!    filling up), then removed; a PNG of each call's latency per pod, its
//!    numbers beside it as CSV (`out.csv`; `--replot out.csv` draws again);
//! 4. pulls (`--pulls N`): cold and concurrent PullImage of `--pull-image`,
//!    absent on every endpoint before each pull (see `pull.rs`);
//! 5. log flood (`--log-floods N`): a container printing `y` lines as fast
//!    as it can for `--log-flood-secs`, the lines a second reaching its log
//!    and the CPU of the process serving the socket (see `flood.rs`).
//!
//! `--n 0` skips the latency phase.

mod flood;
mod lifecycle;
mod plot;
mod pull;
mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use cubelet_e2e::cri::image_service_client::ImageServiceClient;
use cubelet_e2e::cri::runtime_service_client::RuntimeServiceClient;
use cubelet_e2e::cri::{ImageStatusRequest, PullImageRequest, RemoveImageRequest};
use cubelet_e2e::{image_spec, ms, percentile, Daemon, DaemonOpts};
use futures::StreamExt;
use tonic::transport::Channel;

use lifecycle::{Lifecycle, Workload};
use report::{Churn, Measured};

/// Benchmark pod lifecycles over CRI on several endpoints, alternating.
#[derive(Debug, Parser)]
#[command(name = "cri-bench")]
struct Args {
    /// An existing CRI endpoint: `LABEL=unix:///path` (or `LABEL=/path`).
    /// Repeatable.
    #[arg(long = "endpoint", value_name = "LABEL=SOCKET")]
    endpoints: Vec<String>,
    /// A Cubelet daemon the bench starts (and removes): `LABEL`, or
    /// `LABEL=drop-in.yaml` with config laid over the test config.
    /// Repeatable.
    #[arg(long = "cubelet", value_name = "LABEL[=DROP-IN]")]
    cubelets: Vec<String>,
    /// The cubelet binary for `--cubelet` (default `$CUBELET_BIN`, else
    /// the release build if there is one, else the debug build).
    #[arg(long)]
    cubelet_bin: Option<PathBuf>,
    /// Label of the endpoint the ratios are taken against (default: the
    /// first `--endpoint`, else the first `--cubelet`).
    #[arg(long)]
    baseline: Option<String>,
    /// Lifecycles per endpoint in the latency phase.
    #[arg(long, default_value_t = 30)]
    n: usize,
    /// Lifecycles in flight at once in the latency phase.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Rounds run first and not counted (image and shim caches, first CNI
    /// setup).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Lifecycles per endpoint in the churn phase (0: no churn phase).
    #[arg(long, default_value_t = 0)]
    churn: usize,
    /// Lifecycles in flight at once in the churn phase.
    #[arg(long, default_value_t = 4)]
    churn_concurrency: usize,
    /// Churn lifecycles per batch; the endpoints take batches in turn.
    #[arg(long, default_value_t = 10)]
    churn_batch: usize,
    /// Draw RunPodSandbox latency per pod into this PNG (plot phase).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Draw `--plot` again from the CSV an earlier run wrote beside its
    /// PNG, and do nothing else.
    #[arg(long, requires = "plot", value_name = "CSV")]
    replot: Option<PathBuf>,
    /// Pods per endpoint in the plot phase, kept until its end.
    #[arg(long, default_value_t = 200)]
    plot_pods: usize,
    /// TrueType font for the plot's text.
    #[arg(long, default_value = plot::DEFAULT_FONT)]
    font: PathBuf,
    /// Container image (pulled first; removed afterwards from an
    /// `--endpoint` that did not have it).
    #[arg(long, default_value = "127.0.0.1:5000/busybox:test")]
    image: String,
    /// RuntimeClass handler for the pods (empty = the runtime's default).
    #[arg(long, default_value = "")]
    runtime_handler: String,
    /// StopContainer timeout (seconds).
    #[arg(long, default_value_t = 0)]
    stop_timeout: i64,
    /// Rounds of the pull phase per endpoint (0: no pull phase).
    #[arg(long, default_value_t = 0)]
    pulls: usize,
    /// Image of the pull phase (e.g. `hack/test-images.sh` with
    /// `BENCH_IMAGES=1`: `127.0.0.1:5000/bench-layers:test`, 5 layers,
    /// about 300 MB). It is removed from every endpoint, before and after.
    #[arg(long, default_value = "127.0.0.1:5000/bench-layers:test")]
    pull_image: String,
    /// PullImage calls at once in the pull phase's concurrent part.
    #[arg(long, default_value_t = 10)]
    pull_concurrency: usize,
    /// Rounds of the log flood phase per endpoint (0: no flood phase).
    #[arg(long, default_value_t = 0)]
    log_floods: usize,
    /// How long each log flood is measured, seconds.
    #[arg(long, default_value_t = 8.0)]
    log_flood_secs: f64,
    /// Directory for pod log directories (a temporary dir in it, removed
    /// afterwards).
    #[arg(long, default_value = "/tmp")]
    log_root: PathBuf,
    /// Copy each started Cubelet's log here (`<label>.log`) before it is
    /// removed: with `CUBELET_E2E_LOG` and `CUBELET_LOG_SPANS=1` in the
    /// environment, the span times of every call.
    #[arg(long)]
    keep_logs: Option<PathBuf>,
}

/// One endpoint under test.
struct Endpoint {
    label: String,
    socket: PathBuf,
    rt: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    /// The daemon the bench started, if it did.
    daemon: Option<Daemon>,
    /// Whether the image was there before the bench pulled it.
    had_image: bool,
}

/// `LABEL=unix:///path`, `LABEL=/path`, or a bare socket (labelled by its
/// path).
fn parse_endpoint(s: &str) -> anyhow::Result<(String, PathBuf)> {
    let (label, sock) = match s.split_once('=') {
        Some((l, p)) => (l.to_owned(), p),
        None => (s.to_owned(), s),
    };
    let path = sock.strip_prefix("unix://").unwrap_or(sock);
    if label.is_empty() || !path.starts_with('/') {
        bail!("--endpoint {s:?}: want LABEL=unix:///absolute/path");
    }
    Ok((label, PathBuf::from(path)))
}

/// `LABEL` or `LABEL=drop-in.yaml`.
fn parse_cubelet(s: &str) -> anyhow::Result<(String, Option<PathBuf>)> {
    let (label, file) = match s.split_once('=') {
        Some((l, f)) => (l, Some(PathBuf::from(f))),
        None => (s, None),
    };
    if label.is_empty() {
        bail!("--cubelet {s:?}: want LABEL or LABEL=drop-in.yaml");
    }
    Ok((label.to_owned(), file))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.concurrency > 0
            && args.churn_concurrency > 0
            && args.churn_batch > 0
            && args.pull_concurrency > 0,
        "--concurrency, --churn-concurrency, --churn-batch and --pull-concurrency must be positive"
    );
    if !args.cubelets.is_empty() {
        // Read by the e2e harness's Daemon; set before any thread exists.
        std::env::set_var(
            "CUBELET_BIN",
            cubelet_e2e::bench_cubelet_bin(args.cubelet_bin.as_deref()),
        );
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    if let Some(p) = &args.plot {
        plot::load_font(&args.font)?;
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            anyhow::ensure!(dir.is_dir(), "--plot {}: no such directory", p.display());
        }
        if let Some(csv) = &args.replot {
            let text =
                std::fs::read_to_string(csv).with_context(|| format!("read {}", csv.display()))?;
            let series = plot::from_csv(&text)?;
            let pods = series.iter().map(|s| s.ms.len()).max().unwrap_or(0);
            plot::draw(p, &plot_title(pods), &series)?;
            println!("plot: {}", p.display());
            return Ok(());
        }
    }
    let log_root = tempfile::Builder::new()
        .prefix("cri-bench-logs")
        .tempdir_in(&args.log_root)?;
    let w = Workload {
        image: args.image.clone(),
        runtime_handler: args.runtime_handler.clone(),
        stop_timeout: args.stop_timeout,
        log_root: log_root.path().to_path_buf(),
    };
    let mut eps = Vec::new();
    let setup = open_endpoints(&args, &mut eps).await;
    let result = match setup {
        Ok(()) => measure(&args, &w, &mut eps).await,
        Err(e) => Err(e),
    };
    let cleanup = close_endpoints(&args, eps).await;
    result?;
    cleanup
}

/// Connects to every `--endpoint`, starts every `--cubelet`, pulls the
/// image on each. What is opened goes into `eps` even on failure, for
/// [`close_endpoints`].
async fn open_endpoints(args: &Args, eps: &mut Vec<Endpoint>) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.endpoints.is_empty() || !args.cubelets.is_empty(),
        "no endpoint: give --endpoint LABEL=SOCKET and/or --cubelet LABEL"
    );
    for s in &args.endpoints {
        let (label, socket) = parse_endpoint(s)?;
        let channel = cubelet_e2e::connect(&socket).await?;
        eps.push(Endpoint {
            label,
            socket,
            rt: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            daemon: None,
            had_image: false,
        });
    }
    if !args.cubelets.is_empty() {
        if let Some(reason) = cubelet_e2e::skip_reason() {
            bail!("cannot start a Cubelet: {reason}");
        }
        eprintln!(
            "cri-bench: starting Cubelet daemons from {}",
            cubelet_e2e::cubelet_bin().display()
        );
    }
    for (index, s) in args.cubelets.iter().enumerate() {
        let (label, file) = parse_cubelet(s)?;
        let extra_config = cubelet_e2e::read_drop_in(file.as_deref())?;
        let d = Daemon::start(DaemonOpts {
            index: u8::try_from(index).context("too many --cubelet")?,
            extra_config,
            default_gc: true,
            ..Default::default()
        })
        .await
        .with_context(|| format!("start Cubelet {label}"))?;
        eps.push(Endpoint {
            label,
            socket: d.socket.clone(),
            rt: d.runtime.clone(),
            images: d.images.clone(),
            daemon: Some(d),
            had_image: false,
        });
    }
    let mut labels: Vec<&str> = eps.iter().map(|e| e.label.as_str()).collect();
    labels.sort_unstable();
    if labels.windows(2).any(|w| w[0] == w[1]) {
        bail!("endpoint labels must differ: {labels:?}");
    }
    for e in eps.iter_mut() {
        e.had_image = e
            .images
            .image_status(ImageStatusRequest {
                image: Some(image_spec(&args.image)),
                verbose: false,
            })
            .await
            .with_context(|| format!("{}: ImageStatus", e.label))?
            .into_inner()
            .image
            .is_some();
        let t = Instant::now();
        e.images
            .pull_image(PullImageRequest {
                image: Some(image_spec(&args.image)),
                ..Default::default()
            })
            .await
            .with_context(|| format!("{}: PullImage {}", e.label, args.image))?;
        eprintln!(
            "cri-bench: {} at {}: {} {} in {} ms",
            e.label,
            e.socket.display(),
            if e.had_image { "had" } else { "pulled" },
            args.image,
            ms(t.elapsed())
        );
    }
    Ok(())
}

/// Removes the image from endpoints that did not have it; keeps the
/// started daemons' logs if asked; tears the daemons down.
async fn close_endpoints(args: &Args, eps: Vec<Endpoint>) -> anyhow::Result<()> {
    let mut errors = Vec::new();
    for mut e in eps {
        match e.daemon.take() {
            None if !e.had_image => {
                if let Err(s) = e
                    .images
                    .remove_image(RemoveImageRequest {
                        image: Some(image_spec(&args.image)),
                    })
                    .await
                {
                    errors.push(format!("{}: RemoveImage: {}", e.label, s.message()));
                }
            }
            None => {}
            Some(d) => {
                if let Some(dir) = &args.keep_logs {
                    let to = dir.join(format!("{}.log", e.label));
                    if let Err(err) = std::fs::create_dir_all(dir)
                        .and_then(|()| std::fs::copy(&d.daemon_log, &to))
                    {
                        errors.push(format!("{}: keep log: {err}", e.label));
                    } else {
                        eprintln!("cri-bench: {} log kept in {}", e.label, to.display());
                    }
                }
                if let Err(err) = d.teardown().await {
                    errors.push(format!("{}: {err:#}", e.label));
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("cleanup: {}", errors.join("; "))
    }
}

/// Progress on one terminal line (nothing when stderr is not a terminal).
fn progress(what: &str) {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprint!("\r\x1b[Kcri-bench: {what}");
    }
}

/// Ends the progress line.
fn progress_done() {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }
}

/// The endpoint order of round `round`: rotated by one each round.
fn rotation(n: usize, round: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |k| (k + round) % n)
}

/// Runs the phases and prints the tables.
async fn measure(args: &Args, w: &Workload, eps: &mut [Endpoint]) -> anyhow::Result<()> {
    let baseline = match &args.baseline {
        None => 0,
        Some(b) => eps
            .iter()
            .position(|e| &e.label == b)
            .with_context(|| format!("--baseline {b}: no endpoint has that label"))?,
    };
    let mut results: Vec<Measured> = eps
        .iter()
        .map(|e| Measured {
            label: e.label.clone(),
            ..Default::default()
        })
        .collect();

    let rounds = args.n.div_ceil(args.concurrency);
    let warmup = if args.n == 0 { 0 } else { args.warmup };
    let mut lifecycle_pool = None;
    for round in 0..warmup + rounds {
        let counted = round >= warmup;
        if round == warmup && args.n > 0 {
            lifecycle_pool = Some(pool_counters(eps).await);
        }
        for i in rotation(eps.len(), round) {
            let batch = (0..args.concurrency).map(|k| {
                let name = lifecycle::pod_name("lat", i, round * args.concurrency + k);
                let rt = eps[i].rt.clone();
                async move { lifecycle::lifecycle(rt, w, &name).await }
            });
            for r in futures::future::join_all(batch).await {
                match (r, counted) {
                    (Ok(l), true) => results[i].lifecycles.push(l),
                    (Err(e), true) => results[i].failures.push(format!("{e:#}")),
                    (Err(e), false) => bail!("{}: warm-up lifecycle: {e:#}", eps[i].label),
                    (Ok(_), false) => {}
                }
            }
        }
        progress(&format!(
            "latency round {}/{}{}",
            round + 1,
            warmup + rounds,
            if counted { "" } else { " (warm-up)" }
        ));
    }
    progress_done();
    if let Some(before) = lifecycle_pool {
        let after = pool_counters(eps).await;
        report_pool(eps, &before, &after, "the counted lifecycles");
    }

    if args.churn > 0 {
        let before = pool_counters(eps).await;
        for (i, c) in churn(args, w, eps).await.into_iter().enumerate() {
            results[i].churn = Some(c);
        }
        let after = pool_counters(eps).await;
        report_pool(eps, &before, &after, "the churn");
    }

    if args.n > 0 || args.churn > 0 {
        println!(
            "\ncri-bench: {} lifecycles per endpoint at concurrency {}, alternating; image {}, handler {:?}, baseline {}",
            args.n, args.concurrency, args.image, args.runtime_handler, eps[baseline].label
        );
        println!("\n{}", report::p50_table(&results, baseline));
        println!("{}", report::spread_table(&results, baseline));
    }
    let mut failed = 0;
    for m in &results {
        failed += m.failures.len() + m.churn.as_ref().map_or(0, |c| c.failed);
        for e in m.failures.iter().take(3) {
            println!("{}: error: {e}", m.label);
        }
    }

    if let Some(out) = &args.plot {
        let series = plot_phase(args, w, eps).await?;
        let csv = out.with_extension("csv");
        std::fs::write(&csv, plot::to_csv(&series))
            .with_context(|| format!("write {}", csv.display()))?;
        plot::draw(out, &plot_title(args.plot_pods), &series)?;
        println!("plot: {} (numbers in {})", out.display(), csv.display());
    }
    if args.pulls > 0 {
        pull::pull_phase(
            eps,
            &args.pull_image,
            args.pulls,
            args.pull_concurrency,
            baseline,
        )
        .await?;
    }
    if args.log_floods > 0 {
        flood::flood_phase(eps, w, args.log_floods, args.log_flood_secs, baseline).await?;
    }
    anyhow::ensure!(failed == 0, "{failed} lifecycles failed");
    Ok(())
}

/// The plot's title for `pods` pods per endpoint.
fn plot_title(pods: usize) -> String {
    format!("RunPodSandbox per pod, {pods} pods per endpoint kept running, alternating")
}

/// The churn phase: every endpoint's result, in endpoint order.
async fn churn(args: &Args, w: &Workload, eps: &[Endpoint]) -> Vec<Churn> {
    let mut out: Vec<Churn> = eps
        .iter()
        .map(|_| Churn {
            concurrency: args.churn_concurrency,
            ..Default::default()
        })
        .collect();
    let mut done = 0;
    let mut round = 0;
    while done < args.churn {
        let size = args.churn_batch.min(args.churn - done);
        for i in rotation(eps.len(), round) {
            let t = Instant::now();
            let results: Vec<anyhow::Result<Lifecycle>> = futures::stream::iter(0..size)
                .map(|k| {
                    let name = lifecycle::pod_name("churn", i, done + k);
                    let rt = eps[i].rt.clone();
                    async move { lifecycle::lifecycle(rt, w, &name).await }
                })
                .buffer_unordered(args.churn_concurrency)
                .collect()
                .await;
            let wall = t.elapsed();
            let ok = results.iter().filter(|r| r.is_ok()).count();
            let c = &mut out[i];
            c.ok += ok;
            c.failed += size - ok;
            c.wall += wall;
            c.batches.push(ok as f64 / wall.as_secs_f64().max(1e-9));
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                eprintln!("\ncri-bench: {} churn: {e:#}", eps[i].label);
            }
        }
        done += size;
        round += 1;
        progress(&format!("churn {done}/{}", args.churn));
    }
    progress_done();
    out
}

/// Prints each started Cubelet's pool hits and misses between the counts
/// `before` and `after` ([`pool_counters`]), during `what`.
fn report_pool(
    eps: &[Endpoint],
    before: &[Option<(f64, f64)>],
    after: &[Option<(f64, f64)>],
    what: &str,
) {
    for (e, (b, a)) in eps.iter().zip(before.iter().zip(after)) {
        if let (Some(b), Some(a)) = (b, a) {
            let (hits, misses) = (a.0 - b.0, a.1 - b.1);
            println!(
                "{}: sandbox pool during {what}: {hits} hits, {misses} misses ({:.0}% hits)",
                e.label,
                100.0 * hits / (hits + misses).max(1.0)
            );
        }
    }
}

/// `cubelet_pool_hits_total` and `cubelet_pool_misses_total` of each
/// started Cubelet that has them.
async fn pool_counters(eps: &[Endpoint]) -> Vec<Option<(f64, f64)>> {
    let mut out = Vec::new();
    for e in eps {
        let v = match &e.daemon {
            Some(d) => match cubelet_e2e::http_get(d.metrics, "/metrics").await {
                Ok((200, body)) => {
                    let sum = |name: &str| -> Option<f64> {
                        let v: Vec<f64> = body
                            .lines()
                            .filter(|l| {
                                l.strip_prefix(name)
                                    .is_some_and(|r| r.starts_with([' ', '{']))
                            })
                            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
                            .collect();
                        (!v.is_empty()).then(|| v.iter().sum())
                    };
                    sum("cubelet_pool_hits_total").zip(sum("cubelet_pool_misses_total"))
                }
                _ => None,
            },
            None => None,
        };
        out.push(v);
    }
    out
}

/// The plot phase: `--plot-pods` RunPodSandbox per endpoint, alternating
/// pod by pod, the pods kept; then every pod removed. One series per
/// endpoint.
async fn plot_phase(
    args: &Args,
    w: &Workload,
    eps: &mut [Endpoint],
) -> anyhow::Result<Vec<plot::Series>> {
    let mut pods: Vec<Vec<String>> = vec![Vec::new(); eps.len()];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); eps.len()];
    let mut failure = None;
    'fill: for k in 0..args.plot_pods {
        for i in rotation(eps.len(), k) {
            let name = lifecycle::pod_name("plot", i, k);
            let cfg = lifecycle::pod_config(&name, &format!("uid-{name}"), &w.log_root);
            match lifecycle::run_pod(&mut eps[i].rt, w, &cfg).await {
                Ok((id, t)) => {
                    pods[i].push(id);
                    times[i].push(t);
                }
                Err(e) => {
                    failure = Some(e.context(format!("{}: plot pod {k}", eps[i].label)));
                    break 'fill;
                }
            }
        }
        progress(&format!("plot pods {}/{}", k + 1, args.plot_pods));
    }
    progress_done();
    for (i, e) in eps.iter().enumerate() {
        let t = Instant::now();
        let results: Vec<anyhow::Result<(Duration, Duration)>> = futures::stream::iter(&pods[i])
            .map(|id| {
                let mut rt = e.rt.clone();
                async move { lifecycle::remove_pod(&mut rt, id).await }
            })
            .buffer_unordered(4)
            .collect()
            .await;
        let errors = results.iter().filter(|r| r.is_err()).count();
        let window = 25.min(times[i].len() / 2).max(1);
        let p50 = |s: &[Duration]| {
            let mut v = s.to_vec();
            v.sort();
            percentile(&v, 50.0)
        };
        println!(
            "{}: RunPodSandbox p50 over {} pods {} ms, first {window} {} ms, last {window} {} ms; removed in {:.1} s ({errors} errors)",
            e.label,
            times[i].len(),
            ms(p50(&times[i])),
            ms(p50(&times[i][..window.min(times[i].len())])),
            ms(p50(&times[i][times[i].len().saturating_sub(window)..])),
            t.elapsed().as_secs_f64()
        );
        if let Some(Err(err)) = results.into_iter().find(|r| r.is_err()) {
            failure.get_or_insert(err.context(format!("{}: removing plot pods", e.label)));
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(eps
        .iter()
        .zip(&times)
        .map(|(e, t)| plot::Series {
            label: e.label.clone(),
            ms: t.iter().map(|d| d.as_secs_f64() * 1000.0).collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_and_without_scheme() {
        assert_eq!(
            parse_endpoint("containerd=unix:///run/x.sock").unwrap(),
            ("containerd".to_owned(), PathBuf::from("/run/x.sock"))
        );
        assert_eq!(
            parse_endpoint("c=/run/x.sock").unwrap(),
            ("c".to_owned(), PathBuf::from("/run/x.sock"))
        );
        assert_eq!(
            parse_endpoint("/run/x.sock").unwrap(),
            ("/run/x.sock".to_owned(), PathBuf::from("/run/x.sock"))
        );
        assert!(parse_endpoint("c=relative.sock").is_err());
        assert!(parse_endpoint("=/run/x.sock").is_err());
    }

    #[test]
    fn cubelets_parse_with_an_optional_drop_in() {
        assert_eq!(
            parse_cubelet("cubelet").unwrap(),
            ("cubelet".to_owned(), None)
        );
        assert_eq!(
            parse_cubelet("pool=p.yaml").unwrap(),
            ("pool".to_owned(), Some(PathBuf::from("p.yaml")))
        );
        assert!(parse_cubelet("=p.yaml").is_err());
    }

    #[test]
    fn rounds_rotate_the_endpoint_order() {
        assert_eq!(rotation(3, 0).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(rotation(3, 1).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(rotation(3, 5).collect::<Vec<_>>(), [2, 0, 1]);
    }
}
