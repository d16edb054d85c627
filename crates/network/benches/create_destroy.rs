//! Create + destroy latency of the bridge provider: 200 sandboxes one after
//! another, then 200 with 16 in flight, then 250 created one after another
//! and kept (how create grows with the sandboxes on the bridge: the p50 of
//! the first and the last 25, and of every 25), on a 2-worker runtime
//! inside a private network and mount namespace (the host is not touched).
//! Prints p50/p99/max; asserts nothing.
//!
//! Run with `cargo bench -p cubelet-network` (needs root).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cubelet_engine::spec::SandboxSpec;
use cubelet_engine::{Flow, FlowContext, SandboxId};
use cubelet_network::{BridgeConfig, BridgeNetwork, MemLeases};
use nix::mount::{umount2, MntFlags};

const N: usize = 200;
const IN_FLIGHT: usize = 16;
/// Sandboxes the last phase keeps, and its window.
const KEPT: usize = 250;
const EDGE: usize = 25;

fn main() {
    if !cubelet_testkit::is_root("create_destroy bench") {
        return;
    }
    let res = std::thread::spawn(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        cubelet_testkit::enter_private(cubelet_testkit::Namespaces::NetworkAndMount)?;
        let dir = tempfile::Builder::new()
            .prefix("cubelet-net-bench")
            .tempdir()?;
        let rt = // Workers are spawned from this thread, so they share its
        // private namespaces.
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let out = rt.block_on(run(dir.path().to_path_buf()));
        drop(rt);
        let _ = umount2(&dir.path().join("netns"), MntFlags::MNT_DETACH);
        out
    })
    .join();
    match res {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
        Err(_) => {
            eprintln!("bench thread panicked");
            std::process::exit(1);
        }
    }
}

async fn run(
    state_dir: std::path::PathBuf,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let cfg = BridgeConfig {
        name: "cbb0".into(),
        subnet: "10.90.0.0/16".parse()?,
        mtu: 1500,
        state_dir,
    };
    let net = Arc::new(BridgeNetwork::new(cfg, Arc::new(MemLeases::new()))?);
    net.init().await?;

    let mut create = Vec::with_capacity(N);
    let mut destroy = Vec::with_capacity(N);
    for n in 0..N {
        let c = ctx(n);
        let t = Instant::now();
        net.create(&c).await?;
        create.push(t.elapsed());
        let t = Instant::now();
        net.destroy(&c).await?;
        destroy.push(t.elapsed());
    }
    report("sequential create", &mut create);
    report("sequential destroy", &mut destroy);

    let mut both = Vec::with_capacity(N);
    let started = Instant::now();
    for chunk in (0..N).collect::<Vec<_>>().chunks(IN_FLIGHT) {
        let runs = chunk.iter().map(|&n| {
            let net = Arc::clone(&net);
            tokio::spawn(async move {
                let c = ctx(N + n);
                let t = Instant::now();
                net.create(&c).await?;
                net.destroy(&c).await?;
                Ok::<_, cubelet_engine::StepError>(t.elapsed())
            })
        });
        for r in futures::future::join_all(runs).await {
            both.push(r??);
        }
    }
    let wall = started.elapsed();
    report(&format!("create+destroy, {IN_FLIGHT} in flight"), &mut both);
    println!(
        "{N} sandboxes with {IN_FLIGHT} in flight: {:.1} sandboxes/s",
        N as f64 / wall.as_secs_f64()
    );

    let kept: Vec<FlowContext> = (0..KEPT).map(|n| ctx(2 * N + n)).collect();
    let mut create = Vec::with_capacity(KEPT);
    for c in &kept {
        let t = Instant::now();
        net.create(c).await?;
        create.push(t.elapsed());
    }
    let (first, last) = (p50(&create[..EDGE]), p50(&create[KEPT - EDGE..]));
    println!(
        "create with {KEPT} kept, p50: first {EDGE} {first:.2?}, last {EDGE} {last:.2?} (ratio {:.2})",
        last.as_secs_f64() / first.as_secs_f64()
    );
    let per: Vec<String> = create
        .chunks(EDGE)
        .map(|c| format!("{:.2}", p50(c).as_secs_f64() * 1e3))
        .collect();
    println!("create p50 per {EDGE} kept (ms): {}", per.join(" "));
    for c in &kept {
        net.destroy(c).await?;
    }
    Ok(())
}

fn ctx(n: usize) -> FlowContext {
    let id = SandboxId::new_unchecked(format!(
        "{:011x}{:053x}",
        n.wrapping_mul(0x9e37_79b9) & 0xfff_ffff_ffff,
        n
    ));
    FlowContext::new(id, Arc::new(SandboxSpec::default()))
}

/// The `q` quantile (0 to 1) of `sorted`, which is sorted and not empty.
fn pick(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

/// The median of `samples` (not empty), in any order.
fn p50(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    pick(&sorted, 0.5)
}

fn report(what: &str, samples: &mut [Duration]) {
    samples.sort();
    println!(
        "{what:<40} n={:<4} p50={:>8.2?} p99={:>8.2?} max={:>8.2?}",
        samples.len(),
        pick(samples, 0.50),
        pick(samples, 0.99),
        pick(samples, 1.0)
    );
}
