//! Create and destroy latency of the bridge provider next to the CNI
//! provider (Debian's bridge + host-local + portmap plugins from
//! /usr/lib/cni): 200 sandboxes one after another with each, on a 2-worker
//! runtime inside a private network and mount namespace (the host is not
//! touched). Prints p50/p99/max and the create p50 ratio; asserts nothing.
//!
//! Run with `cargo bench -p cubelet-network --bench cni_vs_bridge` (needs root).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubelet_engine::spec::SandboxSpec;
use cubelet_engine::{Flow, FlowContext, SandboxId};
use cubelet_network::{BridgeConfig, BridgeNetwork, CniConfig, CniNetwork, MemLeases};
use nix::mount::{umount2, MntFlags};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const N: usize = 200;
const PLUGINS: &str = "/usr/lib/cni";

fn main() {
    if !cubelet_testkit::is_root("cni_vs_bridge bench") {
        return;
    }
    if ["bridge", "host-local", "portmap"]
        .iter()
        .any(|p| !Path::new(PLUGINS).join(p).exists())
    {
        eprintln!("cni_vs_bridge bench SKIPPED: CNI plugins not installed in {PLUGINS}");
        return;
    }
    let res = std::thread::spawn(|| -> Result<(), BoxError> {
        cubelet_testkit::enter_private(cubelet_testkit::Namespaces::NetworkAndMount)?;
        let dir = tempfile::Builder::new()
            .prefix("cubelet-net-bench")
            .tempdir()?;
        // Workers are spawned from this thread, so they (and the plugins
        // they start) share its private namespaces.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let out = rt.block_on(run(dir.path()));
        drop(rt);
        for sub in ["bridge/netns", "cni/netns"] {
            let _ = umount2(&dir.path().join(sub), MntFlags::MNT_DETACH);
        }
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

async fn run(dir: &Path) -> Result<(), BoxError> {
    let bridge = BridgeNetwork::new(
        BridgeConfig {
            name: "cbb0".into(),
            subnet: "10.90.0.0/16".parse()?,
            mtu: 1500,
            state_dir: dir.join("bridge"),
        },
        Arc::new(MemLeases::new()),
    )?;
    bridge.init().await?;

    let conf_dir = dir.join("net.d");
    std::fs::create_dir_all(&conf_dir)?;
    let conf = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "cnibench",
        "plugins": [
            {
                "type": "bridge", "bridge": "cnib0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "subnet": "10.204.0.0/16",
                         "dataDir": dir.join("ipam"), "routes": [{"dst": "0.0.0.0/0"}]}
            },
            {"type": "portmap", "capabilities": {"portMappings": true}, "snat": false}
        ]
    });
    std::fs::write(conf_dir.join("10-cnibench.conflist"), conf.to_string())?;
    let cni = CniNetwork::new(CniConfig {
        bin_dirs: vec![PathBuf::from(PLUGINS)],
        conf_dir,
        state_dir: dir.join("cni"),
        cache_dir: dir.join("cni-cache"),
    })?;
    cni.init().await?;

    let (mut b_create, mut b_destroy) = measure(&bridge, 0).await?;
    let (mut c_create, mut c_destroy) = measure(&cni, N).await?;
    let b50 = report("bridge create", &mut b_create);
    report("bridge destroy", &mut b_destroy);
    let c50 = report("cni create (bridge+host-local+portmap)", &mut c_create);
    report("cni destroy", &mut c_destroy);
    println!(
        "create p50: bridge {b50:.2?} vs cni {c50:.2?} -> bridge is {:.1}x faster",
        c50.as_secs_f64() / b50.as_secs_f64()
    );
    Ok(())
}

/// `N` sequential create+destroy rounds; returns create and destroy samples.
async fn measure(net: &dyn Flow, base: usize) -> Result<(Vec<Duration>, Vec<Duration>), BoxError> {
    let mut create = Vec::with_capacity(N);
    let mut destroy = Vec::with_capacity(N);
    for n in 0..N {
        let c = ctx(base + n);
        let t = Instant::now();
        net.create(&c).await?;
        create.push(t.elapsed());
        let t = Instant::now();
        net.destroy(&c).await?;
        destroy.push(t.elapsed());
    }
    Ok((create, destroy))
}

fn ctx(n: usize) -> FlowContext {
    let id = SandboxId::new_unchecked(format!(
        "{:011x}{:053x}",
        n.wrapping_mul(0x9e37_79b9) & 0xfff_ffff_ffff,
        n
    ));
    let spec = SandboxSpec {
        name: format!("bench-{n}"),
        namespace: "bench".into(),
        uid: format!("uid-{n}"),
        ..SandboxSpec::default()
    };
    FlowContext::new(id, Arc::new(spec))
}

/// Prints and returns the median.
fn report(what: &str, samples: &mut [Duration]) -> Duration {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{what:<40} n={:<4} p50={:>8.2?} p99={:>8.2?} max={:>8.2?}",
        samples.len(),
        pick(0.50),
        pick(0.99),
        pick(1.0)
    );
    pick(0.50)
}
