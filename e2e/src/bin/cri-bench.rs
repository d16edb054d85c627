//! `cri-bench`: drives N full pod lifecycles against any CRI endpoint
//! (Cubelet's socket, or containerd's own CRI plugin) at a fixed concurrency
//! and prints latency percentiles per CRI call and the throughput.
//!
//! One lifecycle: RunPodSandbox, CreateContainer + StartContainer
//! (`sleep 3600`), StopContainer, StopPodSandbox, RemovePodSandbox
//! (which removes the container with the pod).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use cubelet_e2e::cri::image_service_client::ImageServiceClient;
use cubelet_e2e::cri::runtime_service_client::RuntimeServiceClient;
use cubelet_e2e::cri::{
    CreateContainerRequest, PullImageRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};
use cubelet_e2e::{container_config, image_spec, ms, percentile, pod_config};
use futures::StreamExt;
use tonic::transport::Channel;

/// Benchmark pod lifecycles over CRI.
#[derive(Debug, Parser)]
#[command(name = "cri-bench")]
struct Args {
    /// CRI unix socket.
    #[arg(long)]
    endpoint: PathBuf,
    /// Number of pod lifecycles.
    #[arg(long, default_value_t = 50)]
    n: usize,
    /// Lifecycles in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Container image (pulled first).
    #[arg(long, default_value = "127.0.0.1:5000/busybox:test")]
    image: String,
    /// RuntimeClass handler for the pods (empty = the runtime's default).
    #[arg(long, default_value = "")]
    runtime_handler: String,
    /// Directory for pod log directories (removed afterwards).
    #[arg(long, default_value = "/tmp")]
    log_root: PathBuf,
}

const CALLS: [&str; 6] = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
];

async fn lifecycle(
    mut rt: RuntimeServiceClient<Channel>,
    args: &Args,
    log_root: &std::path::Path,
    i: usize,
) -> anyhow::Result<[Duration; 7]> {
    let start = Instant::now();
    let mut t = [Duration::ZERO; 7];
    let name = format!("bench-{}-{i}", std::process::id());
    let cfg = pod_config(&name, &format!("uid-{name}"), &log_root.join(&name));
    let mut last = Instant::now();
    let mut lap = |k: usize| {
        let now = Instant::now();
        t[k] = now - last;
        last = now;
    };
    let pod = rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: args.runtime_handler.clone(),
        })
        .await
        .context("RunPodSandbox")?
        .into_inner()
        .pod_sandbox_id;
    lap(0);
    let body = async {
        let cid = rt
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(container_config("sleep", &args.image, &["sleep", "3600"])),
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
            container_id: cid,
            timeout: 0,
        })
        .await
        .context("StopContainer")?;
        lap(3);
        anyhow::Ok(())
    }
    .await;
    // The pod is torn down even when the container part failed.
    let stop = rt
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await;
    lap(4);
    let remove = rt
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await;
    lap(5);
    body?;
    stop.context("StopPodSandbox")?;
    remove.context("RemovePodSandbox")?;
    t[6] = start.elapsed();
    Ok(t)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.n > 0 && args.concurrency > 0,
        "--n and --concurrency must be positive"
    );
    let channel = cubelet_e2e::connect(&args.endpoint).await?;
    let rt = RuntimeServiceClient::new(channel.clone());
    let mut images = ImageServiceClient::new(channel);
    let pull = Instant::now();
    images
        .pull_image(PullImageRequest {
            image: Some(image_spec(&args.image)),
            ..Default::default()
        })
        .await
        .with_context(|| format!("PullImage {}", args.image))?;
    eprintln!(
        "cri-bench: pulled {} in {} ms",
        args.image,
        ms(pull.elapsed())
    );

    let log_root = tempfile::Builder::new()
        .prefix("cri-bench-logs")
        .tempdir_in(&args.log_root)?;
    let wall = Instant::now();
    let results: Vec<anyhow::Result<[Duration; 7]>> = futures::stream::iter(0..args.n)
        .map(|i| lifecycle(rt.clone(), &args, log_root.path(), i))
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let wall = wall.elapsed();

    let mut ok: Vec<[Duration; 7]> = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(t) => ok.push(t),
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    println!(
        "cri-bench: endpoint {} image {} handler {:?} n {} concurrency {}",
        args.endpoint.display(),
        args.image,
        args.runtime_handler,
        args.n,
        args.concurrency
    );
    println!(
        "{:<18} {:>9} {:>9} {:>9} {:>9}",
        "call (ms)", "p50", "p90", "p99", "max"
    );
    for (k, name) in CALLS.iter().chain(["pod lifecycle"].iter()).enumerate() {
        let mut v: Vec<Duration> = ok.iter().map(|t| t[k]).collect();
        v.sort();
        println!(
            "{:<18} {:>9} {:>9} {:>9} {:>9}",
            name,
            ms(percentile(&v, 50.0)),
            ms(percentile(&v, 90.0)),
            ms(percentile(&v, 99.0)),
            ms(v.last().copied().unwrap_or_default())
        );
    }
    println!(
        "throughput: {:.2} pods/s ({} ok, {} failed, wall {:.2} s)",
        ok.len() as f64 / wall.as_secs_f64(),
        ok.len(),
        errors.len(),
        wall.as_secs_f64()
    );
    for e in errors.iter().take(5) {
        println!("error: {e}");
    }
    anyhow::ensure!(errors.is_empty(), "{} lifecycles failed", errors.len());
    Ok(())
}
