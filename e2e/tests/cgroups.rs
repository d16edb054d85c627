//! Cgroups end to end, through the real CRI socket: a pod placed as
//! kubelet places it (a `cgroup_parent` of its QoS class) whose container
//! gets the limits it asked for in its cgroup files, has them changed by
//! UpdateContainerResources, reports non-zero stats, runs an exec, is
//! reported `OOMKilled` when it allocates past its limit, and leaves no
//! cgroup, scope, slice, mount or containerd object behind.
//!
//! It runs under either cgroup driver and hierarchy, reading the files
//! where that combination puts them:
//!
//! | driver | pod parent sent | container cgroup |
//! |---|---|---|
//! | cgroupfs | `/<top>/burstable/pod<uid>` (made and removed here, as kubelet does) | `<parent>/<id>` |
//! | systemd | `/<top>.slice/<top>-burstable.slice/<top>-burstable-pod<uid>.slice` (kubelet's expanded form) | `<parent>/cubelet-<id>.scope` |
//!
//! with `<top>` a name of this test process (`cbe2e<pid>`), below each v1
//! controller's mount or the v2 root. The driver is the daemon's: the
//! harness starts one with `runtime.cgroup_driver` from
//! `CUBELET_E2E_CGROUP_DRIVER`, or attaches to a running Cubelet when
//! `CUBELET_E2E_SOCKET` is set (a systemd service in a guest); then the
//! expected driver is `CUBELET_E2E_CGROUP_DRIVER`, else what `auto`
//! picks on this node. `CUBELET_E2E_BUSYBOX` names the busybox image
//! (default: the private registry's).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{
    ContainerStatsRequest, ExecSyncRequest, LinuxContainerResources, LinuxPodSandboxConfig,
    PodSandboxStatsRequest, RemoveContainerRequest, RemovePodSandboxRequest, RuntimeConfigRequest,
    StopContainerRequest, StopPodSandboxRequest, UpdateContainerResourcesRequest,
};
use cubelet_e2e::{
    attach_skip_reason, container_config, eventually, leaks, pod_config, Daemon, DaemonOpts,
};

const MIB: i64 = 1 << 20;

/// The busybox image: `$CUBELET_E2E_BUSYBOX` or the private registry's.
fn busybox() -> String {
    std::env::var("CUBELET_E2E_BUSYBOX")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "127.0.0.1:5000/busybox:test".to_owned())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    Cgroupfs,
    Systemd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hierarchy {
    /// v1 controllers (hybrid included: runc uses the v1 side).
    V1,
    /// The unified hierarchy at /sys/fs/cgroup.
    V2,
}

const ROOT: &str = "/sys/fs/cgroup";

fn hierarchy() -> anyhow::Result<Hierarchy> {
    let st = nix::sys::statfs::statfs(ROOT).context("statfs /sys/fs/cgroup")?;
    Ok(
        if st.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC {
            Hierarchy::V2
        } else {
            Hierarchy::V1
        },
    )
}

/// The driver the daemon must be using: the one the harness configured
/// (or was told the attached daemon has), else what `auto` picks here.
fn expected_driver(h: Hierarchy) -> anyhow::Result<Driver> {
    match cubelet_e2e::e2e_cgroup_driver().as_deref() {
        Some("systemd") => Ok(Driver::Systemd),
        Some("cgroupfs") => Ok(Driver::Cgroupfs),
        Some("auto") | None => Ok(
            if Path::new("/run/systemd/system").is_dir() && h == Hierarchy::V2 {
                Driver::Systemd
            } else {
                Driver::Cgroupfs
            },
        ),
        Some(other) => bail!("CUBELET_E2E_CGROUP_DRIVER={other:?}"),
    }
}

/// systemd's path of a slice (`a-b.slice` → `/a.slice/a-b.slice`).
fn expand_slice(slice: &str) -> String {
    let name = slice.trim_end_matches(".slice");
    let mut path = String::new();
    let mut prefix = String::new();
    for part in name.split('-') {
        path.push_str(&format!("/{prefix}{part}.slice"));
        prefix.push_str(part);
        prefix.push('-');
    }
    path
}

/// Where one test pod's cgroups are, for the node's driver and hierarchy.
#[derive(Debug)]
struct PodCgroups {
    driver: Driver,
    hierarchy: Hierarchy,
    /// The top of what the test made: `/cbe2e<pid>` or `/cbe2e<pid>.slice`.
    top: String,
    /// The `cgroup_parent` sent, as kubelet sends it for the driver.
    parent: String,
    /// The parent's directory below the hierarchy root.
    parent_dir: String,
}

impl PodCgroups {
    fn new(driver: Driver, hierarchy: Hierarchy, uid: &str) -> PodCgroups {
        let top = format!("cbe2e{}", std::process::id());
        // kubelet writes a pod uid's dashes as underscores in unit names.
        let uid = uid.replace('-', "_");
        match driver {
            Driver::Cgroupfs => {
                let parent = format!("/{top}/burstable/pod{uid}");
                PodCgroups {
                    driver,
                    hierarchy,
                    top: format!("/{top}"),
                    parent_dir: parent.clone(),
                    parent,
                }
            }
            Driver::Systemd => {
                let parent = expand_slice(&format!("{top}-burstable-pod{uid}.slice"));
                PodCgroups {
                    driver,
                    hierarchy,
                    top: format!("/{top}.slice"),
                    parent_dir: parent.clone(),
                    parent,
                }
            }
        }
    }

    /// The roots the pod's cgroups live under: each v1 controller mount
    /// (named hierarchies such as `name=systemd` included, as runc joins
    /// them, and a hybrid node's v2 mount, where runc 1.1 places the
    /// container too) or the v2 root.
    fn roots(&self) -> Vec<PathBuf> {
        match self.hierarchy {
            Hierarchy::V2 => vec![PathBuf::from(ROOT)],
            Hierarchy::V1 => std::fs::read_to_string("/proc/self/mountinfo")
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(" - cgroup ") || l.contains(" - cgroup2 "))
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| m.starts_with(ROOT))
                .map(PathBuf::from)
                .collect(),
        }
    }

    /// The directory of `controller`'s files of the cgroup at `rel`.
    fn dir(&self, controller: &str, rel: &str) -> PathBuf {
        let rel = rel.trim_start_matches('/');
        match self.hierarchy {
            Hierarchy::V2 => Path::new(ROOT).join(rel),
            Hierarchy::V1 => Path::new(ROOT).join(controller).join(rel),
        }
    }

    /// Container `id`'s cgroup below the hierarchy root.
    fn container(&self, id: &str) -> String {
        match self.driver {
            Driver::Cgroupfs => format!("{}/{id}", self.parent_dir),
            Driver::Systemd => format!("{}/cubelet-{id}.scope", self.parent_dir),
        }
    }

    /// What kubelet does before RunPodSandbox under cgroupfs: the pod's
    /// cgroup in every hierarchy. (Under systemd the pod's slice is made
    /// by systemd when runc starts the first scope in it.)
    fn create(&self) -> anyhow::Result<()> {
        if self.driver == Driver::Systemd {
            return Ok(());
        }
        for root in self.roots() {
            let d = root.join(self.parent_dir.trim_start_matches('/'));
            std::fs::create_dir_all(&d).with_context(|| format!("mkdir {}", d.display()))?;
        }
        Ok(())
    }

    /// What kubelet does after the pod is gone: removes the pod's cgroups
    /// (the test's top included). A cgroup that still has a child or a
    /// process cannot be removed: that is a leak, reported.
    async fn remove(&self) -> anyhow::Result<()> {
        match self.driver {
            Driver::Systemd => {
                let unit = self.top.trim_start_matches('/');
                // Stopping the top slice stops everything below it; a slice
                // that is not loaded any more is not an error.
                let _ = cubelet_e2e::run("systemctl", &["stop", unit]).await;
                let dirs: Vec<PathBuf> = self.roots().into_iter().map(|r| r.join(unit)).collect();
                eventually("the test's slices to go", Duration::from_secs(20), || {
                    let dirs = dirs.clone();
                    async move { Ok(dirs.iter().all(|d| !d.exists())) }
                })
                .await
            }
            Driver::Cgroupfs => {
                let mut errors = Vec::new();
                for root in self.roots() {
                    // Bottom up: pod, QoS class, top.
                    let mut rel = PathBuf::from(self.parent_dir.trim_start_matches('/'));
                    loop {
                        let d = root.join(&rel);
                        match std::fs::remove_dir(&d) {
                            Ok(()) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                            Err(e) => errors.push(format!("rmdir {}: {e}", d.display())),
                        }
                        if !rel.pop() || rel.as_os_str().is_empty() {
                            break;
                        }
                    }
                }
                if errors.is_empty() {
                    Ok(())
                } else {
                    bail!("pod cgroups left: {}", errors.join("; "))
                }
            }
        }
    }
}

fn read(path: &Path) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("read {}", path.display()))?
        .trim()
        .to_owned())
}

/// runc's cgroup v2 `cpu.weight` for `shares`: runc up to 1.2 maps them
/// linearly, later versions on a curve; either is runc's, so both pass.
fn weights_for(shares: u64) -> [u64; 2] {
    let linear = 1 + ((shares - 2) * 9999) / 262_142;
    let l = (shares as f64).log2();
    let curve = 10f64.powf((l * l + 125.0 * l) / 612.0 - 7.0 / 34.0).ceil() as u64;
    [linear, curve]
}

/// Checks container `id`'s cgroup files against the limits asked for.
fn assert_limits(
    cg: &PodCgroups,
    id: &str,
    memory: i64,
    quota: i64,
    period: i64,
    shares: i64,
) -> anyhow::Result<()> {
    let rel = cg.container(id);
    match cg.hierarchy {
        Hierarchy::V1 => {
            let mem = read(&cg.dir("memory", &rel).join("memory.limit_in_bytes"))?;
            ensure!(
                mem == memory.to_string(),
                "memory.limit_in_bytes {mem}, want {memory}"
            );
            let cpu = cg.dir("cpu", &rel);
            let q = read(&cpu.join("cpu.cfs_quota_us"))?;
            ensure!(q == quota.to_string(), "cpu.cfs_quota_us {q}, want {quota}");
            let p = read(&cpu.join("cpu.cfs_period_us"))?;
            ensure!(
                p == period.to_string(),
                "cpu.cfs_period_us {p}, want {period}"
            );
            let s = read(&cpu.join("cpu.shares"))?;
            ensure!(s == shares.to_string(), "cpu.shares {s}, want {shares}");
        }
        Hierarchy::V2 => {
            let d = cg.dir("", &rel);
            let mem = read(&d.join("memory.max"))?;
            ensure!(mem == memory.to_string(), "memory.max {mem}, want {memory}");
            let max = read(&d.join("cpu.max"))?;
            ensure!(
                max == format!("{quota} {period}"),
                "cpu.max {max:?}, want \"{quota} {period}\""
            );
            let w: u64 = read(&d.join("cpu.weight"))?.parse()?;
            let want = weights_for(shares as u64);
            ensure!(
                want.contains(&w),
                "cpu.weight {w}, want one of {want:?} for shares {shares}"
            );
        }
    }
    Ok(())
}

fn resources(memory: i64, quota: i64, shares: i64) -> LinuxContainerResources {
    LinuxContainerResources {
        cpu_period: 100_000,
        cpu_quota: quota,
        cpu_shares: shares,
        memory_limit_in_bytes: memory,
        // As kubelet: no swap beyond the memory limit.
        memory_swap_limit_in_bytes: memory,
        oom_score_adj: 900,
        ..Default::default()
    }
}

/// A pod of the test: its id, its config and where its cgroups are.
struct TestPod {
    id: String,
    config: cubelet_e2e::cri::PodSandboxConfig,
    cgroups: PodCgroups,
}

async fn run_pod(d: &Daemon, name: &str, driver: Driver, h: Hierarchy) -> anyhow::Result<TestPod> {
    let uid = format!("{name}-{}", std::process::id());
    let cgroups = PodCgroups::new(driver, h, &uid);
    cgroups.create()?;
    let logs = d.log_base.join(name);
    std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
    let mut config = pod_config(name, &uid, &logs);
    config.linux = Some(LinuxPodSandboxConfig {
        cgroup_parent: cgroups.parent.clone(),
        ..Default::default()
    });
    let id = match d.run_pod(&config, "").await {
        Ok(id) => id,
        Err(e) => {
            // Kubelet's part of a pod that did not start: its cgroups go.
            return Err(match cgroups.remove().await {
                Ok(()) => e,
                Err(r) => e.context(format!("and removing its cgroups failed: {r:#}")),
            });
        }
    };
    Ok(TestPod {
        id,
        config,
        cgroups,
    })
}

/// Stops and removes `containers` and `pod` through CRI, then checks the
/// containers' cgroups are gone and removes the pod's (kubelet's part).
async fn stop_and_remove(d: &Daemon, pod: &TestPod, containers: &[String]) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    for c in containers {
        rt.stop_container(StopContainerRequest {
            container_id: c.clone(),
            timeout: 2,
        })
        .await
        .with_context(|| format!("StopContainer {c}"))?;
        rt.remove_container(RemoveContainerRequest {
            container_id: c.clone(),
        })
        .await
        .with_context(|| format!("RemoveContainer {c}"))?;
    }
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: pod.id.clone(),
    })
    .await
    .context("StopPodSandbox")?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: pod.id.clone(),
    })
    .await
    .context("RemovePodSandbox")?;
    let mut left = Vec::new();
    for c in containers.iter().chain(std::iter::once(&pod.id)) {
        let rel = pod.cgroups.container(c);
        for root in pod.cgroups.roots() {
            let dir = root.join(rel.trim_start_matches('/'));
            if dir.exists() {
                left.push(dir.display().to_string());
            }
        }
    }
    ensure!(
        left.is_empty(),
        "container cgroups left after removal: {left:?}"
    );
    pod.cgroups.remove().await
}

/// What an attached daemon (not the harness's) may still hold of the test's
/// pod: its objects in containerd and mounts naming its ids.
async fn audit_ids(d: &Daemon, ids: &[String]) -> anyhow::Result<()> {
    let containers = d.ctr(&["containers", "ls", "-q"]).await?;
    let tasks = d.ctr(&["tasks", "ls", "-q"]).await?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mut left = Vec::new();
    for id in ids {
        if containers.lines().any(|l| l.trim() == id) {
            left.push(format!("containerd container {id}"));
        }
        if tasks.lines().any(|l| l.trim() == id) {
            left.push(format!("containerd task {id}"));
        }
        left.extend(
            mountinfo
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| m.contains(id.as_str()))
                .map(|m| format!("mount {m}")),
        );
    }
    ensure!(left.is_empty(), "left behind: {left:?}");
    Ok(())
}

/// Limits in the files, UpdateContainerResources, stats, exec, cleanup.
async fn limits_update_stats_exec(d: &Daemon, driver: Driver, h: Hierarchy) -> anyhow::Result<()> {
    let image = busybox();
    d.pull(&image).await?;
    let pod = run_pod(d, "cg-limits", driver, h).await?;
    let mut cfg = container_config(
        "limited",
        &image,
        &["sh", "-c", "while true; do sleep 1; done"],
    );
    cfg.linux = Some(cubelet_e2e::cri::LinuxContainerConfig {
        resources: Some(resources(64 * MIB, 50_000, 512)),
        ..Default::default()
    });
    let id = d.start_in(&pod.id, &pod.config, cfg).await?;
    let result = async {
        assert_limits(&pod.cgroups, &id, 64 * MIB, 50_000, 100_000, 512)?;
        let mut rt = d.runtime.clone();
        rt.update_container_resources(UpdateContainerResourcesRequest {
            container_id: id.clone(),
            linux: Some(resources(96 * MIB, 20_000, 256)),
            ..Default::default()
        })
        .await
        .context("UpdateContainerResources")?;
        assert_limits(&pod.cgroups, &id, 96 * MIB, 20_000, 100_000, 256)?;

        let out = rt
            .exec_sync(ExecSyncRequest {
                container_id: id.clone(),
                cmd: vec!["sh".into(), "-c".into(), "echo cgroup-exec".into()],
                timeout: 10,
            })
            .await
            .context("ExecSync")?
            .into_inner();
        ensure!(out.exit_code == 0, "exec exit {}", out.exit_code);
        ensure!(
            String::from_utf8_lossy(&out.stdout).trim() == "cgroup-exec",
            "exec stdout {:?}",
            String::from_utf8_lossy(&out.stdout)
        );

        let stats = rt
            .container_stats(ContainerStatsRequest {
                container_id: id.clone(),
            })
            .await
            .context("ContainerStats")?
            .into_inner()
            .stats
            .context("no stats")?;
        let cpu = stats
            .cpu
            .and_then(|c| c.usage_core_nano_seconds)
            .map_or(0, |v| v.value);
        let mem = stats.memory.context("no memory stats")?;
        let ws = mem.working_set_bytes.map_or(0, |v| v.value);
        ensure!(cpu > 0, "container CPU usage {cpu}");
        ensure!(ws > 0, "container working set {ws}");
        ensure!(
            mem.available_bytes.map_or(0, |v| v.value) > 0,
            "available bytes under a 96 MiB limit: {mem:?}"
        );
        let pod_stats = rt
            .pod_sandbox_stats(PodSandboxStatsRequest {
                pod_sandbox_id: pod.id.clone(),
            })
            .await
            .context("PodSandboxStats")?
            .into_inner()
            .stats
            .and_then(|s| s.linux)
            .context("no linux pod stats")?;
        let pod_ws = pod_stats
            .memory
            .and_then(|m| m.working_set_bytes)
            .map_or(0, |v| v.value);
        ensure!(pod_ws > 0, "pod working set {pod_ws}");
        anyhow::Ok(())
    }
    .await;
    let removed = stop_and_remove(d, &pod, std::slice::from_ref(&id)).await;
    result.and(removed)?;
    audit_ids(d, &[pod.id, id]).await
}

/// A container allocating past its memory limit is reported `OOMKilled`.
async fn oom_killed(d: &Daemon, driver: Driver, h: Hierarchy) -> anyhow::Result<()> {
    let image = busybox();
    d.pull(&image).await?;
    let pod = run_pod(d, "cg-oom", driver, h).await?;
    // The string doubles until it no longer fits in 16 MiB.
    let mut cfg = container_config(
        "hog",
        &image,
        &[
            "sh",
            "-c",
            "x=0123456789abcdef; while true; do x=$x$x; done",
        ],
    );
    cfg.linux = Some(cubelet_e2e::cri::LinuxContainerConfig {
        resources: Some(resources(16 * MIB, 0, 2)),
        ..Default::default()
    });
    let id = d.start_in(&pod.id, &pod.config, cfg).await?;
    let result = async {
        eventually("the hog to exit", Duration::from_secs(60), || async {
            Ok(d.container_status(&id).await?.state
                == cubelet_e2e::cri::ContainerState::ContainerExited as i32)
        })
        .await?;
        let st = d.container_status(&id).await?;
        ensure!(
            st.reason == "OOMKilled",
            "reason {:?} (exit code {}), want OOMKilled",
            st.reason,
            st.exit_code
        );
        ensure!(st.exit_code == 137, "exit code {}, want 137", st.exit_code);
        anyhow::Ok(())
    }
    .await;
    let removed = stop_and_remove(d, &pod, std::slice::from_ref(&id)).await;
    result.and(removed)?;
    audit_ids(d, &[pod.id, id]).await
}

/// The driver is reported, and a parent it cannot use is refused naming
/// the field, before anything is made.
async fn driver_reported_and_bad_parent_refused(d: &Daemon, driver: Driver) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    let cfg = rt
        .runtime_config(RuntimeConfigRequest::default())
        .await
        .context("RuntimeConfig")?
        .into_inner();
    let reported = cfg.linux.map(|l| l.cgroup_driver);
    let want = match driver {
        Driver::Systemd => cubelet_e2e::cri::CgroupDriver::Systemd,
        Driver::Cgroupfs => cubelet_e2e::cri::CgroupDriver::Cgroupfs,
    } as i32;
    ensure!(
        reported == Some(want),
        "RuntimeConfig cgroup_driver {reported:?}, want {driver:?}"
    );
    let info = rt
        .status(cubelet_e2e::cri::StatusRequest { verbose: true })
        .await
        .context("Status")?
        .into_inner()
        .info;
    let name = match driver {
        Driver::Systemd => "\"systemd\"",
        Driver::Cgroupfs => "\"cgroupfs\"",
    };
    ensure!(
        info.get("cgroupDriver").map(String::as_str) == Some(name),
        "Status info cgroupDriver {:?}, want {name}",
        info.get("cgroupDriver")
    );
    let bad = match driver {
        Driver::Systemd => "/kubepods/burstable/podx",
        Driver::Cgroupfs => "/kubepods/../../x",
    };
    let uid = format!("cg-bad-{}", std::process::id());
    let mut config = pod_config("cg-bad", &uid, &d.log_base.join("cg-bad"));
    config.linux = Some(LinuxPodSandboxConfig {
        cgroup_parent: bad.to_owned(),
        ..Default::default()
    });
    let before = d.pod_ids().await?;
    let err = d
        .run_pod(&config, "")
        .await
        .err()
        .context("a bad cgroup_parent was accepted")?;
    let status = err
        .chain()
        .find_map(|e| e.downcast_ref::<tonic::Status>())
        .context("no gRPC status")?;
    ensure!(
        status.code() == tonic::Code::InvalidArgument
            && status.message().contains("config.linux.cgroup_parent"),
        "{status:?}"
    );
    ensure!(d.pod_ids().await? == before, "a refused pod was recorded");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cgroups() {
    if let Some(reason) = attach_skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let h = hierarchy().expect("cgroup hierarchy");
    let driver = expected_driver(h).expect("cgroup driver");
    println!("cgroups: driver {driver:?}, hierarchy {h:?}");
    let d = Daemon::start_or_attach(DaemonOpts::default())
        .await
        .expect("start or attach to the daemon");
    let mut failures = Vec::new();
    type Case<'a> = (
        &'static str,
        futures::future::BoxFuture<'a, anyhow::Result<()>>,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "driver_reported_and_bad_parent_refused",
            Box::pin(driver_reported_and_bad_parent_refused(&d, driver)),
        ),
        (
            "limits_update_stats_exec",
            Box::pin(limits_update_stats_exec(&d, driver, h)),
        ),
        ("oom_killed", Box::pin(oom_killed(&d, driver, h))),
    ];
    for (name, case) in cases {
        match tokio::time::timeout(Duration::from_secs(180), case).await {
            Ok(Ok(())) => println!("cgroups: {name} ... ok"),
            Ok(Err(e)) => failures.push(format!("{name}: {e:#}")),
            Err(_) => failures.push(format!("{name}: timed out")),
        }
    }
    if !d.is_attached() {
        match leaks(&d).await {
            Ok(l) if l.is_empty() => {}
            Ok(l) => failures.push(format!("leaked:\n  {}", l.join("\n  "))),
            Err(e) => failures.push(format!("leak audit: {e:#}")),
        }
    }
    let log = d.log_tail(60);
    if let Err(e) = d.teardown().await {
        failures.push(format!("teardown: {e:#}"));
    }
    assert!(
        failures.is_empty(),
        "{}\ndaemon log tail:\n{log}",
        failures.join("\n")
    );
}

#[test]
fn slices_expand_as_systemd_nests_them() {
    assert_eq!(
        expand_slice("cbe2e1-burstable-podx.slice"),
        "/cbe2e1.slice/cbe2e1-burstable.slice/cbe2e1-burstable-podx.slice"
    );
    assert_eq!(weights_for(2)[0], 1);
    assert_eq!(weights_for(1024)[0], 39);
    assert_eq!(weights_for(512), [20, 59]);
}
