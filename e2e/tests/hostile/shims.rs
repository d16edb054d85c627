//! Fake shims: from inside a real pod, two processes whose command line is
//! a containerd shim's of the daemon's own namespace
//! (`containerd-shim-runc-v2 -namespace <ns> -id fake-… -address …`, a
//! static binary run with `exec -a`), one in a directory whose `address` is
//! a FIFO, one whose `address` is a symlink to `/dev/zero`.
//!
//! Once they are old enough to be orphan candidates (10 s): `cubelet ctl gc`
//! answers within 10 s, the daemon's RSS stays within 20 % of before,
//! SIGTERM stops it within 10 s (exit 0), a restart becomes ready, and both
//! fakes are still running throughout (they are not the agent's: its shim
//! ledger never recorded them). Before the fix the reaper took them for
//! shims by their arguments and opened `/proc/<pid>/cwd/address` as root on
//! an async worker: the FIFO blocked the GC pass for ever (`ctl gc` never
//! answered, SIGTERM was not enough, the restart hung in its reconcile and
//! never became ready), `/dev/zero` was read without end.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use cubelet_e2e::cri::Mount;
use cubelet_e2e::{
    container_config, rss_kib, with_daemon, workspace_root, Daemon, DaemonOpts, REGISTRY,
};

fn fakes(d: &Daemon) -> Vec<(u32, String)> {
    cubelet_e2e::shims(&d.namespace)
        .into_iter()
        .filter(|(_, id)| id.starts_with("fake-"))
        .collect()
}

async fn fake_shims_are_left_alone(d: &Daemon) -> anyhow::Result<()> {
    let image = format!("{REGISTRY}/busybox:test");
    let fake = workspace_root().join("target/cubelet-pause");
    ensure!(
        fake.exists(),
        "{} missing (hack/build-pause.sh)",
        fake.display()
    );
    let ns = &d.namespace;
    let script = format!(
        "busybox mkdir -p /tmp/fifo /tmp/zero; busybox mkfifo /tmp/fifo/address; \
         busybox ln -s /dev/zero /tmp/zero/address; \
         (cd /tmp/fifo && exec -a containerd-shim-runc-v2 /fake-shim -namespace {ns} -id fake-fifo \
            -address /run/containerd/containerd.sock) & \
         (cd /tmp/zero && exec -a containerd-shim-runc-v2 /fake-shim -namespace {ns} -id fake-zero \
            -address /run/containerd/containerd.sock) & \
         exec sleep 3600"
    );
    let mut cfg = container_config("faker", &image, &["sh", "-c", &script]);
    cfg.mounts = vec![Mount {
        container_path: "/fake-shim".into(),
        host_path: fake.display().to_string(),
        readonly: true,
        ..Default::default()
    }];
    let (_pod, _cid) = d.pod_with("fake-shims", cfg).await?;
    let started =
        cubelet_e2e::eventually("both fake shims run", Duration::from_secs(20), || async {
            Ok(fakes(d).len() == 2)
        })
        .await;
    if let Err(e) = started {
        let log = cubelet_e2e::run(
            "sh",
            &[
                "-c",
                &format!("cat $(find {} -name 'faker*.log')", d.log_base.display()),
            ],
        )
        .await
        .unwrap_or_default();
        anyhow::bail!("{e:#}; the pod's log: {log}");
    }
    let before: Vec<u32> = fakes(d).iter().map(|(p, _)| *p).collect();
    // Orphan candidates are at least 10 s old.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let pid = d.pid().context("daemon not running")?;
    let rss_before = rss_kib(pid)?;

    let t = Instant::now();
    let gc = tokio::time::timeout(Duration::from_secs(10), d.ctl(&["gc"]))
        .await
        .context("cubelet ctl gc did not answer within 10 s")??;
    println!("ctl gc answered in {:?}: {}", t.elapsed(), gc.trim());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_after = rss_kib(pid)?;
    println!("daemon RSS {rss_before} KiB before, {rss_after} KiB after the GC pass");
    ensure!(
        rss_after * 10 <= rss_before * 12,
        "RSS grew by more than 20 %: {rss_before} -> {rss_after} KiB"
    );
    let now: Vec<u32> = fakes(d).iter().map(|(p, _)| *p).collect();
    ensure!(
        now == before,
        "the fake shims were touched: {before:?} -> {now:?}"
    );

    let t = Instant::now();
    let code = tokio::time::timeout(Duration::from_secs(10), d.stop())
        .await
        .context("SIGTERM did not stop the daemon within 10 s")??;
    println!("SIGTERM: exit {code:?} after {:?}", t.elapsed());
    ensure!(code == Some(0), "daemon exited with {code:?} on SIGTERM");

    let t = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), d.start_with_env(&[]))
        .await
        .context("the restarted daemon was not ready within 60 s")??;
    println!("restart ready after {:?}", t.elapsed());
    let now: Vec<u32> = fakes(d).iter().map(|(p, _)| *p).collect();
    ensure!(
        now == before,
        "the fake shims were touched by the restart: {before:?} -> {now:?}"
    );
    d.remove_all().await?;
    cubelet_e2e::eventually(
        "the fakes end with their pod",
        Duration::from_secs(20),
        || async { Ok(fakes(d).is_empty()) },
    )
    .await
}

#[tokio::test]
async fn fake_shims_with_a_fifo_or_dev_zero_address() {
    with_daemon(
        DaemonOpts::default(),
        Duration::from_secs(300),
        |d: &Daemon| Box::pin(fake_shims_are_left_alone(d)),
    )
    .await;
}
