//! Isolation for tests that need root: each test body runs on its own OS
//! thread that has unshared a fresh network namespace and mount namespace
//! (with `/` made private), so bridges, veths, nft tables and netns pins the
//! test creates never reach the host's. Everything the provider spawns
//! (helper threads, `nft`) inherits the thread's namespaces.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashSet;
use std::future::Future;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cubelet_engine::spec::{NamespaceMode, SandboxSpec};
use cubelet_engine::{FlowContext, SandboxId};
use cubelet_network::{BridgeConfig, BridgeNetwork, MemLeases};
use nix::mount::{umount2, MntFlags};

/// Test bridge name; it only ever exists inside a test's own namespace.
pub const BRIDGE: &str = "cbt0";

/// What a test body gets.
pub struct Env {
    pub state_dir: PathBuf,
}

/// Runs `body` in a fresh network + mount namespace, on a current-thread
/// runtime. Prints a note and passes when not running as root.
pub fn isolated<F, Fut>(body: F)
where
    F: FnOnce(Env) -> Fut + Send + 'static,
    Fut: Future<Output = Result<()>>,
{
    if !cubelet_testkit::is_root("this test (network namespaces)") {
        return;
    }
    let res = std::thread::spawn(move || -> Result<()> {
        cubelet_testkit::enter_private(cubelet_testkit::Namespaces::NetworkAndMount)
            .context("enter private network and mount namespaces")?;
        run(&["ip", "link", "set", "lo", "up"])?;
        let dir = StateDir(
            tempfile::Builder::new()
                .prefix("cubelet-net-test")
                .tempdir()?,
        );
        let state_dir = dir.0.path().to_path_buf();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(body(Env { state_dir }))
    })
    .join();
    match res {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("test failed: {e:?}"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// The test's state dir; unmounts the pin directory (a bind mount made by
/// the provider) before deleting it, also when the test panics.
struct StateDir(tempfile::TempDir);

impl Drop for StateDir {
    fn drop(&mut self) {
        for dir in ["netns", "userns"] {
            let dir = self.0.path().join(dir);
            // Pins first (a failed test may leave some), then the directory mount.
            if let Ok(rd) = std::fs::read_dir(&dir) {
                for e in rd.flatten() {
                    let _ = umount2(&e.path(), MntFlags::MNT_DETACH);
                }
            }
            let _ = umount2(&dir, MntFlags::MNT_DETACH);
        }
    }
}

/// The node address a host-network pod reports when [`fake_uplink`] is up.
pub const UPLINK_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// A stand-in "host uplink" inside the test namespace: a veth `tup0` with
/// [`UPLINK_IP`] and the default route through it. Remove it with
/// `ip link del tup0`.
pub fn fake_uplink() -> Result<()> {
    run(&[
        "ip", "link", "add", "tup0", "type", "veth", "peer", "name", "tup1",
    ])?;
    run(&[
        "ip",
        "addr",
        "add",
        &format!("{UPLINK_IP}/24"),
        "dev",
        "tup0",
    ])?;
    run(&["ip", "link", "set", "tup0", "up"])?;
    run(&["ip", "link", "set", "tup1", "up"])?;
    run(&["ip", "route", "add", "default", "via", "192.0.2.1"])?;
    Ok(())
}

/// A sandbox spec for a pod in the node's network namespace.
pub fn host_network_spec() -> SandboxSpec {
    let mut spec = SandboxSpec::default();
    spec.namespaces.network = NamespaceMode::Node;
    spec
}

/// Runs a command (in the calling thread's namespaces), failing on non-zero exit.
pub fn run(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| args.join(" "))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn config(env: &Env, subnet: &str) -> BridgeConfig {
    BridgeConfig {
        name: BRIDGE.into(),
        subnet: subnet.parse().expect("test subnet"),
        mtu: 1400,
        state_dir: env.state_dir.clone(),
    }
}

pub fn provider(env: &Env, subnet: &str) -> (Arc<BridgeNetwork>, Arc<MemLeases>) {
    let leases = Arc::new(MemLeases::new());
    let net = BridgeNetwork::new(config(env, subnet), leases.clone()).expect("valid config");
    (Arc::new(net), leases)
}

/// A sandbox id whose first characters differ between `n`s, like real ids.
pub fn sid(n: u64) -> SandboxId {
    let mut x = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    SandboxId::parse(&format!("{x:016x}{n:048x}")).expect("valid id")
}

pub fn ctx(id: &SandboxId, spec: SandboxSpec) -> FlowContext {
    FlowContext::new(id.clone(), Arc::new(spec))
}

/// Pins present under the state dir.
pub fn pins(env: &Env) -> Vec<String> {
    match std::fs::read_dir(env.state_dir.join("netns")) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// nsfs mounts in this thread's mount namespace under `dir`.
pub fn ns_mounts(dir: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
    let dir = dir.to_string_lossy();
    info.lines()
        .filter(|l| l.contains(" nsfs ") && l.contains(dir.as_ref()))
        .count()
}

/// Links in this namespace whose name starts with the veth prefix (bridge excluded).
pub fn veths() -> Result<Vec<String>> {
    let out = run(&["ip", "-o", "link", "show"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| n.starts_with("cb") && n != BRIDGE)
        .collect())
}

/// Our tagged host-port rules in the test's table.
pub fn port_rules(table: &str) -> Result<usize> {
    let out = run(&["nft", "list", "chain", "ip", table, "hostports"])?;
    Ok(out
        .lines()
        .filter(|l| l.contains("comment \"cubelet:"))
        .count())
}

/// Asserts that nothing of any sandbox is left.
pub fn assert_clean(env: &Env, leases: &MemLeases, net: &BridgeNetwork) -> Result<()> {
    assert_eq!(pins(env), Vec::<String>::new(), "netns pins left");
    assert_eq!(ns_mounts(&env.state_dir), 0, "nsfs mounts left");
    assert_eq!(veths()?, Vec::<String>::new(), "veths left");
    assert_eq!(leases.len(), 0, "leases left in store");
    assert!(net.ipam().leases().is_empty(), "leases left in ipam");
    assert_eq!(port_rules(net.nft_table())?, 0, "host-port rules left");
    Ok(())
}

/// Pings `ip` from inside the namespace pinned at `pin` (a few tries, to
/// allow for ARP and bridge port state; this is not a timing assertion).
pub fn ping_from(pin: &Path, ip: Ipv4Addr) -> Result<()> {
    let net = format!("--net={}", pin.display());
    let ip = ip.to_string();
    let mut last = None;
    for _ in 0..3 {
        match run(&["nsenter", &net, "busybox", "ping", "-c1", "-W1", &ip]) {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one try"))
}

pub fn live(ids: &[&SandboxId]) -> HashSet<SandboxId> {
    ids.iter().map(|i| (*i).clone()).collect()
}
