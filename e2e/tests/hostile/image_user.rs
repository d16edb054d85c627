//! Images whose `/etc/passwd` and `/etc/group` attack the user lookup of a
//! container with `runAsUser` and no `runAsGroup` (the lookup that finds
//! its gid and groups): symlinks to `/dev/zero` (with the image's own
//! `/dev/zero` device node), FIFOs, and `/etc -> /etc`. Built by
//! `hack/test-images.sh` as `hostile-user-{zero,fifo,hostetc}:test`.
//!
//! Each CreateContainer answers within 10 s, with InvalidArgument or with a
//! container whose ids come from the image's own content (never the
//! host's), and no user-lookup mount is left. Before the fix (the files
//! read by path through the mounted rootfs): the FIFO image hung
//! CreateContainer with the rootfs left mounted, the `/dev/zero` image
//! read the host's `/dev/zero` until memory ran out, and the `/etc -> /etc`
//! image took its gids from the host's `/etc/group`.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{
    CreateContainerRequest, Int64Value, LinuxContainerConfig, LinuxContainerSecurityContext,
};
use cubelet_e2e::{container_config, mounts_under, with_daemon, Daemon, DaemonOpts, REGISTRY};

const IMAGES: [&str; 3] = [
    "hostile-user-zero",
    "hostile-user-fifo",
    "hostile-user-hostetc",
];

async fn create_as_uid_1000(d: &Daemon, image: &str) -> anyhow::Result<()> {
    let reference = format!("{REGISTRY}/{image}:test");
    d.pull(&reference).await?;
    let pod_cfg = d.pod_config(image);
    let pod = d.run_pod(&pod_cfg, "").await?;
    let mut cfg = container_config("lookup", &reference, &["sleep", "3600"]);
    cfg.linux = Some(LinuxContainerConfig {
        security_context: Some(LinuxContainerSecurityContext {
            run_as_user: Some(Int64Value { value: 1000 }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let started = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        d.runtime.clone().create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(cfg),
            sandbox_config: Some(pod_cfg),
        }),
    )
    .await
    .with_context(|| format!("{image}: CreateContainer did not answer within 10 s"))?;
    let took = started.elapsed();
    match answer {
        Ok(r) => {
            let id = r.into_inner().container_id;
            println!("{image}: created in {took:?}");
            // The image's own (absent) user database: uid 1000, gid 0, as
            // containerd gives a uid no passwd entry names; never the host's.
            let info: serde_json::Value =
                serde_json::from_str(&d.ctr(&["containers", "info", &id]).await?)?;
            let user = &info["Spec"]["process"]["user"];
            let gids: Vec<u64> = user["additionalGids"]
                .as_array()
                .map(|a| a.iter().filter_map(|g| g.as_u64()).collect())
                .unwrap_or_default();
            ensure!(
                user["uid"] == 1000 && user["gid"] == 0 && gids.iter().all(|g| *g == 0),
                "{image}: ids not from the image's own content: {user}"
            );
        }
        Err(status) => {
            println!(
                "{image}: {:?} in {took:?}: {}",
                status.code(),
                status.message()
            );
            ensure!(
                status.code() == tonic::Code::InvalidArgument,
                "{image}: expected InvalidArgument, got {status:?}"
            );
        }
    }
    let lookup_dir = d.state_dir.join("runtime").join("user-lookup");
    let left = mounts_under(&[&lookup_dir, &d.state_dir.join("runtime").join("mnt")]);
    ensure!(
        left.is_empty(),
        "{image}: user-lookup mounts left: {left:?}"
    );
    Ok(())
}

#[tokio::test]
async fn hostile_user_files_are_confined_to_the_rootfs() {
    with_daemon(
        DaemonOpts::default(),
        Duration::from_secs(300),
        |d: &Daemon| {
            Box::pin(async move {
                for image in IMAGES {
                    create_as_uid_1000(d, image).await?;
                }
                d.remove_all().await
            })
        },
    )
    .await;
}
