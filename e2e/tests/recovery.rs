//! Crash recovery and garbage collection against the real daemon.
//!
//! 1. kill -9 in the middle of a create flow (held after the storage and
//!    network steps by a test failpoint), restart, and check the half-built
//!    sandbox is undone and nothing leaks: no netns pin, veth, lease, mount,
//!    sandbox directory, containerd object or store record.
//! 2. Orphans of every kind the GC knows (sandbox directory with a tmpfs
//!    mount, netns pin, veth on the bridge, IP lease, journal entries and a
//!    running containerd container with its task and rootfs snapshot, all of
//!    a sandbox the store does not know) are reclaimed and counted in
//!    `cubelet_gc_reclaimed_total{kind}`.
//! 3. A cleanup that keeps failing (a test failpoint fails the storage
//!    cleanup three times) is retried by the GC with a doubling backoff until
//!    it succeeds, and the sandbox is gone.
//! 4. With a GC pass every 50 ms, pods created one after another all come up
//!    whole: no pass takes the directory, netns or lease of a sandbox whose
//!    create began during it.
//!
//! 5. A shim process of the daemon's containerd namespace that the daemon's
//!    shim ledger records (as it records each shim it starts) and whose id
//!    containerd has no task for (what a kill -9 mid-create used to leave
//!    behind) is stopped by the GC and counted as `kind="shim"`; a shim
//!    whose id is a live task is left alone, and so is a process with a
//!    shim's command line the ledger does not record. Two orphans: a real `containerd-shim-runc-v2`
//!    started as containerd starts one (`start` in a bundle), its bundle then
//!    deleted as a rolled-back create leaves it, is stopped by its own ttrpc
//!    `Shutdown` and its socket file removed; a stand-in that has no socket
//!    (Debian's python3 with the command line of
//!    `containerd-shim-runc-v2 -namespace <ns> -id <id>`) is stopped by its
//!    pid. The daemon's log says which way each went.
//!
//! Without the private containerd both print SKIP and pass.

use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{
    ListPodSandboxRequest, PodSandboxStatusRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StopPodSandboxRequest,
};
use cubelet_e2e::{eventually, http_get, pod_config, run, Daemon, DaemonOpts, REGISTRY};
use cubelet_engine::{FlowKind, FlowStart, FlowState, Journal, SandboxId, SandboxSpec};
use cubelet_store::{IpLease, Store};

const GC_FAST: &str = "gc: { interval: 1s }\n";

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn pods(d: &Daemon) -> anyhow::Result<usize> {
    let mut rt = d.runtime.clone();
    Ok(rt
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await?
        .into_inner()
        .items
        .len())
}

async fn kill_mid_create(d: &Daemon) -> anyhow::Result<()> {
    // Hold every create after its storage step: the sandbox directory,
    // shm mount, netns, veth and lease all exist when the agent dies.
    d.stop().await?;
    d.start_with_env(&[("CUBELET_TEST_FAILPOINTS", "storage.create=sleep:300s")])
        .await?;
    let mut rt = d.runtime.clone();
    let config = pod_config("crash-pod", "uid-crash-pod", &d.log_base.join("crash-pod"));
    let create = tokio::spawn(async move {
        rt.run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        })
        .await
    });
    let netns_dir = d.state_dir.join("netns");
    let sandboxes_dir = d.root_dir.join("sandboxes");
    // The pod's, not a warm-pool shell's (listed first, the shells asked
    // after, as the agent's GC does): a pod that claimed a shell took its
    // id and is a shell no more.
    let pod_dir = || async {
        let dirs = entries(&sandboxes_dir);
        let shells = d.shells().await?;
        anyhow::Ok(
            dirs.into_iter()
                .find(|id| !shells.contains(id) && netns_dir.join(id).exists()),
        )
    };
    eventually(
        "storage and network steps done",
        Duration::from_secs(60),
        || async { Ok(pod_dir().await?.is_some()) },
    )
    .await?;
    let id = pod_dir().await?.context("no sandbox dir")?;
    println!("killing the agent in the middle of create of {id}");
    d.kill9().await?;
    let _ = create.await; // the call fails: its server died
    ensure!(
        netns_dir.join(&id).exists(),
        "netns pin should survive the crash"
    );

    // Restart without the failpoint: recovery destroys what the create built,
    // reconciliation marks the record, the GC removes the rest.
    d.start_with_env(&[]).await?;
    // The GC removes the record; its pass counts it when it ends.
    eventually(
        "half-built sandbox gone and counted by the GC",
        Duration::from_secs(60),
        || async {
            let metrics = http_get(d.metrics, "/metrics").await?.1;
            Ok(!netns_dir.join(&id).exists()
                && !sandboxes_dir.join(&id).exists()
                && pods(d).await? == 0
                && sample(&metrics, "cubelet_gc_reclaimed_total{kind=\"sandbox\"}") > 0.0)
        },
    )
    .await?;
    Ok(())
}

async fn gc_reclaims_orphans(d: &Daemon) -> anyhow::Result<()> {
    let ghost = SandboxId::parse(&format!("{:0>64}", "deadbeef")).context("id")?;
    let ghost_str = ghost.as_str().to_owned();
    // Store records of a sandbox the store does not know: a lease and a
    // settled flow. Written while the agent is stopped (redb is exclusive).
    d.stop().await?;
    {
        let store = Store::open(&d.root_dir.join("cubelet.redb"))?;
        // An address of the test /24 that no pod holds.
        let [a, b, c, _] = d.subnet.octets();
        let ip = IpAddr::from([a, b, c, 250]);
        store.add_lease(&IpLease {
            ip,
            sandbox_id: ghost.clone(),
            pool: d.bridge.clone(),
            allocated_at: SystemTime::now(),
        })?;
        let spec = SandboxSpec::default();
        let flow = store.begin(FlowStart {
            kind: FlowKind::Create,
            sandbox_id: &ghost,
            spec: &spec,
            compensates: None,
            durable: true,
        })?;
        store.finish(flow, FlowState::Succeeded, None)?;
    }
    // Kernel and file orphans.
    let dir = d.root_dir.join("sandboxes").join(&ghost_str);
    std::fs::create_dir_all(dir.join("shm"))?;
    std::fs::write(dir.join("hostname"), "ghost\n")?;
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=1m",
            "tmpfs",
            &dir.join("shm").display().to_string(),
        ],
    )
    .await?;
    let pin = d.state_dir.join("netns").join(&ghost_str);
    std::fs::create_dir_all(pin.parent().context("pin dir")?)?;
    std::fs::write(&pin, "")?;
    run("unshare", &[&format!("--net={}", pin.display()), "true"]).await?;
    let veth = format!("cb{}", &ghost_str[..11]);
    run(
        "ip",
        &[
            "link",
            "add",
            &veth,
            "type",
            "veth",
            "peer",
            "name",
            "cbghostpeer",
        ],
    )
    .await?;
    run("ip", &["link", "set", &veth, "master", &d.bridge]).await?;
    // Containerd objects: a running container of the ghost sandbox (its
    // infra container id), with its task and rootfs snapshot. No cgroup path,
    // so runc leaves no parent cgroup behind. It carries Cubelet's owner
    // mark, as every container the daemon makes does: the GC removes only
    // marked objects (hostile/gc.rs checks that unmarked ones stay).
    let image = format!("{REGISTRY}/busybox:test");
    d.ctr(&["images", "pull", "--plain-http", &image]).await?;
    d.ctr(&[
        "run",
        "-d",
        "--cgroup",
        "",
        "--net-host",
        "--label",
        "io.cubelet.runtime/owner=cubelet",
        &image,
        &ghost_str,
        "sleep",
        "1000",
    ])
    .await?;
    ensure!(
        d.ctr(&["tasks", "ls", "-q"]).await?.contains(&ghost_str),
        "the orphan task should run"
    );

    d.start_with_env(&[]).await?;
    eventually("orphans reclaimed", Duration::from_secs(60), || async {
        let links = run("ip", &["-o", "link", "show"]).await?;
        let containers = d.ctr(&["containers", "ls", "-q"]).await?;
        let snapshots = d.ctr(&["snapshots", "ls"]).await?;
        Ok(!dir.exists()
            && !pin.exists()
            && !links.contains(&veth)
            && !containers.contains(&ghost_str)
            && !snapshots.contains(&ghost_str))
    })
    .await?;
    ensure!(
        !d.ctr(&["tasks", "ls", "-q"]).await?.contains(&ghost_str),
        "the orphan task is left"
    );
    // A pass counts what it reclaimed when it ends.
    let kinds = [
        "directory",
        "mount",
        "netns",
        "veth",
        "lease",
        "journal",
        "container",
        "task",
        "snapshot",
    ];
    let uncounted = || async {
        let metrics = http_get(d.metrics, "/metrics").await?.1;
        Ok::<_, anyhow::Error>(
            kinds
                .iter()
                // Every kind's series exists from the start at 0: a kind
                // counts once its value is above 0.
                .filter(|k| {
                    sample(
                        &metrics,
                        &format!("cubelet_gc_reclaimed_total{{kind=\"{k}\"}}"),
                    ) == 0.0
                })
                .map(|k| (*k).to_owned())
                .collect::<Vec<_>>(),
        )
    };
    let waited = eventually("every kind counted", Duration::from_secs(30), || async {
        Ok(uncounted().await?.is_empty())
    })
    .await;
    if waited.is_err() {
        bail!(
            "not counted in cubelet_gc_reclaimed_total: {:?}",
            uncounted().await?
        );
    }
    // The store's orphan records are gone too.
    d.stop().await?;
    {
        let store = Store::open(&d.root_dir.join("cubelet.redb"))?;
        ensure!(
            store
                .list_all_leases()?
                .iter()
                .all(|l| l.sandbox_id != ghost),
            "lease of the ghost left"
        );
        ensure!(
            store.sandbox_history(&ghost)?.is_empty(),
            "journal of the ghost left"
        );
    }
    d.start_with_env(&[]).await?;
    Ok(())
}

/// A process whose command line is a containerd v2 shim's for `id` in the
/// daemon's namespace; it does nothing but sleep.
fn fake_shim(d: &Daemon, id: &str) -> anyhow::Result<tokio::process::Child> {
    // Debian's interpreter itself (a wrapper such as pyenv's would re-exec
    // and lose the command line).
    tokio::process::Command::new("/usr/bin/python3")
        .arg0("containerd-shim-runc-v2")
        .args(["-c", "import time; time.sleep(600)"])
        .args([
            "-namespace",
            &d.namespace,
            "-id",
            id,
            "-address",
            "/nonexistent",
        ])
        .kill_on_drop(true)
        .spawn()
        .context("spawn a stand-in shim")
}

/// A real runc v2 shim for `id` in the daemon's namespace, started as
/// containerd starts one (`start` in a bundle holding a `config.json` and
/// the `log` fifo), its bundle then deleted; its pid and socket, and the
/// reader of its log fifo.
async fn real_orphan_shim(
    d: &Daemon,
    id: &str,
) -> anyhow::Result<(u32, std::path::PathBuf, tokio::process::Child)> {
    let bundle = d.root_dir.join(format!("shim-bundle-{id}"));
    std::fs::create_dir_all(&bundle)?;
    std::fs::write(bundle.join("config.json"), "{}")?;
    nix::unistd::mkfifo(&bundle.join("log"), nix::sys::stat::Mode::S_IRWXU)?;
    // The shim opens the fifo for writing; someone must read it.
    let copy = d.root_dir.join(format!("shim-{id}.log"));
    let reader = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("exec cat log >{}", copy.display()))
        .current_dir(&bundle)
        .kill_on_drop(true)
        .spawn()
        .context("spawn the shim log reader")?;
    let out = tokio::process::Command::new("containerd-shim-runc-v2")
        .args(["-namespace", &d.namespace, "-id", id, "-address"])
        .arg(&d.containerd)
        .args(["-publish-binary", "/usr/bin/containerd", "start"])
        .current_dir(&bundle)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("containerd-shim-runc-v2 start")?;
    ensure!(
        out.status.success(),
        "shim start: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let address = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let socket = std::path::PathBuf::from(
        address
            .strip_prefix("unix://")
            .with_context(|| format!("shim address {address:?}"))?,
    );
    let pid = cubelet_e2e::shims(&d.namespace)
        .into_iter()
        .find_map(|(pid, shim)| (shim == id).then_some(pid))
        .context("the started shim is not running")?;
    // The shim opens its log fifo (relative to its bundle) after `start`
    // returns: the bundle goes only once the shim has logged through it.
    eventually("the shim logs", Duration::from_secs(30), || async {
        Ok(std::fs::read_to_string(&copy)
            .unwrap_or_default()
            .contains("starting signal loop"))
    })
    .await?;
    std::fs::remove_dir_all(&bundle)?;
    Ok((pid, socket, reader))
}

/// Writes the daemon's shim-ledger record of task `id`: the shim `pid`
/// with its start time (field 22 of `/proc/<pid>/stat`), as the daemon
/// writes it once containerd has started a task's shim.
fn record_shim(d: &Daemon, id: &str, pid: u32) -> anyhow::Result<()> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let start = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .context("no start time in /proc/<pid>/stat")?;
    let dir = d.state_dir.join("runtime").join("shims");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(id), format!("shim {pid} {start}\n"))?;
    Ok(())
}

/// The daemon's log line saying shim `id` was stopped, if there is one.
fn shim_stop_line(d: &Daemon, id: &str) -> anyhow::Result<Option<String>> {
    let log = std::fs::read_to_string(&d.daemon_log)?;
    Ok(log
        .lines()
        .find(|l| l.contains("shim stopped by") && l.contains(&format!("id={id}")))
        .map(str::to_owned))
}

async fn gc_reaps_orphan_shims(d: &Daemon) -> anyhow::Result<()> {
    // A live task: the infra container of a running pod.
    let config = d.pod_config("shim-live");
    let pod = d.run_pod(&config, "").await?;
    ensure!(
        d.ctr(&["tasks", "ls", "-q"]).await?.contains(&pod),
        "the pod's infra task should run"
    );
    let ghost = format!("{:0>64}", "5a1e");
    let real = format!("{:0>64}", "5a1f");
    let (real_pid, real_socket, _log_reader) = real_orphan_shim(d, &real).await?;
    let mut orphan = fake_shim(d, &ghost)?;
    let mut live = fake_shim(d, &pod)?;
    // Not recorded in the agent's ledger: only its command line says
    // shim, so it is not the agent's and must be left alone.
    let stranger_id = format!("{:0>64}", "5a20");
    let mut stranger = fake_shim(d, &stranger_id)?;
    // The agent's own ledger records the shims it starts (pid and start
    // time); the two orphans are recorded as a killed create leaves them.
    record_shim(d, &real, real_pid)?;
    record_shim(d, &ghost, orphan.id().context("stand-in pid")?)?;
    let since = std::time::Instant::now();
    loop {
        let found = cubelet_e2e::shims(&d.namespace);
        if found.iter().any(|(_, id)| *id == ghost) && found.iter().any(|(_, id)| *id == pod) {
            break;
        }
        ensure!(
            since.elapsed() < Duration::from_secs(10),
            "stand-in shims not found by their command line: {found:?} (orphan {:?}, live {:?})",
            orphan.try_wait()?,
            live.try_wait()?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Shims younger than 10 s are never candidates; then a pass stops it.
    let since = std::time::Instant::now();
    while orphan.try_wait()?.is_none() {
        ensure!(
            since.elapsed() < Duration::from_secs(60),
            "the orphan shim was not stopped within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("orphan shim stopped after {:?}", since.elapsed());
    eventually(
        "the real orphan shim exits",
        Duration::from_secs(30),
        || async {
            Ok(!cubelet_e2e::shims(&d.namespace)
                .iter()
                .any(|(pid, id)| *pid == real_pid || *id == real))
        },
    )
    .await?;
    eventually("both stops counted", Duration::from_secs(30), || async {
        let metrics = http_get(d.metrics, "/metrics").await?.1;
        Ok(sample(&metrics, "cubelet_gc_reclaimed_total{kind=\"shim\"}") >= 2.0)
    })
    .await?;
    let by_shutdown = shim_stop_line(d, &real)?.context("no log line for the real shim's stop")?;
    println!("real shim: {by_shutdown}");
    ensure!(
        by_shutdown.contains("shim stopped by its own shutdown"),
        "the real shim, which answers ttrpc, was not stopped by its Shutdown: {by_shutdown}"
    );
    ensure!(
        !real_socket.exists(),
        "the real shim's socket {} is left",
        real_socket.display()
    );
    let by_signal = shim_stop_line(d, &ghost)?.context("no log line for the stand-in's stop")?;
    println!("stand-in: {by_signal}");
    ensure!(
        by_signal.contains("shim stopped by signal"),
        "the stand-in, which has no socket, was not stopped by its pid: {by_signal}"
    );
    // A few more passes: the shim of the live task is still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        live.try_wait()?.is_none(),
        "the GC stopped the shim of a live task"
    );
    ensure!(
        stranger.try_wait()?.is_none(),
        "the GC stopped a process the agent never started because of its command line"
    );
    live.kill().await?;
    stranger.kill().await?;
    d.remove_all().await
}

/// The value of the unlabelled-or-labelled sample `name` in a scrape.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn gc_retries_failing_cleanup(d: &Daemon) -> anyhow::Result<()> {
    // The storage cleanup fails three times (after doing its work): the
    // RemovePodSandbox call and the GC's first two attempts fail, the third
    // succeeds.
    d.stop().await?;
    d.start_with_env(&[("CUBELET_TEST_FAILPOINTS", "storage.cleanup=fail:3")])
        .await?;
    let mut rt = d.runtime.clone();
    let config = pod_config("flaky-pod", "uid-flaky-pod", &d.log_base.join("flaky-pod"));
    let id = rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        })
        .await?
        .into_inner()
        .pod_sandbox_id;
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await?;
    let removed = rt
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await;
    let err = removed.err().context("RemovePodSandbox should fail once")?;
    ensure!(
        err.message().contains("failpoint"),
        "unexpected error: {err:?}"
    );
    let status = rt
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.clone(),
            verbose: true,
        })
        .await?
        .into_inner();
    let info: serde_json::Value =
        serde_json::from_str(status.info.get("info").context("verbose info")?)?;
    ensure!(
        info["state"] == "needs_cleanup" && info["cleanupAttempts"] == 1,
        "kept for the GC: {info}"
    );

    // The record goes first; the pass counts what it reclaimed at its end.
    let reclaimed_line = "cubelet_gc_reclaimed_total{kind=\"sandbox\"}";
    eventually(
        "the GC removed the sandbox and counted it",
        Duration::from_secs(90),
        || async {
            let metrics = http_get(d.metrics, "/metrics").await?.1;
            Ok(pods(d).await? == 0 && sample(&metrics, reclaimed_line) > 0.0)
        },
    )
    .await?;
    let metrics = http_get(d.metrics, "/metrics").await?.1;
    let failures = sample(&metrics, "cubelet_gc_failures_total{kind=\"sandbox\"}");
    let reclaimed = sample(&metrics, reclaimed_line);
    let runs = sample(&metrics, "cubelet_gc_runs_total");
    println!("gc: {failures} failed attempts, {reclaimed} reclaimed, {runs} passes");
    ensure!(
        (failures, reclaimed) == (2.0, 1.0),
        "two failed GC attempts then one success, got {failures} and {reclaimed}"
    );
    // Backoff: the waits the GC chose double (interval 1 s: 2 s, then 4 s),
    // so passes outnumber attempts.
    let log = std::fs::read_to_string(&d.daemon_log)?;
    let waits: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("gc: cleanup failed"))
        .filter_map(|l| l.split("retry_in=").nth(1)?.split_whitespace().next())
        .collect();
    ensure!(waits == ["2s", "4s"], "backoff waits {waits:?}");
    ensure!(
        runs >= 3.0 + 2.0,
        "passes {runs} should exceed attempts (3)"
    );

    // Restart without the failpoint for the leak audit.
    d.stop().await?;
    d.start_with_env(&[]).await?;
    Ok(())
}

async fn creates_under_a_busy_gc(d: &Daemon) -> anyhow::Result<()> {
    let mut ids = Vec::new();
    for i in 0..30 {
        let cfg = d.pod_config(&format!("busy-{i}"));
        let id = d
            .run_pod(&cfg, "")
            .await
            .with_context(|| format!("pod {i} of 30, created while the GC runs"))?;
        ids.push(id);
    }
    let metrics = http_get(d.metrics, "/metrics").await?.1;
    let passes: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("cubelet_gc_runs_total "))
        .context("no cubelet_gc_runs_total")?
        .trim()
        .parse()?;
    ensure!(
        passes >= 20.0,
        "only {passes} GC passes overlapped the creates"
    );
    // The series exist from the start, at 0; none may have grown.
    let reclaimed: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("cubelet_gc_reclaimed_total{"))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    ensure!(reclaimed.is_empty(), "the GC took something: {reclaimed:?}");
    for id in &ids {
        let status = d.pod_status(id).await?;
        ensure!(status.state == 0, "pod {id} is not ready: {status:?}");
        for path in [
            d.root_dir.join("sandboxes").join(id).join("hostname"),
            d.state_dir.join("netns").join(id),
        ] {
            ensure!(path.exists(), "{} of a ready pod is gone", path.display());
        }
    }
    let mut rt = d.runtime.clone();
    for id in ids {
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await?;
        rt.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: id })
            .await?;
    }
    Ok(())
}

async fn with_daemon(
    index: u8,
    scenario: for<'a> fn(&'a Daemon) -> futures::future::BoxFuture<'a, anyhow::Result<()>>,
) {
    let opts = DaemonOpts {
        index,
        extra_config: Some(GC_FAST.to_owned()),
        ..Default::default()
    };
    cubelet_e2e::with_daemon(opts, Duration::from_secs(240), scenario).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_during_create_leaves_nothing() {
    with_daemon(9, |d| Box::pin(kill_mid_create(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_reclaims_orphans_of_every_kind() {
    with_daemon(10, |d| Box::pin(gc_reclaims_orphans(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_stops_shims_containerd_forgot() {
    with_daemon(21, |d| Box::pin(gc_reaps_orphan_shims(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_retries_a_failing_cleanup_with_backoff() {
    with_daemon(14, |d| Box::pin(gc_retries_failing_cleanup(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_passes_during_creates_take_nothing_live() {
    let opts = DaemonOpts {
        index: 17,
        extra_config: Some("gc: { interval: 50ms }\n".to_owned()),
        ..Default::default()
    };
    cubelet_e2e::with_daemon(opts, Duration::from_secs(240), |d| {
        Box::pin(creates_under_a_busy_gc(d))
    })
    .await;
}
