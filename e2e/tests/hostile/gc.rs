//! GC by absence: what is not Cubelet's survives its garbage collector.
//!
//! Beside a live daemon, with `ctr` (another containerd client, as a second
//! runtime or an operator would be):
//! - a running container in a containerd namespace Cubelet does not own;
//! - a running container inside Cubelet's own namespace without Cubelet's
//!   owner mark (`io.cubelet.runtime/owner=cubelet`), with an id in
//!   Cubelet's own format, so only the mark tells it apart;
//! - a file in Cubelet's netns pin directory whose name is not in Cubelet's
//!   id format (what a CNI plugin or `ip netns` might leave there).
//!
//! Two `cubelet ctl gc` passes leave all three, while a marked orphan made
//! the same way is removed (the passes did run and did collect). Before the
//! fix the GC removed every container of its namespace the store did not
//! name and every file in the pin directory that was not a live sandbox's:
//! the unmarked container and the foreign file went in the first pass.

use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::{run, with_daemon, Daemon, DaemonOpts, REGISTRY};

/// `ctr` against the test containerd in namespace `ns`.
async fn ctr_in(d: &Daemon, ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let sock = d.containerd.display().to_string();
    let mut full = vec!["--address", sock.as_str(), "-n", ns];
    full.extend_from_slice(args);
    run("ctr", &full).await
}

/// Starts a `sleep` container `id` in namespace `ns` with `labels`
/// (`key=value`), without a cgroup path and in the node's network
/// namespace, so it leaves nothing outside containerd.
async fn run_sleeper(d: &Daemon, ns: &str, id: &str, labels: &[&str]) -> anyhow::Result<()> {
    let image = format!("{REGISTRY}/busybox:test");
    ctr_in(d, ns, &["images", "pull", "--plain-http", &image]).await?;
    let mut args = vec!["run", "-d", "--cgroup", "", "--net-host"];
    for l in labels {
        args.extend(["--label", l]);
    }
    args.extend([image.as_str(), id, "sleep", "1000"]);
    ctr_in(d, ns, &args).await?;
    Ok(())
}

/// Whether namespace `ns` has a running task `id`, and a container and a
/// snapshot of that id.
async fn present(d: &Daemon, ns: &str, id: &str) -> anyhow::Result<(bool, bool, bool)> {
    let tasks = ctr_in(d, ns, &["tasks", "ls"]).await?;
    let running = tasks
        .lines()
        .any(|l| l.starts_with(id) && l.contains("RUNNING"));
    let containers = ctr_in(d, ns, &["containers", "ls", "-q"]).await?;
    let snapshots = ctr_in(d, ns, &["snapshots", "ls"]).await?;
    Ok((
        running,
        containers.lines().any(|l| l.trim() == id),
        snapshots.lines().any(|l| l.starts_with(id)),
    ))
}

/// Removes container `id` of `ns` (task, record, snapshot); absent is fine.
async fn remove_sleeper(d: &Daemon, ns: &str, id: &str) {
    let _ = ctr_in(d, ns, &["tasks", "kill", "-s", "SIGKILL", id]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = ctr_in(d, ns, &["tasks", "rm", "-f", id]).await;
    let _ = ctr_in(d, ns, &["containers", "rm", id]).await;
    let _ = ctr_in(d, ns, &["snapshots", "rm", id]).await;
}

/// Empties and removes namespace `ns`.
async fn remove_namespace(d: &Daemon, ns: &str) -> anyhow::Result<()> {
    let list = |s: String| -> Vec<String> {
        s.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    };
    for c in ctr_in(d, ns, &["containers", "ls", "-q"])
        .await
        .map(list)
        .unwrap_or_default()
    {
        remove_sleeper(d, ns, &c).await;
    }
    let images = ctr_in(d, ns, &["images", "ls", "-q"])
        .await
        .map(list)
        .unwrap_or_default();
    if !images.is_empty() {
        let mut args = vec!["images", "rm", "--sync"];
        args.extend(images.iter().map(String::as_str));
        ctr_in(d, ns, &args).await?;
    }
    for l in ctr_in(d, ns, &["leases", "ls", "-q"])
        .await
        .map(list)
        .unwrap_or_default()
    {
        let _ = ctr_in(d, ns, &["leases", "rm", &l]).await;
    }
    // Snapshots: children before parents; repeat until none is left.
    for _ in 0..20 {
        let snaps: Vec<String> = ctr_in(d, ns, &["snapshots", "ls"])
            .await
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        if snaps.is_empty() {
            break;
        }
        for key in snaps {
            let _ = ctr_in(d, ns, &["snapshots", "rm", &key]).await;
        }
    }
    for c in ctr_in(d, ns, &["content", "ls", "-q"])
        .await
        .map(list)
        .unwrap_or_default()
    {
        let _ = ctr_in(d, ns, &["content", "rm", &c]).await;
    }
    let sock = d.containerd.display().to_string();
    let mut last = None;
    for _ in 0..10 {
        match run("ctr", &["--address", &sock, "namespaces", "rm", ns]).await {
            Ok(_) => return Ok(()),
            Err(e) if format!("{e:#}").contains("not found") => return Ok(()),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("namespace {ns} not removed")))
}

struct Foreign {
    namespace: String,
    /// In the foreign namespace.
    other_runtime: String,
    /// In Cubelet's namespace, without the mark.
    unmarked: String,
    /// In Cubelet's namespace, with the mark: the GC's to take.
    marked: String,
    stray: std::path::PathBuf,
}

async fn attack(d: &Daemon, f: &Foreign) -> anyhow::Result<()> {
    let ns = &d.namespace;
    run_sleeper(d, &f.namespace, &f.other_runtime, &[]).await?;
    run_sleeper(d, ns, &f.unmarked, &[]).await?;
    run_sleeper(d, ns, &f.marked, &["io.cubelet.runtime/owner=cubelet"]).await?;
    let pins = f.stray.parent().context("pin dir")?;
    std::fs::create_dir_all(pins)?;
    std::fs::write(&f.stray, b"")?;
    for (ns, id) in [
        (f.namespace.as_str(), &f.other_runtime),
        (ns.as_str(), &f.unmarked),
        (ns.as_str(), &f.marked),
    ] {
        ensure!(
            present(d, ns, id).await? == (true, true, true),
            "{ns}/{id} should run before the GC"
        );
    }

    for pass in 1..=2 {
        let out = tokio::time::timeout(Duration::from_secs(30), d.ctl(&["gc"]))
            .await
            .context("cubelet ctl gc did not answer")??;
        println!("gc pass {pass}: {}", out.trim());
    }

    let other = present(d, &f.namespace, &f.other_runtime).await?;
    println!("other runtime's container (running, record, snapshot): {other:?}");
    ensure!(
        other == (true, true, true),
        "the container in namespace {} was touched: {other:?}",
        f.namespace
    );
    let unmarked = present(d, ns, &f.unmarked).await?;
    println!("unmarked container in Cubelet's namespace: {unmarked:?}");
    ensure!(
        unmarked == (true, true, true),
        "the unmarked container in {ns} was touched: {unmarked:?}"
    );
    ensure!(
        f.stray.exists(),
        "the foreign file {} in the pin directory was removed",
        f.stray.display()
    );
    let marked = present(d, ns, &f.marked).await?;
    println!("marked orphan: {marked:?}");
    ensure!(
        marked == (false, false, false),
        "the marked orphan was not reclaimed: {marked:?}"
    );
    // The unmarked one is not the daemon's to clean up either: the test's.
    remove_sleeper(d, ns, &f.unmarked).await;
    ensure!(
        present(d, ns, &f.unmarked).await? == (false, false, false),
        "could not remove the test's unmarked container"
    );
    std::fs::remove_file(&f.stray)?;
    Ok(())
}

async fn foreign_objects_survive(d: &Daemon) -> anyhow::Result<()> {
    let f = Foreign {
        namespace: format!("{}-foreign", d.namespace),
        other_runtime: format!("{:0>64}", "f0e1"),
        unmarked: format!("{:0>64}", "0dd1"),
        marked: format!("{:0>64}", "0dd2"),
        stray: d.state_dir.join("netns").join("cni-hostile-gc"),
    };
    let result = attack(d, &f).await;
    // Whatever happened, nothing the test made is left.
    remove_sleeper(d, &d.namespace, &f.unmarked).await;
    remove_sleeper(d, &d.namespace, &f.marked).await;
    let _ = std::fs::remove_file(&f.stray);
    let removed = remove_namespace(d, &f.namespace).await;
    result?;
    removed
}

#[tokio::test]
async fn foreign_containers_and_pins_survive_a_gc_pass() {
    with_daemon(
        DaemonOpts {
            index: 44,
            ..Default::default()
        },
        Duration::from_secs(240),
        |d: &Daemon| Box::pin(foreign_objects_survive(d)),
    )
    .await;
}
