//! User namespaces, recursive read-only mounts and SupplementalGroupsPolicy
//! over the real socket, as kubelet and critest use them, with the kernel
//! checked afterwards: the pod's uid map and the ids its processes have on
//! the node, read-only submounts, the staged mounts gone once the task
//! exists, and the GC of staged mounts after a kill -9.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use cubelet_e2e::cri::{
    ContainerStatusRequest, CreateContainerRequest, ExecSyncRequest, IdMapping,
    LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, Mount, MountPropagation, NamespaceMode, NamespaceOption,
    PodSandboxConfig, RemovePodSandboxRequest, StatusRequest, StopPodSandboxRequest,
    SupplementalGroupsPolicy, UserNamespace,
};
use cubelet_e2e::{container_config, eventually, mounts_under, Daemon, DaemonOpts, REGISTRY};

/// `assert_eq!` that fails the scenario (so the daemon is still torn down
/// and the host cleaned) instead of panicking past the teardown.
macro_rules! check_eq {
    ($a:expr, $b:expr) => {
        check_eq!($a, $b, "")
    };
    ($a:expr, $b:expr, $($m:tt)+) => {{
        let (a, b) = (&$a, &$b);
        anyhow::ensure!(*a == *b, "{:?} != {:?}: {}", a, b, format!($($m)+));
    }};
}

fn busybox() -> String {
    format!("{REGISTRY}/busybox:test")
}

async fn with_daemon(
    index: u8,
    scenario: for<'a> fn(&'a Daemon) -> futures::future::BoxFuture<'a, anyhow::Result<()>>,
) {
    with_daemon_config(index, "", scenario).await;
}

/// [`with_daemon`] with `extra` added to the daemon's configuration.
async fn with_daemon_config(
    index: u8,
    extra: &str,
    scenario: for<'a> fn(&'a Daemon) -> futures::future::BoxFuture<'a, anyhow::Result<()>>,
) {
    let opts = DaemonOpts {
        index,
        extra_config: Some(format!("gc: {{ interval: 1s }}\n{extra}")),
        ..Default::default()
    };
    cubelet_e2e::with_daemon(opts, Duration::from_secs(240), scenario).await;
}

/// ExecSync `cmd` in `cid`: (exit code, stdout, stderr).
async fn exec(d: &Daemon, cid: &str, cmd: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let r = d
        .runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: cid.to_owned(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            timeout: 10,
        })
        .await
        .with_context(|| format!("ExecSync {cmd:?}"))?
        .into_inner();
    Ok((
        r.exit_code,
        String::from_utf8_lossy(&r.stdout).into_owned(),
        String::from_utf8_lossy(&r.stderr).into_owned(),
    ))
}

async fn remove_pod(d: &Daemon, pod: &str) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: pod.to_owned(),
    })
    .await?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: pod.to_owned(),
    })
    .await?;
    Ok(())
}

fn userns_pod(d: &Daemon, name: &str, host_id: u32) -> PodSandboxConfig {
    let map = IdMapping {
        host_id,
        container_id: 0,
        length: 65536,
    };
    let mut cfg = d.pod_config(name);
    cfg.linux = Some(LinuxPodSandboxConfig {
        security_context: Some(LinuxSandboxSecurityContext {
            namespace_options: Some(NamespaceOption {
                userns_options: Some(UserNamespace {
                    mode: NamespaceMode::Pod as i32,
                    uids: vec![map],
                    gids: vec![map],
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    cfg
}

/// The `Uid:` line of `/proc/<pid>/status` on the node: real, effective,
/// saved and fs uid.
fn node_uids(pid: u32) -> anyhow::Result<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|u| u.split_whitespace().collect::<Vec<_>>().join(" "))
        .context("no Uid line")
}

async fn user_namespace_pod(d: &Daemon) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    let status = rt
        .status(StatusRequest { verbose: false })
        .await?
        .into_inner();
    let default = status
        .runtime_handlers
        .iter()
        .find(|h| h.name.is_empty())
        .context("no entry for the default handler")?;
    let features = default.features.context("no handler features")?;
    anyhow::ensure!(features.recursive_read_only_mounts);
    if !features.user_namespaces {
        println!("SKIP: this node cannot make user namespaces");
        return Ok(());
    }
    anyhow::ensure!(status
        .features
        .is_some_and(|f| f.supplemental_groups_policy));

    d.pull(&busybox()).await?;
    let host_id = 300_000;
    let pod_cfg = userns_pod(d, "userns", host_id);
    let pod = d.run_pod(&pod_cfg, "").await?;
    // A volume as kubelet gives one to such a pod: owned by node root, not
    // writable by others, with the pod's mappings on the mount.
    let volume = tempfile::Builder::new()
        .prefix("cubelet-e2e-idmap")
        .tempdir()?;
    std::fs::write(volume.path().join("from-node"), b"x")?;
    let map = IdMapping {
        host_id,
        container_id: 0,
        length: 65536,
    };
    let mut cfg = container_config("app", &busybox(), &["sleep", "3600"]);
    cfg.mounts = vec![Mount {
        container_path: "/vol".into(),
        host_path: volume.path().display().to_string(),
        uid_mappings: vec![map],
        gid_mappings: vec![map],
        ..Default::default()
    }];
    // kubelet copies the pod's options into each container.
    cfg.linux = Some(LinuxContainerConfig {
        security_context: Some(LinuxContainerSecurityContext {
            namespace_options: pod_cfg
                .linux
                .as_ref()
                .and_then(|l| l.security_context.as_ref())
                .and_then(|s| s.namespace_options.clone()),
            ..Default::default()
        }),
        ..Default::default()
    });
    let cid = d.start_in(&pod, &pod_cfg, cfg).await?;
    let (_, map, _) = exec(d, &cid, &["cat", "/proc/self/uid_map"]).await?;
    check_eq!(
        map.split_whitespace().collect::<Vec<_>>(),
        ["0", "300000", "65536"],
        "{map}"
    );
    // The container's root is node uid 300000, not root.
    let st = d.container_status(&cid).await?;
    let pid = d
        .runtime
        .clone()
        .container_status(ContainerStatusRequest {
            container_id: cid.clone(),
            verbose: true,
        })
        .await?
        .into_inner()
        .info
        .get("info")
        .and_then(|i| serde_json::from_str::<serde_json::Value>(i).ok())
        .and_then(|v| v["pid"].as_u64())
        .context("no pid in verbose status")?;
    check_eq!(
        node_uids(u32::try_from(pid)?)?,
        "300000 300000 300000 300000"
    );
    check_eq!(
        st.user.and_then(|u| u.linux).map(|l| (l.uid, l.gid)),
        Some((0, 0))
    );
    // The rootfs is idmapped: root owns it and may write to /, and files the
    // image's root owns are its own.
    let (code, out, err) = exec(
        d,
        &cid,
        &[
            "sh",
            "-c",
            "touch /made-in-userns && stat -c %u:%g / /bin/busybox /made-in-userns",
        ],
    )
    .await?;
    check_eq!(code, 0, "{err}");
    check_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        ["0:0", "0:0", "0:0"]
    );
    // The volume is idmapped: the pod's root owns what node root owns, and
    // what it writes is node root's on the node.
    let (code, out, err) = exec(
        d,
        &cid,
        &[
            "sh",
            "-c",
            "touch /vol/from-pod && stat -c %u:%g /vol /vol/from-node",
        ],
    )
    .await?;
    check_eq!(code, 0, "{err}");
    check_eq!(out.split_whitespace().collect::<Vec<_>>(), ["0:0", "0:0"]);
    {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(volume.path().join("from-pod"))?;
        check_eq!((md.uid(), md.gid()), (0, 0), "owner on the node");
    }
    // Nothing idmapped is left mounted on the node once the task exists.
    anyhow::ensure!(
        mounts_under(&[&d.state_dir.join("runtime").join("staged")]).is_empty(),
        "staged layers left mounted"
    );
    // The pod's user namespace is pinned beside its netns, and goes with it.
    let pin = d.state_dir.join("userns").join(&pod);
    anyhow::ensure!(pin.exists(), "{} missing", pin.display());

    // Refused as critest refuses them: two mappings, container id 0 not
    // mapped, modes CONTAINER and TARGET; and with the node's network.
    let mut bad = Vec::new();
    let mut two = userns_pod(d, "two", host_id);
    if let Some(u) = two
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|s| s.namespace_options.as_mut())
        .and_then(|n| n.userns_options.as_mut())
    {
        u.uids.push(u.uids[0]);
    }
    bad.push(two);
    let mut shifted = userns_pod(d, "shifted", host_id);
    if let Some(u) = shifted
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|s| s.namespace_options.as_mut())
        .and_then(|n| n.userns_options.as_mut())
    {
        u.uids[0].container_id = 1;
    }
    bad.push(shifted);
    for mode in [NamespaceMode::Container, NamespaceMode::Target] {
        let mut c = d.pod_config("mode");
        c.linux = Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption {
                    userns_options: Some(UserNamespace {
                        mode: mode as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        bad.push(c);
    }
    let mut hostnet = userns_pod(d, "hostnet", host_id);
    if let Some(n) = hostnet
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|s| s.namespace_options.as_mut())
    {
        n.network = NamespaceMode::Node as i32;
    }
    bad.push(hostnet);
    for c in &bad {
        let Err(e) = d.run_pod(c, "").await else {
            bail!("RunPodSandbox accepted {:?}", c.metadata);
        };
        let status = e
            .downcast_ref::<tonic::Status>()
            .context("not a gRPC status")?;
        check_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    }

    remove_pod(d, &pod).await?;
    anyhow::ensure!(!pin.exists(), "userns pin left after RemovePodSandbox");
    Ok(())
}

/// A host directory with a tmpfs mounted inside, as critest makes one.
struct HostTree {
    dir: tempfile::TempDir,
}

impl HostTree {
    fn new() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("cubelet-e2e-rro")
            .tempdir()?;
        let sub = dir.path().join("tmpfs");
        std::fs::create_dir(&sub)?;
        nix::mount::mount(
            Some("none"),
            &sub,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )?;
        Ok(Self { dir })
    }
}

impl Drop for HostTree {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(
            &self.dir.path().join("tmpfs"),
            nix::mount::MntFlags::MNT_DETACH,
        );
    }
}

fn rro_mount(host: &Path, readonly: bool, propagation: MountPropagation) -> Mount {
    Mount {
        container_path: "/mnt".into(),
        host_path: host.display().to_string(),
        readonly,
        recursive_read_only: true,
        propagation: propagation as i32,
        ..Default::default()
    }
}

async fn recursive_read_only_mounts(d: &Daemon) -> anyhow::Result<()> {
    d.pull(&busybox()).await?;
    let tree = HostTree::new()?;
    let pod_cfg = d.pod_config("rro");
    let pod = d.run_pod(&pod_cfg, "").await?;
    let mut cfg = container_config("rro", &busybox(), &["sleep", "3600"]);
    cfg.mounts = vec![rro_mount(
        tree.dir.path(),
        true,
        MountPropagation::PropagationPrivate,
    )];
    let cid = d.start_in(&pod, &pod_cfg, cfg.clone()).await?;
    for path in ["/mnt/top", "/mnt/tmpfs/below"] {
        let (code, out, err) = exec(d, &cid, &["touch", path]).await?;
        anyhow::ensure!(code != 0, "{path} writable: {out}");
        anyhow::ensure!(err.contains("Read-only file system"), "{path}: {err}");
    }
    // The node's tree stays writable, and nothing staged stays mounted once
    // the task exists.
    std::fs::write(tree.dir.path().join("tmpfs").join("node"), b"x")?;
    anyhow::ensure!(mounts_under(&[&d.state_dir.join("runtime").join("staged")]).is_empty());
    let st = d.container_status(&cid).await?;
    check_eq!(st.mounts.len(), 1);
    check_eq!(
        st.mounts[0].host_path,
        tree.dir.path().display().to_string()
    );

    // critest's refusals: read-write, and propagation other than private.
    for (readonly, prop) in [
        (false, MountPropagation::PropagationPrivate),
        (true, MountPropagation::PropagationHostToContainer),
        (true, MountPropagation::PropagationBidirectional),
    ] {
        let mut bad = container_config("bad", &busybox(), &["true"]);
        bad.mounts = vec![rro_mount(tree.dir.path(), readonly, prop)];
        let Err(e) = d
            .runtime
            .clone()
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(bad),
                sandbox_config: Some(pod_cfg.clone()),
            })
            .await
        else {
            bail!("CreateContainer accepted readonly={readonly} {prop:?}");
        };
        check_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    }
    remove_pod(d, &pod).await?;
    Ok(())
}

async fn groups_of(
    d: &Daemon,
    pod: &str,
    pod_cfg: &PodSandboxConfig,
    name: &str,
    policy: SupplementalGroupsPolicy,
) -> anyhow::Result<(String, Vec<i64>)> {
    let mut cfg = container_config(name, &busybox(), &["sleep", "3600"]);
    cfg.linux = Some(LinuxContainerConfig {
        security_context: Some(LinuxContainerSecurityContext {
            run_as_user: Some(cubelet_e2e::cri::Int64Value { value: 1000 }),
            supplemental_groups: vec![1234],
            supplemental_groups_policy: policy as i32,
            ..Default::default()
        }),
        ..Default::default()
    });
    let cid = d.start_in(pod, pod_cfg, cfg).await?;
    let (_, out, _) = exec(d, &cid, &["id", "-G"]).await?;
    let mut groups = d
        .container_status(&cid)
        .await?
        .user
        .and_then(|u| u.linux)
        .map(|l| l.supplemental_groups)
        .unwrap_or_default();
    groups.sort_unstable();
    Ok((out.trim().to_owned(), groups))
}

async fn supplemental_groups_policy(d: &Daemon) -> anyhow::Result<()> {
    d.pull(&busybox()).await?;
    let pod_cfg = d.pod_config("groups");
    let pod = d.run_pod(&pod_cfg, "").await?;
    // busybox:test's /etc/group puts tester (uid 1000) in cubelet-extra (50000).
    let merge = groups_of(d, &pod, &pod_cfg, "merge", SupplementalGroupsPolicy::Merge).await?;
    check_eq!(
        merge,
        ("1000 1234 50000".to_owned(), vec![1000, 1234, 50000])
    );
    let strict = groups_of(
        d,
        &pod,
        &pod_cfg,
        "strict",
        SupplementalGroupsPolicy::Strict,
    )
    .await?;
    check_eq!(strict, ("1000 1234".to_owned(), vec![1000, 1234]));

    // An image whose `User` names its group (`tester:cubelet-extra`), as
    // Docker and containerd read it: the gid from the image's /etc/group.
    let usergroup = format!("{REGISTRY}/busybox-usergroup:test");
    d.pull(&usergroup).await?;
    let cid = d
        .start_in(
            &pod,
            &pod_cfg,
            container_config("usergroup", &usergroup, &["sleep", "3600"]),
        )
        .await?;
    let (_, ids, _) = exec(d, &cid, &["sh", "-c", "id -u; id -g; id -G"]).await?;
    check_eq!(ids, "1000\n50000\n50000\n");
    let user = d
        .container_status(&cid)
        .await?
        .user
        .and_then(|u| u.linux)
        .context("no user in the status")?;
    check_eq!((user.uid, user.gid), (1000, 50000));
    remove_pod(d, &pod).await?;
    Ok(())
}

/// A staged mount of a container the daemon never recorded (killed between
/// staging and the record): what the GC must take.
fn seed_orphan_stage(d: &Daemon, source: &Path) -> anyhow::Result<std::path::PathBuf> {
    let dir = d
        .state_dir
        .join("runtime")
        .join("staged")
        .join(format!("{:0>64}", "0ddba11"));
    let target = dir.join("0");
    std::fs::create_dir_all(&target)?;
    nix::mount::mount(
        Some(source),
        &target,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND | nix::mount::MsFlags::MS_REC,
        None::<&str>,
    )?;
    Ok(dir)
}

async fn staged_mounts_survive_nothing_after_kill9(d: &Daemon) -> anyhow::Result<()> {
    d.pull(&busybox()).await?;
    let tree = HostTree::new()?;
    let pod_cfg = d.pod_config("kill9");
    let pod = d.run_pod(&pod_cfg, "").await?;
    let mut cfg = container_config("staged", &busybox(), &["sleep", "3600"]);
    cfg.mounts = vec![rro_mount(
        tree.dir.path(),
        true,
        MountPropagation::PropagationPrivate,
    )];
    // Created, never started: its staged mount is still on the node.
    let cid = d
        .runtime
        .clone()
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(cfg),
            sandbox_config: Some(pod_cfg.clone()),
        })
        .await?
        .into_inner()
        .container_id;
    let staged = d.state_dir.join("runtime").join("staged").join(&cid);
    if mounts_under(&[&staged]).is_empty() {
        bail!("no staged mount for a created container");
    }
    d.kill9().await?;
    let orphan = seed_orphan_stage(d, tree.dir.path())?;
    d.start_with_env(&[]).await?;
    // The GC takes the orphan; the known container keeps its mount until
    // it is removed.
    eventually(
        "the GC unmounts the orphan",
        Duration::from_secs(30),
        || async { Ok(!orphan.exists()) },
    )
    .await?;
    anyhow::ensure!(mounts_under(&[&orphan]).is_empty());
    anyhow::ensure!(
        !mounts_under(&[&staged]).is_empty(),
        "a live container's mount taken"
    );
    remove_pod(d, &pod).await?;
    anyhow::ensure!(mounts_under(&[&staged]).is_empty());
    anyhow::ensure!(!staged.exists());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_in_its_own_user_namespace() {
    with_daemon(31, |d| Box::pin(user_namespace_pod(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recursive_read_only_mounts_are_read_only_below() {
    with_daemon(32, |d| Box::pin(recursive_read_only_mounts(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supplemental_groups_merge_and_strict() {
    with_daemon(33, |d| Box::pin(supplemental_groups_policy(d))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_unmounts_staged_mounts_after_kill9() {
    // With the task made at CreateContainer (the default) the staged mounts
    // go as soon as runc has its copy; a created container keeps them on
    // the node only when its task waits for the start.
    with_daemon_config(34, "runtime: { task_at_create: false }\n", |d| {
        Box::pin(staged_mounts_survive_nothing_after_kill9(d))
    })
    .await;
}
