//! Warm pools of pod shells (`pools.sandbox.size`), over CRI against the
//! real daemon and containerd.
//!
//! The daemon keeps ready shells (netns pinned, veth on the bridge, an
//! address leased, the sandbox directory with its shm, and the IPC/UTS
//! pins). A pod that fits claims one and takes its id: the pod runs a
//! container, answers on its IP from the host over the bridge, has its own
//! hostname, and stop + remove leave nothing (the leak audit leaves out
//! only the shells the daemon reports holding). A pause-mode pod claims a
//! shell too; a host-network pod and an exhausted pool take the cold path;
//! the metrics move. With the pool off the daemon holds no shell. kill -9
//! with ready shells, and in the middle of a prewarm, then a restart: the
//! last run's shells are destroyed, none is reused. The GC reclaims a shell
//! whose record is gone. kill -9 at each step boundary of a claimed create,
//! then a restart: the pod is gone and nothing of its shell is left; the
//! store the killed run left shows a pod confined to its shell (no pause
//! container, no host port) still as the shell (its claim and its flow's
//! start were buffered), any other as a sandbox with an open flow.
//!
//! Custom runner ([`cubelet_e2e::scenario_main`]): one daemon, scenarios in
//! order, each followed by removal through CRI and the leak audit.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{
    ContainerState, CreateContainerRequest, ExecSyncRequest, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxState, PortMapping, Protocol, RemoveContainerRequest,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use cubelet_e2e::{
    container_config, eventually, http_get, leaks, metric, pid_per_container, Daemon, DaemonOpts,
    Scenario,
};
use cubelet_engine::Journal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// Shells the test daemon keeps.
const SIZE: usize = 2;

fn scenarios() -> Vec<Scenario> {
    vec![
        ("a_pool_hit_gives_a_working_pod", 180, |d| {
            Box::pin(hit_gives_a_working_pod(d))
        }),
        ("a_pause_mode_pod_claims_a_shell_too", 120, |d| {
            Box::pin(pause_pod_claims(d))
        }),
        ("host_network_and_an_empty_pool_miss", 120, |d| {
            Box::pin(misses(d))
        }),
        ("the_pool_off_holds_no_shell", 180, |d| {
            Box::pin(pool_off(d))
        }),
        ("kill9_with_ready_shells_destroys_them", 180, |d| {
            Box::pin(kill9_ready(d))
        }),
        ("kill9_mid_prewarm_rolls_the_shell_back", 180, |d| {
            Box::pin(kill9_mid_prewarm(d))
        }),
        ("gc_reclaims_a_shell_without_its_record", 180, |d| {
            Box::pin(gc_orphaned_shell(d))
        }),
        ("kill9_mid_claim_loses_the_pod_and_the_shell", 300, |d| {
            Box::pin(kill9_mid_claim(d))
        }),
        (
            "a_pool_hit_starts_its_containers_in_the_shells_shim",
            180,
            |d| Box::pin(shell_shim(d)),
        ),
        (
            "a_created_container_stays_created_until_started",
            180,
            |d| Box::pin(created_task(d)),
        ),
        (
            "kill9_with_a_created_task_then_start_and_removal",
            240,
            |d| Box::pin(kill9_created_task(d)),
        ),
    ]
}

fn main() -> ExitCode {
    let opts = DaemonOpts {
        index: 37,
        extra_config: Some(format!(
            "gc: {{ interval: 1s }}\npools: {{ sandbox: {{ size: {SIZE}, shim: true }} }}\n"
        )),
        ..Default::default()
    };
    cubelet_e2e::scenario_main(opts, scenarios())
}

/// Waits until the daemon holds `n` ready shells; returns their ids.
async fn ready(d: &Daemon, n: usize) -> anyhow::Result<BTreeSet<String>> {
    eventually(
        &format!("{n} ready shells"),
        Duration::from_secs(30),
        || async { Ok(metric(d.metrics, "cubelet_pool_ready").await? == n as f64) },
    )
    .await?;
    Ok(d.shells().await?.into_iter().collect())
}

/// Whether the kernel and the disk hold any part of sandbox `id`.
fn any_part_of(d: &Daemon, id: &str) -> bool {
    d.state_dir.join("netns").join(id).exists()
        || d.podns_dir().join(id).exists()
        || d.root_dir.join("sandboxes").join(id).exists()
        || Path::new("/sys/class/net")
            .join(format!("cb{}", &id[..11]))
            .exists()
}

/// Whether every part of shell `id` is there.
fn whole_shell(d: &Daemon, id: &str) -> bool {
    d.state_dir.join("netns").join(id).exists()
        && d.podns_dir().join(id).join("ipc").exists()
        && d.podns_dir().join(id).join("uts").exists()
        && d.root_dir.join("sandboxes").join(id).join("shm").exists()
        && Path::new("/sys/class/net")
            .join(format!("cb{}", &id[..11]))
            .exists()
}

/// Runs `sh -c cmd` in container `id`; its stdout, trimmed.
async fn sh(d: &Daemon, id: &str, cmd: &str) -> anyhow::Result<String> {
    let r = d
        .runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: vec!["sh".into(), "-c".into(), cmd.into()],
            timeout: 10,
        })
        .await
        .with_context(|| format!("exec {cmd:?} in {id}"))?
        .into_inner();
    ensure!(
        r.exit_code == 0,
        "{cmd:?} in {id} exited {}: {}",
        r.exit_code,
        String::from_utf8_lossy(&r.stderr)
    );
    Ok(String::from_utf8_lossy(&r.stdout).trim().to_owned())
}

async fn stop_and_remove(d: &Daemon, id: &str) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.to_owned(),
    })
    .await?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: id.to_owned(),
    })
    .await?;
    Ok(())
}

/// GET / from `ip:8080` over the bridge, from the host.
async fn get_from_host(ip: &str) -> anyhow::Result<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect((ip, 8080)).await?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .context("GET timed out")?
}

/// A pod of `cfg` claims a shell and works: a container serves on its IP,
/// reachable from the host, with the pod's hostname; stop + remove leave
/// nothing of it.
async fn claims_and_works(
    d: &Daemon,
    cfg: &cubelet_e2e::cri::PodSandboxConfig,
) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let shells = ready(d, SIZE).await?;
    for id in &shells {
        ensure!(whole_shell(d, id), "shell {id} incomplete");
    }
    let hits = metric(d.metrics, "cubelet_pool_hits_total").await?;
    let pod = d.run_pod(cfg, "").await?;
    ensure!(
        shells.contains(&pod),
        "pod {pod} took no shell of {shells:?}"
    );
    ensure!(
        metric(d.metrics, "cubelet_pool_hits_total").await? == hits + 1.0,
        "hit not counted"
    );
    ensure!(!d.shells().await?.contains(&pod), "still listed as a shell");
    let status = d.pod_status(&pod).await?;
    ensure!(
        status.state == PodSandboxState::SandboxReady as i32,
        "{status:?}"
    );
    let ip = status
        .network
        .as_ref()
        .map(|n| n.ip.clone())
        .unwrap_or_default();
    ensure!(!ip.is_empty(), "no pod IP: {status:?}");
    let c = d
        .start_in(
            &pod,
            cfg,
            container_config(
                "web",
                BUSYBOX,
                &[
                    "sh",
                    "-c",
                    "mkdir -p /tmp/www && echo hello-pool > /tmp/www/index.html && \
                     exec httpd -f -p 8080 -h /tmp/www",
                ],
            ),
        )
        .await?;
    let hostname = sh(d, &c, "hostname").await?;
    ensure!(hostname == cfg.hostname, "hostname {hostname:?}");
    let hosts = sh(d, &c, "cat /etc/hosts").await?;
    ensure!(hosts.contains(&cfg.hostname), "hosts: {hosts}");
    let mut body = String::new();
    for _ in 0..50 {
        match get_from_host(&ip).await {
            Ok(b) if b.contains("hello-pool") => {
                body = b;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    ensure!(body.contains("hello-pool"), "pod not reachable at {ip}");
    d.remove_all().await?;
    ensure!(!any_part_of(d, &pod), "pod {pod} left something");
    // The pool refills with new shells; the pod's id never returns.
    let after = ready(d, SIZE).await?;
    ensure!(!after.contains(&pod), "a removed pod's id is a shell again");
    Ok(())
}

async fn hit_gives_a_working_pod(d: &Daemon) -> anyhow::Result<()> {
    ensure!(
        metric(d.metrics, "cubelet_pool_misses_total").await? >= 0.0,
        "misses exported"
    );
    claims_and_works(d, &pid_per_container(d.pod_config("pooled"))).await
}

async fn pause_pod_claims(d: &Daemon) -> anyhow::Result<()> {
    // CRI's zero value: one PID namespace for the pod, so a pause container.
    claims_and_works(d, &d.pod_config("pooled-pause")).await?;
    Ok(())
}

async fn misses(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let shells = ready(d, SIZE).await?;
    let misses = metric(d.metrics, "cubelet_pool_misses_total").await?;
    let hits = metric(d.metrics, "cubelet_pool_hits_total").await?;
    let mut host = pid_per_container(d.pod_config("pool-host"));
    let ns = host
        .linux
        .get_or_insert_with(Default::default)
        .security_context
        .get_or_insert_with(Default::default)
        .namespace_options
        .get_or_insert_with(NamespaceOption::default);
    ns.network = NamespaceMode::Node as i32;
    let pod = d.run_pod(&host, "").await?;
    ensure!(!shells.contains(&pod), "a host-network pod took a shell");
    ensure!(metric(d.metrics, "cubelet_pool_misses_total").await? == misses + 1.0);
    ensure!(d.shells().await?.len() == SIZE, "the shells were kept");
    stop_and_remove(d, &pod).await?;

    // More pods at once than shells: the refill waits for them, so the
    // last ones take the cold path.
    let cfgs: Vec<_> = (0..SIZE + 2)
        .map(|i| pid_per_container(d.pod_config(&format!("burst-{i}"))))
        .collect();
    let ids = futures::future::try_join_all(cfgs.iter().map(|c| d.run_pod(c, ""))).await?;
    let claimed = ids.iter().filter(|id| shells.contains(*id)).count();
    let new_hits = metric(d.metrics, "cubelet_pool_hits_total").await? - hits;
    let new_misses = metric(d.metrics, "cubelet_pool_misses_total").await? - misses - 1.0;
    ensure!(
        claimed == SIZE && new_hits == SIZE as f64 && new_misses == 2.0,
        "claimed {claimed}, hits {new_hits}, misses {new_misses}"
    );
    let distinct: BTreeSet<_> = ids.iter().collect();
    ensure!(distinct.len() == ids.len(), "two pods share an id");
    d.remove_all().await?;
    ready(d, SIZE).await?;
    Ok(())
}

/// Writes drop-in `name` (or removes it with `None`) and restarts.
async fn reconfigure(d: &Daemon, name: &str, yaml: Option<&str>) -> anyhow::Result<()> {
    let path = d.config_dir().join("config.d").join(name);
    match yaml {
        Some(y) => std::fs::write(&path, y)?,
        None => std::fs::remove_file(&path)?,
    }
    d.restart().await
}

async fn pool_off(d: &Daemon) -> anyhow::Result<()> {
    let before = ready(d, SIZE).await?;
    reconfigure(d, "60-pool.yaml", Some("pools: { sandbox: { size: 0 } }\n")).await?;
    ensure!(d.shells().await?.is_empty(), "shells with the pool off");
    for id in &before {
        ensure!(!any_part_of(d, id), "shell {id} of the last run kept");
    }
    ensure!(metric(d.metrics, "cubelet_pool_ready").await? == 0.0);
    let pod = d
        .run_pod(&pid_per_container(d.pod_config("cold")), "")
        .await?;
    ensure!(d.pod_status(&pod).await?.state == PodSandboxState::SandboxReady as i32);
    ensure!(
        metric(d.metrics, "cubelet_pool_hits_total").await? == 0.0
            && metric(d.metrics, "cubelet_pool_misses_total").await? == 0.0,
        "the pool off counts nothing"
    );
    stop_and_remove(d, &pod).await?;
    let leaked = leaks(d).await?;
    ensure!(leaked.is_empty(), "leaked: {leaked:?}");
    reconfigure(d, "60-pool.yaml", None).await?;
    let after = ready(d, SIZE).await?;
    ensure!(after.is_disjoint(&before), "a shell id came back");
    Ok(())
}

async fn kill9_ready(d: &Daemon) -> anyhow::Result<()> {
    let before = ready(d, SIZE).await?;
    d.kill9().await?;
    for id in &before {
        ensure!(whole_shell(d, id), "shell {id} gone before the restart");
    }
    d.start_with_env(&[]).await?;
    // Destroyed during reconciliation, before the daemon was ready.
    for id in &before {
        ensure!(!any_part_of(d, id), "shell {id} of the killed run left");
    }
    let after = ready(d, SIZE).await?;
    ensure!(after.is_disjoint(&before), "a shell was adopted or reused");
    Ok(())
}

/// A shell whose first stage is built (netns and directory there).
async fn half_made(d: &Daemon) -> anyhow::Result<Option<String>> {
    Ok(d.shells().await?.into_iter().find(|id| {
        d.state_dir.join("netns").join(id).exists()
            && d.root_dir.join("sandboxes").join(id).exists()
    }))
}

async fn kill9_mid_prewarm(d: &Daemon) -> anyhow::Result<()> {
    ready(d, SIZE).await?;
    // A prewarm held after its first stage (namespace, veth, lease,
    // directory made), before the sandbox step pins IPC and UTS.
    d.stop().await?;
    d.start_with_env(&[(
        "CUBELET_TEST_FAILPOINTS",
        "sandbox.prewarm@before=sleep:300s",
    )])
    .await?;
    eventually("a prewarm half-way", Duration::from_secs(30), || async {
        Ok(half_made(d).await?.is_some())
    })
    .await?;
    let half = half_made(d).await?.context("the half-made shell")?;
    ensure!(
        metric(d.metrics, "cubelet_pool_ready").await? == 0.0,
        "a shell ready"
    );
    d.kill9().await?;
    ensure!(
        any_part_of(d, &half),
        "nothing of the half shell before restart"
    );
    d.start_with_env(&[]).await?;
    ensure!(
        !any_part_of(d, &half),
        "the half-made shell {half} survived"
    );
    let after = ready(d, SIZE).await?;
    ensure!(!after.contains(&half), "the half-made shell was adopted");
    Ok(())
}

async fn gc_orphaned_shell(d: &Daemon) -> anyhow::Result<()> {
    let before = ready(d, SIZE).await?;
    // Killed with shells ready; their records then lost (as if the store
    // were restored from before they were made): nobody owns them.
    d.kill9().await?;
    {
        let store = cubelet_store::Store::open(&d.root_dir.join("cubelet.redb"))?;
        for id in &before {
            let id = cubelet_engine::SandboxId::parse(id).context("shell id")?;
            store.delete_shell(&id)?;
        }
    }
    d.start_with_env(&[]).await?;
    eventually(
        "orphaned shells reclaimed by the GC",
        Duration::from_secs(30),
        || async { Ok(before.iter().all(|id| !any_part_of(d, id))) },
    )
    .await?;
    let (_, body) = http_get(d.metrics, "/metrics").await?;
    let reclaimed = |kind: &str| {
        body.lines()
            .find(|l| l.starts_with(&format!("cubelet_gc_reclaimed_total{{kind=\"{kind}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Each shell's keeper (`shim: true` here) is an orphan containerd
    // container the GC removes. Its veth is counted when the GC deletes
    // it, or goes with its netns when the keeper, the last process in it,
    // is removed first.
    let (veths, containers) = (reclaimed("veth"), reclaimed("container"));
    ensure!(
        containers >= SIZE as f64,
        "keeper reclaims not counted: {containers}"
    );
    println!("gc reclaims: veth {veths}, container {containers}");
    ready(d, SIZE).await?;
    Ok(())
}

/// What the store a killed run left says of a claimed shell `id`.
#[derive(Debug, PartialEq, Eq)]
enum Left {
    /// Still the shell: the claim and the flow's start were not durable.
    Shell,
    /// A sandbox with an open `create` flow: recovery undoes it.
    OpenCreate,
}

/// Reads the store of the (stopped) daemon for claimed shell `id`.
fn left_in_store(d: &Daemon, id: &str) -> anyhow::Result<Left> {
    let store = cubelet_store::Store::open(&d.root_dir.join("cubelet.redb"))?;
    let sid = cubelet_engine::SandboxId::parse(id).context("shell id")?;
    let shell = store.list_shells()?.iter().any(|s| s.id == sid);
    let sandbox = store.get_sandbox(&sid)?.is_some();
    let open = store
        .open_flows()?
        .iter()
        .any(|f| f.sandbox_id == sid && f.kind == cubelet_engine::FlowKind::Create);
    match (shell, sandbox, open) {
        (true, false, false) => Ok(Left::Shell),
        (false, true, true) => Ok(Left::OpenCreate),
        _ => anyhow::bail!("shell record {shell}, sandbox record {sandbox}, open create {open}"),
    }
}

/// One kill -9 case: RunPodSandbox of `cfg` held at failpoint `point`
/// (`<provider>.create[@before]`), the daemon killed, the store read, the
/// daemon restarted.
async fn killed_mid_claim(
    d: &Daemon,
    point: &str,
    cfg: &PodSandboxConfig,
    expect: Left,
) -> anyhow::Result<()> {
    d.stop().await?;
    d.start_with_env(&[("CUBELET_TEST_FAILPOINTS", &format!("{point}=sleep:300s"))])
        .await?;
    let shells = ready(d, SIZE).await?;
    // kubelet makes the log directory before it asks for the pod.
    std::fs::create_dir_all(&cfg.log_directory)?;
    let call = {
        let mut rt = d.runtime.clone();
        let config = cfg.clone();
        tokio::spawn(async move {
            rt.run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config),
                runtime_handler: String::new(),
            })
            .await
        })
    };
    eventually(
        &format!("{point}: a shell claimed"),
        Duration::from_secs(10),
        || async { Ok(d.shells().await?.len() < SIZE) },
    )
    .await?;
    let left = d.shells().await?;
    let claimed: Vec<&String> = shells.iter().filter(|id| !left.contains(*id)).collect();
    let [claimed] = claimed[..] else {
        anyhow::bail!("{point}: claimed {claimed:?}");
    };
    let claimed = claimed.clone();
    // The steps before the hold take well under this.
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        !call.is_finished(),
        "{point}: the call returned before the kill"
    );
    d.kill9().await?;
    let _ = call.await;
    ensure!(
        any_part_of(d, &claimed),
        "{point}: nothing of {claimed} before the restart"
    );
    let found = left_in_store(d, &claimed).with_context(|| format!("{point}: the store"))?;
    ensure!(
        found == expect,
        "{point}: the store has {found:?}, expected {expect:?}"
    );
    d.start_with_env(&[]).await?;
    eventually(
        &format!("{point}: pod gone"),
        Duration::from_secs(30),
        || async { Ok(!any_part_of(d, &claimed) && d.pod_ids().await?.is_empty()) },
    )
    .await?;
    let after = ready(d, SIZE).await?;
    ensure!(
        !after.contains(&claimed),
        "{point}: the claimed shell came back"
    );
    Ok(())
}

async fn kill9_mid_claim(d: &Daemon) -> anyhow::Result<()> {
    let confined = pid_per_container(d.pod_config("claim-killed"));
    for point in [
        "storage.create@before",
        "storage.create",
        "network.create",
        "sandbox.create",
    ] {
        killed_mid_claim(d, point, &confined, Left::Shell).await?;
    }
    // A pause container, or a host port, is outside the shell: the claim
    // and the start are durable before either is made.
    let pause = d.pod_config("claim-killed-pause");
    killed_mid_claim(d, "sandbox.create@before", &pause, Left::OpenCreate).await?;
    let mut ported = pid_per_container(d.pod_config("claim-killed-port"));
    ported.port_mappings = vec![PortMapping {
        protocol: Protocol::Tcp as i32,
        container_port: 8080,
        host_port: 18089,
        host_ip: "127.0.0.1".to_owned(),
    }];
    killed_mid_claim(d, "network.create@before", &ported, Left::OpenCreate).await?;
    d.stop().await?;
    d.start_with_env(&[]).await
}

/// `(pid, status)` of the containerd task `id` (`ctr tasks ls`), if any.
async fn task_of(d: &Daemon, id: &str) -> anyhow::Result<Option<(u32, String)>> {
    let out = d.ctr(&["tasks", "ls"]).await?;
    Ok(out.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next()? == id).then_some(())?;
        let pid = f.next()?.parse().ok()?;
        Some((pid, f.next()?.to_owned()))
    }))
}

/// The parent of process `pid` (`/proc/<pid>/stat` field 4).
fn parent_of(pid: u32) -> anyhow::Result<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("stat")?.1;
    after
        .split_whitespace()
        .nth(1)
        .context("ppid")?
        .parse()
        .context("ppid")
}

/// The `-id` of the shim process `pid` of this daemon's namespace.
fn shim_id(d: &Daemon, pid: u32) -> Option<String> {
    cubelet_e2e::shims(&d.namespace)
        .into_iter()
        .find_map(|(p, id)| (p == pid).then_some(id))
}

/// CreateContainer of `cfg` in pod `pod`; the container id.
async fn create_in(
    d: &Daemon,
    pod: &str,
    pod_cfg: &PodSandboxConfig,
    cfg: cubelet_e2e::cri::ContainerConfig,
) -> anyhow::Result<String> {
    Ok(d.runtime
        .clone()
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.to_owned(),
            config: Some(cfg),
            sandbox_config: Some(pod_cfg.clone()),
        })
        .await?
        .into_inner()
        .container_id)
}

async fn start(d: &Daemon, id: &str) -> anyhow::Result<()> {
    d.runtime
        .clone()
        .start_container(StartContainerRequest {
            container_id: id.to_owned(),
        })
        .await?;
    Ok(())
}

/// A ready shell holds a keeper: a running pause task with the shell's id,
/// in its own shim (`-id` the shell's), in no pod's cgroup (the default
/// parent, per driver). The pod that claims it creates its container's task
/// in that shim at CreateContainer and starts it there; two seconds later
/// the pod's stats anchor has replaced the keeper, in the same shim, and
/// the pod's processes have one shim between them.
async fn shell_shim(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let shells = ready(d, SIZE).await?;
    for id in &shells {
        let (pid, status) = task_of(d, id)
            .await?
            .with_context(|| format!("shell {id} has no keeper task"))?;
        ensure!(status == "RUNNING", "keeper of {id}: {status}");
        let shim = parent_of(pid)?;
        ensure!(
            shim_id(d, shim).as_deref() == Some(id.as_str()),
            "keeper of {id} not in a shim of its own id"
        );
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        ensure!(
            cgroup
                .lines()
                .filter(|l| l.contains(id.as_str()))
                .all(|l| l.ends_with(&format!("/cubelet/{id}"))
                    || l.ends_with(&format!("/cubelet-{id}.scope"))),
            "keeper of {id} not in the default parent: {cgroup}"
        );
        ensure!(cgroup.contains(id.as_str()), "keeper cgroup: {cgroup}");
    }
    let cfg = pid_per_container(d.pod_config("shim"));
    let pod = d.run_pod(&cfg, "").await?;
    ensure!(shells.contains(&pod), "pod {pod} took no shell");
    let (keeper, _) = task_of(d, &pod).await?.context("keeper gone at claim")?;
    let shim = parent_of(keeper)?;
    let c = create_in(
        d,
        &pod,
        &cfg,
        container_config("app", BUSYBOX, &["sleep", "3600"]),
    )
    .await?;
    let st = d.container_status(&c).await?;
    ensure!(
        st.state == ContainerState::ContainerCreated as i32 && st.started_at == 0,
        "after CreateContainer: {st:?}"
    );
    let (pid, status) = task_of(d, &c).await?.context("no task at create")?;
    ensure!(status == "CREATED", "task at create: {status}");
    ensure!(
        parent_of(pid)? == shim,
        "the task is not in the shell's shim"
    );
    start(d, &c).await?;
    let st = d.container_status(&c).await?;
    ensure!(
        st.state == ContainerState::ContainerRunning as i32,
        "{st:?}"
    );
    let (started, _) = task_of(d, &c).await?.context("task")?;
    ensure!(started == pid, "another task was started");
    ensure!(parent_of(pid)? == shim, "started outside the shell's shim");
    // The anchor replaces the keeper (labelled as the pod's sandbox now).
    eventually(
        "the stats anchor in place of the keeper",
        Duration::from_secs(30),
        || async {
            // Gone for a moment: the keeper is removed before the anchor
            // is made with its id.
            let Ok(info) = d.ctr(&["containers", "info", &pod]).await else {
                return Ok(false);
            };
            Ok(!info.contains("io.cubelet.sandbox/keeper")
                && info.contains("io.cri-containerd.kind")
                && task_of(d, &pod).await?.is_some_and(|(_, s)| s == "RUNNING"))
        },
    )
    .await?;
    let (anchor, _) = task_of(d, &pod).await?.context("anchor")?;
    ensure!(anchor != keeper, "the keeper was kept");
    ensure!(parent_of(anchor)? == shim, "the anchor is in another shim");
    ensure!(
        parent_of(pid)? == shim,
        "the container lost its shim with the keeper"
    );
    sh(d, &c, "true").await?;
    d.remove_all().await?;
    ensure!(task_of(d, &pod).await?.is_none(), "the pod's anchor left");
    ready(d, SIZE).await?;
    Ok(())
}

/// A container's task is made at CreateContainer, not started: its status
/// says CREATED (no start time) until StartContainer; a StopContainer
/// before the start deletes the task (still CREATED, no exit), and the
/// start then makes it again; a command that cannot run fails the start,
/// not the create, as before (`StartError`); StopPodSandbox takes the task
/// of a container never started and leaves it CREATED.
async fn created_task(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    ready(d, SIZE).await?;
    let cfg = pid_per_container(d.pod_config("created"));
    let pod = d.run_pod(&cfg, "").await?;
    let c = create_in(
        d,
        &pod,
        &cfg,
        container_config("app", BUSYBOX, &["sleep", "3600"]),
    )
    .await?;
    ensure!(
        task_of(d, &c).await?.is_some_and(|(_, s)| s == "CREATED"),
        "no created task"
    );
    d.runtime
        .clone()
        .stop_container(StopContainerRequest {
            container_id: c.clone(),
            timeout: 0,
        })
        .await?;
    let st = d.container_status(&c).await?;
    ensure!(
        st.state == ContainerState::ContainerCreated as i32 && st.exit_code == 0,
        "after a stop before the start: {st:?}"
    );
    ensure!(task_of(d, &c).await?.is_none(), "the stop left the task");
    start(d, &c).await?;
    ensure!(
        d.container_status(&c).await?.state == ContainerState::ContainerRunning as i32,
        "not running after the start"
    );
    sh(d, &c, "true").await?;

    // A command that does not exist: created, and the start fails.
    let bad = create_in(
        d,
        &pod,
        &cfg,
        container_config("bad", BUSYBOX, &["/no/such/binary"]),
    )
    .await?;
    ensure!(
        d.container_status(&bad).await?.state == ContainerState::ContainerCreated as i32,
        "the bad container is not created"
    );
    ensure!(start(d, &bad).await.is_err(), "a missing binary started");
    let st = d.container_status(&bad).await?;
    ensure!(
        st.state == ContainerState::ContainerExited as i32 && st.reason == "StartError",
        "after a failed start: {st:?}"
    );

    // Never started: the pod's stop takes its task, it stays created.
    let idle = create_in(
        d,
        &pod,
        &cfg,
        container_config("idle", BUSYBOX, &["sleep", "3600"]),
    )
    .await?;
    ensure!(task_of(d, &idle).await?.is_some(), "idle has no task");
    d.runtime
        .clone()
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
    ensure!(
        task_of(d, &idle).await?.is_none(),
        "the pod's stop left idle's task"
    );
    // Give a stray exit event the time to land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = d.container_status(&idle).await?;
    ensure!(
        st.state == ContainerState::ContainerCreated as i32 && st.exit_code == 0,
        "idle after the pod's stop: {st:?}"
    );
    d.runtime
        .clone()
        .remove_container(RemoveContainerRequest {
            container_id: idle.clone(),
        })
        .await?;
    stop_and_remove(d, &pod).await?;
    Ok(())
}

/// kill -9 with a container created (its task made, not started): after
/// the restart it is still CREATED, and starts (the task of the killed run
/// is deleted and made again, its end reported as no exit); a second one
/// left created is removed with its task.
async fn kill9_created_task(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    ready(d, SIZE).await?;
    let cfg = pid_per_container(d.pod_config("created-kill"));
    let pod = d.run_pod(&cfg, "").await?;
    let a = create_in(
        d,
        &pod,
        &cfg,
        container_config("a", BUSYBOX, &["sleep", "3600"]),
    )
    .await?;
    let b = create_in(
        d,
        &pod,
        &cfg,
        container_config("b", BUSYBOX, &["sleep", "3600"]),
    )
    .await?;
    let (old, _) = task_of(d, &a).await?.context("a's task")?;
    d.kill9().await?;
    d.start_with_env(&[]).await?;
    for id in [&a, &b] {
        ensure!(
            d.container_status(id).await?.state == ContainerState::ContainerCreated as i32,
            "{id} not created after the restart"
        );
    }
    start(d, &a).await?;
    let (new, status) = task_of(d, &a).await?.context("a's task")?;
    ensure!(status == "RUNNING" && new != old, "{status} {new} {old}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        d.container_status(&a).await?.state == ContainerState::ContainerRunning as i32,
        "the old task's end counted as a's exit"
    );
    sh(d, &a, "true").await?;
    d.runtime
        .clone()
        .remove_container(RemoveContainerRequest {
            container_id: b.clone(),
        })
        .await?;
    eventually("b's task removed", Duration::from_secs(10), || async {
        Ok(task_of(d, &b).await?.is_none())
    })
    .await?;
    stop_and_remove(d, &pod).await?;
    Ok(())
}
