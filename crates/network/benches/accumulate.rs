//! How the bridge provider's create grows with the sandboxes it holds: 250
//! sandboxes created one after another and kept, then all destroyed, on a
//! 2-worker runtime inside a private network and mount namespace (the host
//! is not touched), with no containers. Prints the create p50 of the first
//! and the last 25; asserts nothing.
//!
//! Run with `cargo bench -p cubelet-network` (needs root).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cubelet_engine::spec::SandboxSpec;
use cubelet_engine::{Flow, FlowContext, SandboxId};
use cubelet_network::{BridgeConfig, BridgeNetwork, MemLeases};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

const N: usize = 250;
const EDGE: usize = 25;

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("accumulate bench SKIPPED: needs root");
        return;
    }
    let res = std::thread::spawn(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        unshare(CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWNS)?;
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )?;
        let dir = tempfile::Builder::new()
            .prefix("cubelet-net-accum")
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
        name: "cba0".into(),
        subnet: "10.91.0.0/16".parse()?,
        mtu: 1500,
        state_dir,
    };
    let net = Arc::new(BridgeNetwork::new(cfg, Arc::new(MemLeases::new()))?);
    net.init().await?;
    let mut create = Vec::with_capacity(N);
    for n in 0..N {
        let t = Instant::now();
        net.create(&ctx(n)).await?;
        create.push(t.elapsed());
    }
    let p50 = |s: &[Duration]| {
        let mut s = s.to_vec();
        s.sort();
        s[s.len() / 2]
    };
    let first = p50(&create[..EDGE]);
    let last = p50(&create[N - EDGE..]);
    println!(
        "create p50: first {EDGE} {first:.2?}, last {EDGE} {last:.2?} (ratio {:.2})",
        last.as_secs_f64() / first.as_secs_f64()
    );
    let per: Vec<String> = create
        .chunks(EDGE)
        .map(|c| format!("{:.2}", p50(c).as_secs_f64() * 1e3))
        .collect();
    println!("create p50 per {EDGE} (ms): {}", per.join(" "));
    for n in 0..N {
        net.destroy(&ctx(n)).await?;
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
