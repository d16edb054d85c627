//! `scale-bench`: brings up N pods with one container each on any CRI
//! endpoint (Cubelet's socket or containerd's own CRI plugin), one after
//! another, then measures what a node at that size answers: RunPodSandbox
//! p50 of the first and the last 25 pods, p50/p99 of ListPodSandbox,
//! ListContainers, ListContainerStats, ListPodSandboxStats and
//! PodSandboxStatus, the agent's resident memory (anonymous and file-backed),
//! threads and open fds (`--pid`: at start, at N and after the teardown), and
//! the time to tear everything down. `--cubelet` starts a Cubelet of its
//! own (the e2e harness's daemon, from `target/`) instead of `--endpoint`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use cubelet_e2e::cri::image_service_client::ImageServiceClient;
use cubelet_e2e::cri::runtime_service_client::RuntimeServiceClient;
use cubelet_e2e::cri::{
    CreateContainerRequest, ListContainerStatsRequest, ListContainersRequest,
    ListPodSandboxRequest, ListPodSandboxStatsRequest, PodSandboxStatusRequest, PullImageRequest,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
};
use cubelet_e2e::{
    container_config, image_spec, ms, percentile, pid_per_container, pod_config, Daemon, DaemonOpts,
};
use tonic::transport::Channel;

/// Measure a CRI endpoint at N pods.
#[derive(Debug, Parser)]
#[command(name = "scale-bench")]
struct Args {
    /// CRI unix socket (or `--cubelet`).
    #[arg(long, required_unless_present = "cubelet")]
    endpoint: Option<PathBuf>,
    /// Start a Cubelet of our own and measure it (its pid is reported as
    /// with `--pid`): `$CUBELET_BIN`, else the release build if there is
    /// one, else the debug build.
    #[arg(long, conflicts_with_all = ["endpoint", "pid"])]
    cubelet: bool,
    /// A config drop-in for the Cubelet of `--cubelet`.
    #[arg(long, requires = "cubelet")]
    drop_in: Option<PathBuf>,
    /// Pods to bring up (one container each).
    #[arg(long, default_value_t = 250)]
    n: usize,
    /// Calls per measured query.
    #[arg(long, default_value_t = 100)]
    queries: usize,
    /// Container image (pulled first).
    #[arg(long, default_value = "127.0.0.1:5000/busybox:test")]
    image: String,
    /// Pid of the agent whose memory and fds to report.
    #[arg(long)]
    pid: Option<u32>,
    /// Seconds to keep the N pods up after the measurements, before the
    /// teardown (to look at the agent at N, e.g. with a profiler).
    #[arg(long, default_value_t = 0)]
    hold: u64,
    /// Seconds to wait between the last pod's start and the first query
    /// (the node settling: the new pods' network start-up, the pool's
    /// refill).
    #[arg(long, default_value_t = 0)]
    settle: u64,
    /// Directory for pod log directories (removed afterwards).
    #[arg(long, default_value = "/tmp")]
    log_root: PathBuf,
}

/// What `--pid` reports of the agent: resident memory (MiB) split into
/// anonymous and file-backed pages, threads and open fds.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    rss: f64,
    anon: f64,
    file: f64,
    threads: usize,
    fds: usize,
}

impl std::fmt::Display for Footprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS {:.1} MiB (anon {:.1}, file {:.1}), {} threads, {} open fds",
            self.rss, self.anon, self.file, self.threads, self.fds
        )
    }
}

/// The footprint of `pid` from `/proc/<pid>/status` and `/proc/<pid>/fd`.
fn footprint(pid: u32) -> Option<Footprint> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<f64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some(Footprint {
        rss: field("VmRSS")? / 1024.0,
        anon: field("RssAnon")? / 1024.0,
        file: field("RssFile")? / 1024.0,
        threads: field("Threads")? as usize,
        fds,
    })
}

/// The node's CPU time (`/proc/stat`, all CPUs, in ticks) and of it the
/// part the hypervisor gave to other guests (`steal`).
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    Some((fields.iter().sum(), *fields.get(7)?))
}

/// How many cgroups the memory controller holds (`/proc/cgroups`), removed
/// ones it still keeps included: a container's memory cgroup lingers after
/// its removal while page cache is charged to it, every bring-up leaves
/// more, and the node's pod start is slower the more there are (see
/// docs/performance.md, "At 250 pods"). `None` without a memory controller.
fn memory_cgroups() -> Option<u64> {
    let table = std::fs::read_to_string("/proc/cgroups").ok()?;
    table.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        if f.next()? != "memory" {
            return None;
        }
        // hierarchy, then num_cgroups
        f.nth(1)?.parse().ok()
    })
}

/// Timed calls of one query, and the share of the node's CPU time stolen
/// by the hypervisor meanwhile: a tail that comes with a high steal is the
/// host's, not the agent's.
struct Measured {
    /// The sorted times, or the gRPC code of the first failure.
    times: Result<Vec<Duration>, tonic::Code>,
    /// Steal, percent of the CPU time that passed.
    steal: Option<f64>,
}

/// Times `queries` calls of `call`; the gRPC code of the first failure
/// instead (containerd 1.6 does not serve every stats call).
async fn measure<F, Fut>(queries: usize, mut call: F) -> Measured
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let before = cpu_ticks();
    let mut v = Vec::with_capacity(queries);
    for i in 0..queries {
        let t = Instant::now();
        match call(i).await {
            Ok(()) => v.push(t.elapsed()),
            Err(s) => {
                return Measured {
                    times: Err(s.code()),
                    steal: None,
                }
            }
        }
    }
    v.sort();
    Measured {
        times: Ok(v),
        steal: steal_since(before),
    }
}

/// Percent of the CPU time since `before` ([`cpu_ticks`]) that was stolen.
fn steal_since(before: Option<(u64, u64)>) -> Option<f64> {
    let ((t0, s0), (t1, s1)) = before.zip(cpu_ticks())?;
    let total = t1.checked_sub(t0).filter(|t| *t > 0)?;
    Some(100.0 * s1.saturating_sub(s0) as f64 / total as f64)
}

async fn up(
    rt: &mut RuntimeServiceClient<Channel>,
    args: &Args,
    log_root: &std::path::Path,
    i: usize,
) -> anyhow::Result<(String, Duration, Duration)> {
    let name = format!("scale-{}-{i}", std::process::id());
    // The namespaces kubelet asks for a pod that does not share its
    // process namespace (the CRI zero value would be one PID namespace per
    // pod, which kubelet sends only for `shareProcessNamespace: true`).
    let log_dir = log_root.join(&name);
    let cfg = pid_per_container(pod_config(&name, &format!("uid-{name}"), &log_dir));
    // kubelet makes the pod's log directory itself before it asks for the
    // sandbox (`createPodSandbox`), so the runtime finds it there and the
    // mkdir is not part of RunPodSandbox as kubelet times it.
    std::fs::create_dir_all(&log_dir).with_context(|| format!("create {}", log_dir.display()))?;
    let t = Instant::now();
    let pod = rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: String::new(),
        })
        .await
        .context("RunPodSandbox")?
        .into_inner()
        .pod_sandbox_id;
    let run = t.elapsed();
    let cid = rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(container_config("sleep", &args.image, &["sleep", "36000"])),
            sandbox_config: Some(cfg),
        })
        .await
        .context("CreateContainer")?
        .into_inner()
        .container_id;
    rt.start_container(StartContainerRequest { container_id: cid })
        .await
        .context("StartContainer")?;
    Ok((pod, run, t.elapsed()))
}

/// The median of unsorted `times`.
fn p50(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    percentile(&sorted, 50.0)
}

/// Prints the p50 of the first and the last `window` of `times`.
fn first_last(what: &str, times: &[Duration], window: usize) {
    let (first, last) = (p50(&times[..window]), p50(&times[times.len() - window..]));
    println!(
        "{what} p50: first {window} {} ms, last {window} {} ms (ratio {:.2})",
        ms(first),
        ms(last),
        last.as_secs_f64() / first.as_secs_f64().max(1e-9)
    );
}

fn row(name: &str, m: &Measured) {
    let steal = m
        .steal
        .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}"));
    match &m.times {
        Ok(v) => println!(
            "{:<22} {:>9} {:>9} {:>9}",
            name,
            ms(percentile(v, 50.0)),
            ms(percentile(v, 99.0)),
            steal
        ),
        Err(code) => println!("{name:<22} fails: {code:?}"),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.cubelet {
        // Read by the e2e harness's Daemon; set before any thread exists.
        std::env::set_var("CUBELET_BIN", cubelet_e2e::bench_cubelet_bin(None));
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.n >= 2 && args.queries > 0, "--n ≥ 2 and --queries > 0");
    let daemon = match args.cubelet {
        true => Some(start_cubelet(args.drop_in.as_deref()).await?),
        false => None,
    };
    let endpoint = match (&daemon, &args.endpoint) {
        (Some(d), _) => d.socket.clone(),
        (None, Some(e)) => e.clone(),
        (None, None) => anyhow::bail!("--endpoint or --cubelet"),
    };
    let pid = args.pid.or(daemon.as_ref().and_then(Daemon::pid));
    let metrics = daemon.as_ref().map(|d| d.metrics);
    let result = measure_node(&args, &endpoint, pid, metrics).await;
    match daemon {
        Some(d) => result.and(d.teardown().await),
        None => result,
    }
}

/// The e2e harness's daemon, with `drop_in` if given.
async fn start_cubelet(drop_in: Option<&Path>) -> anyhow::Result<Daemon> {
    if let Some(reason) = cubelet_e2e::skip_reason() {
        anyhow::bail!("cannot start a Cubelet: {reason}");
    }
    let extra_config = cubelet_e2e::read_drop_in(drop_in)?;
    let d = Daemon::start(DaemonOpts {
        extra_config,
        default_gc: true,
        ..Default::default()
    })
    .await
    .context("start Cubelet")?;
    eprintln!(
        "scale-bench: started {} (pid {:?})",
        cubelet_e2e::cubelet_bin().display(),
        d.pid()
    );
    Ok(d)
}

/// `cubelet_pool_hits_total` of the Cubelet whose admin endpoint is
/// `metrics`; `None` without one, or when it cannot be read.
async fn pool_hits(metrics: Option<SocketAddr>) -> Option<f64> {
    cubelet_e2e::metric(metrics?, "cubelet_pool_hits_total")
        .await
        .ok()
}

async fn measure_node(
    args: &Args,
    endpoint: &Path,
    pid: Option<u32>,
    metrics: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let channel = cubelet_e2e::connect(endpoint).await?;
    let mut rt = RuntimeServiceClient::new(channel.clone());
    ImageServiceClient::new(channel)
        .pull_image(PullImageRequest {
            image: Some(image_spec(&args.image)),
            ..Default::default()
        })
        .await
        .with_context(|| format!("PullImage {}", args.image))?;
    let log_root = tempfile::Builder::new()
        .prefix("scale-bench-logs")
        .tempdir_in(&args.log_root)?;
    let before = pid.and_then(footprint);

    let mut pods = Vec::with_capacity(args.n);
    let mut runs = Vec::with_capacity(args.n);
    let mut starts = Vec::with_capacity(args.n);
    let mut failure = None;
    let ticks_before_up = cpu_ticks();
    let memcgs_before_up = memory_cgroups();
    // The pool's hits before the bring-up, after its first `window` pods,
    // before its last `window` and after it (read between two pods' starts).
    let window = 25.min(args.n / 2).max(1);
    let mut hits = [pool_hits(metrics).await, None, None, None];
    for i in 0..args.n {
        match up(&mut rt, args, log_root.path(), i).await {
            Ok((pod, run, start)) => {
                pods.push(pod);
                runs.push(run);
                starts.push(start);
                for (at, slot) in [(window, 1), (args.n - window, 2), (args.n, 3)] {
                    if i + 1 == at {
                        hits[slot] = pool_hits(metrics).await;
                    }
                }
            }
            Err(e) => {
                failure = Some(e.context(format!("pod {i}")));
                break;
            }
        }
    }

    let up_steal = steal_since(ticks_before_up);
    if failure.is_none() {
        tokio::time::sleep(Duration::from_secs(args.settle)).await;
        let at = pid.and_then(footprint);
        let q = args.queries;
        let [lp, lc, lcs, lps, ps] = async {
            let lp = measure(q, |_| {
                let mut rt = rt.clone();
                async move {
                    rt.list_pod_sandbox(ListPodSandboxRequest::default())
                        .await
                        .map(drop)
                }
            })
            .await;
            let lc = measure(q, |_| {
                let mut rt = rt.clone();
                async move {
                    rt.list_containers(ListContainersRequest::default())
                        .await
                        .map(drop)
                }
            })
            .await;
            let lcs = measure(q, |_| {
                let mut rt = rt.clone();
                async move {
                    rt.list_container_stats(ListContainerStatsRequest::default())
                        .await
                        .map(drop)
                }
            })
            .await;
            let lps = measure(q, |_| {
                let mut rt = rt.clone();
                async move {
                    rt.list_pod_sandbox_stats(ListPodSandboxStatsRequest::default())
                        .await
                        .map(drop)
                }
            })
            .await;
            let ps = measure(q, |i| {
                let mut rt = rt.clone();
                let id = pods[i % pods.len()].clone();
                async move {
                    rt.pod_sandbox_status(PodSandboxStatusRequest {
                        pod_sandbox_id: id,
                        verbose: false,
                    })
                    .await
                    .map(drop)
                }
            })
            .await;
            [lp, lc, lcs, lps, ps]
        }
        .await;
        println!(
            "scale-bench: endpoint {} image {} pods {}",
            endpoint.display(),
            args.image,
            pods.len()
        );
        if let Some(steal) = up_steal {
            println!("CPU time stolen by the hypervisor during the bring-up: {steal:.1} %");
        }
        if let Some(n) = memcgs_before_up {
            println!("memory cgroups on the node before the bring-up: {n} (/proc/cgroups)");
        }
        first_last("RunPodSandbox", &runs, window);
        if let [Some(h0), Some(h1), Some(h2), Some(h3)] = hits {
            println!(
                "warm-pool hits: first {window} pods {}, last {window} pods {}, all {} of {}",
                h1 - h0,
                h3 - h2,
                h3 - h0,
                args.n
            );
        }
        first_last(
            "pod start (RunPodSandbox, CreateContainer, StartContainer)",
            &starts,
            window,
        );
        let blocks: Vec<String> = runs.chunks(window).map(|c| ms(p50(c))).collect();
        println!(
            "RunPodSandbox p50 per {window} pods (ms): {}",
            blocks.join(" ")
        );
        println!(
            "{:<22} {:>9} {:>9} {:>9}",
            "call at N (ms)", "p50", "p99", "steal %"
        );
        row("ListPodSandbox", &lp);
        row("ListContainers", &lc);
        row("ListContainerStats", &lcs);
        row("ListPodSandboxStats", &lps);
        row("PodSandboxStatus", &ps);
        if let (Some(start), Some(at)) = (before, at) {
            let pid = pid.unwrap_or_default();
            println!("agent pid {pid} at {} pods: {at}", pods.len());
            println!("agent pid {pid} at start: {start}");
        }
    }

    if args.hold > 0 {
        eprintln!(
            "scale-bench: holding {} pods for {} s at {}",
            pods.len(),
            args.hold,
            endpoint.display()
        );
        tokio::time::sleep(Duration::from_secs(args.hold)).await;
    }

    // Teardown, timed, whatever happened before.
    let t = Instant::now();
    let mut teardown_errors = 0;
    for pod in &pods {
        let stop = rt
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await;
        let remove = rt
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await;
        if stop.is_err() || remove.is_err() {
            teardown_errors += 1;
        }
    }
    println!(
        "teardown of {} pods: {:.1} s ({teardown_errors} errors)",
        pods.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(after) = pid.and_then(footprint) {
        println!("agent after teardown: {after}");
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
