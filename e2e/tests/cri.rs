//! CRI end-to-end scenarios against one real `cubelet` daemon.
//!
//! Custom runner (`harness = false`, [`cubelet_e2e::scenario_main`]): the
//! daemon is started once, scenarios run in order, each under a timeout, each
//! followed by removing every pod through CRI and a leak audit of the kernel
//! and containerd; the daemon, bridge, nft table, dirs and containerd
//! namespace are torn down at the end. Positional arguments filter scenarios by substring; `--list` lists.
//! Without the private containerd every scenario prints `SKIP:` and passes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::*;
use cubelet_e2e::{container_config, image_spec, pod_config, Daemon, DaemonOpts, Scenario};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
const BUSYBOX_OCI: &str = "127.0.0.1:5000/busybox-oci:test";
const BUSYBOX_MULTI: &str = "127.0.0.1:5000/busybox-multi:test";

fn scenarios() -> Vec<Scenario> {
    vec![
        ("version_status_runtime_config", 30, |d| {
            Box::pin(version_status(d))
        }),
        ("images", 120, |d| Box::pin(images(d))),
        ("pod_lifecycle", 60, |d| Box::pin(pod_lifecycle(d))),
        ("list_pod_sandbox_filters", 60, |d| {
            Box::pin(list_filters(d))
        }),
        ("container_exit_code_and_logs", 60, |d| {
            Box::pin(container_exit(d))
        }),
        ("reopen_container_log_after_rotation", 60, |d| {
            Box::pin(reopen_log(d))
        }),
        ("stop_container_escalates_to_sigkill", 60, |d| {
            Box::pin(stop_escalates(d))
        }),
        ("cri_1_36_fields", 60, |d| Box::pin(cri_1_36_fields(d))),
        ("exec_sync", 60, |d| Box::pin(exec_sync(d))),
        ("stop_pod_sandbox_past_a_wedged_shim", 150, |d| {
            Box::pin(wedged_shim(d))
        }),
        ("runtime_handlers", 60, |d| Box::pin(handlers(d))),
        ("idempotent_retries", 60, |d| Box::pin(idempotent(d))),
        ("already_exists", 60, |d| Box::pin(already_exists(d))),
        ("bad_inputs", 60, |d| Box::pin(bad_inputs(d))),
        ("networking", 90, |d| Box::pin(networking(d))),
        ("metrics_after_traffic", 30, |d| Box::pin(metrics(d))),
        ("concurrent_run_pod_sandbox_same_pod", 60, |d| {
            Box::pin(concurrent_run(d))
        }),
        ("restart_keeps_pods_and_containers", 150, |d| {
            Box::pin(restart(d))
        }),
        ("bad_config_exits_2", 30, |d| Box::pin(bad_config(d))),
    ]
}

fn main() -> ExitCode {
    cubelet_e2e::scenario_main(DaemonOpts::default(), scenarios())
}

// ---------------------------------------------------------------- helpers

/// Runs pod `name` with its default config; returns its id and config.
async fn run_pod(d: &Daemon, name: &str) -> anyhow::Result<(String, PodSandboxConfig)> {
    let cfg = d.pod_config(name);
    Ok((d.run_pod(&cfg, "").await?, cfg))
}

async fn pod_status(d: &Daemon, id: &str) -> Result<PodSandboxStatus, tonic::Status> {
    let r = d
        .runtime
        .clone()
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: false,
        })
        .await?;
    r.into_inner()
        .status
        .ok_or_else(|| tonic::Status::internal("no status in response"))
}

async fn container_status(d: &Daemon, id: &str) -> Result<ContainerStatus, tonic::Status> {
    let r = d
        .runtime
        .clone()
        .container_status(ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: false,
        })
        .await?;
    r.into_inner()
        .status
        .ok_or_else(|| tonic::Status::internal("no status in response"))
}

/// Polls until the container has exited (bounded by the scenario timeout).
async fn wait_exited(d: &Daemon, id: &str) -> anyhow::Result<ContainerStatus> {
    loop {
        let s = container_status(d, id).await?;
        if s.state == ContainerState::ContainerExited as i32 {
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn exec(
    d: &Daemon,
    id: &str,
    cmd: &[&str],
    timeout: i64,
) -> Result<ExecSyncResponse, tonic::Status> {
    d.runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            timeout,
        })
        .await
        .map(tonic::Response::into_inner)
}

fn expect_code<T: std::fmt::Debug>(
    r: Result<T, tonic::Status>,
    code: Code,
    needle: &str,
    what: &str,
) -> anyhow::Result<()> {
    match r {
        Ok(v) => bail!("{what}: expected {code:?}, got OK {v:?}"),
        Err(s) => {
            ensure!(
                s.code() == code,
                "{what}: expected {code:?}, got {:?}: {}",
                s.code(),
                s.message()
            );
            ensure!(
                s.message().contains(needle),
                "{what}: message {:?} does not name {needle:?}",
                s.message()
            );
            Ok(())
        }
    }
}

// ---------------------------------------------------------------- scenarios

async fn version_status(d: &Daemon) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    let v = rt
        .version(VersionRequest {
            version: "v1".into(),
        })
        .await?
        .into_inner();
    ensure!(
        v.runtime_api_version == "v1",
        "runtime_api_version {:?}",
        v.runtime_api_version
    );
    ensure!(
        !v.runtime_name.is_empty() && !v.runtime_version.is_empty(),
        "version {v:?}"
    );
    let s = rt
        .status(StatusRequest { verbose: false })
        .await?
        .into_inner();
    let conds = s.status.context("no runtime status")?.conditions;
    for want in ["RuntimeReady", "NetworkReady"] {
        let c = conds
            .iter()
            .find(|c| c.r#type == want)
            .with_context(|| format!("no {want} in {conds:?}"))?;
        ensure!(c.status, "{want} false: {c:?}");
    }
    let rc = rt
        .runtime_config(RuntimeConfigRequest {})
        .await?
        .into_inner();
    let linux = rc.linux.context("RuntimeConfig without linux")?;
    ensure!(
        linux.cgroup_driver == CgroupDriver::Cgroupfs as i32,
        "cgroup driver {}",
        linux.cgroup_driver
    );
    Ok(())
}

async fn images(d: &Daemon) -> anyhow::Result<()> {
    let mut im = d.images.clone();
    let r1 = d.pull(BUSYBOX).await?;
    let r2 = d.pull(BUSYBOX_OCI).await?;
    let r3 = d.pull(BUSYBOX_MULTI).await?;
    ensure!(
        r1.starts_with("sha256:") && r2.starts_with("sha256:"),
        "image refs {r1} {r2}"
    );
    // The manifest list resolves to the amd64 child, which is busybox:test.
    ensure!(
        r3 == r1,
        "multi-arch pull chose {r3}, not the amd64 image {r1}"
    );

    let list = im
        .list_images(ListImagesRequest { filter: None })
        .await?
        .into_inner()
        .images;
    for tag in [BUSYBOX, BUSYBOX_OCI, BUSYBOX_MULTI] {
        let img = list
            .iter()
            .find(|i| i.repo_tags.iter().any(|t| t == tag))
            .with_context(|| format!("{tag} not in ListImages: {list:?}"))?;
        ensure!(img.size > 100_000, "{tag} size {}", img.size);
        let repo = tag.rsplit_once(':').map(|(r, _)| r).unwrap_or(tag);
        ensure!(
            img.repo_digests
                .iter()
                .any(|dg| dg.starts_with(&format!("{repo}@sha256:"))),
            "{tag} repo_digests {:?}",
            img.repo_digests
        );
    }

    let im2 = im.clone();
    let status = |image: &str| {
        let mut im = im2.clone();
        let spec = image_spec(image);
        async move {
            let r = im
                .image_status(ImageStatusRequest {
                    image: Some(spec),
                    verbose: false,
                })
                .await?;
            anyhow::Ok(r.into_inner().image)
        }
    };
    let oci = status(BUSYBOX_OCI)
        .await?
        .context("busybox-oci has no status")?;
    ensure!(oci.id == r2, "ImageStatus id {} != pulled {r2}", oci.id);
    ensure!(
        oci.username == "tester" && oci.uid.is_none(),
        "user of busybox-oci: {:?} {:?}",
        oci.uid,
        oci.username
    );
    let bb = status(BUSYBOX).await?.context("busybox has no status")?;
    ensure!(
        bb.repo_tags.iter().any(|t| t == BUSYBOX),
        "tags {:?}",
        bb.repo_tags
    );
    // By id and by digest as well as by tag.
    let by_id = status(&r1).await?.context("status by image id")?;
    ensure!(by_id.id == r1, "status by id {}", by_id.id);
    let digest = bb.repo_digests.first().context("no repo digest")?.clone();
    ensure!(
        status(&digest).await?.map(|i| i.id) == Some(r1.clone()),
        "status by digest {digest}"
    );
    ensure!(
        status("127.0.0.1:5000/busybox:absent").await?.is_none(),
        "absent image has a status"
    );

    let fs = im.image_fs_info(ImageFsInfoRequest {}).await?.into_inner();
    let first = fs
        .image_filesystems
        .first()
        .context("no image filesystem")?;
    let mp = first
        .fs_id
        .as_ref()
        .map(|f| f.mountpoint.clone())
        .unwrap_or_default();
    ensure!(
        mp.starts_with(cubelet_e2e::CONTAINERD_ROOT),
        "image fs mountpoint {mp:?}"
    );
    ensure!(
        first.used_bytes.as_ref().map(|u| u.value).unwrap_or(0) > 0,
        "image fs used {first:?}"
    );
    // A measurement answers the next call (the same timestamp) until a call
    // that changes the image filesystem; the removal below measures again.
    let measured_at = |fs: &ImageFsInfoResponse| fs.image_filesystems.first().map(|f| f.timestamp);
    let again = im.image_fs_info(ImageFsInfoRequest {}).await?.into_inner();
    ensure!(
        measured_at(&again) == measured_at(&fs),
        "a second ImageFsInfo measured again: {fs:?} then {again:?}"
    );

    for _ in 0..2 {
        im.remove_image(RemoveImageRequest {
            image: Some(image_spec(BUSYBOX_OCI)),
        })
        .await
        .context("RemoveImage busybox-oci (idempotent)")?;
    }
    ensure!(
        status(BUSYBOX_OCI).await?.is_none(),
        "busybox-oci still present after RemoveImage"
    );
    let after = im.image_fs_info(ImageFsInfoRequest {}).await?.into_inner();
    ensure!(
        measured_at(&after) > measured_at(&fs),
        "ImageFsInfo after RemoveImage answered from before it: {fs:?} then {after:?}"
    );
    im.remove_image(RemoveImageRequest {
        image: Some(image_spec("127.0.0.1:5000/never:pulled")),
    })
    .await
    .context("RemoveImage of an unknown image")?;
    // Pull by digest.
    ensure!(d.pull(&digest).await? == r1, "pull by digest");

    // Malformed references are the caller's error, naming the field; an
    // unknown tag is NotFound.
    for bad in [
        "Busybox",
        "busybox@sha256:abc",
        "../busybox",
        "127.0.0.1:5000/a//b",
    ] {
        let r = im
            .pull_image(PullImageRequest {
                image: Some(image_spec(bad)),
                auth: None,
                sandbox_config: None,
            })
            .await;
        expect_code(r, Code::InvalidArgument, "image reference", bad)?;
        let r = im
            .image_status(ImageStatusRequest {
                image: Some(image_spec(bad)),
                verbose: false,
            })
            .await;
        expect_code(r, Code::InvalidArgument, "image reference", bad)?;
    }
    let r = im
        .pull_image(PullImageRequest {
            image: Some(image_spec("127.0.0.1:5000/busybox:absent")),
            auth: None,
            sandbox_config: None,
        })
        .await;
    expect_code(r, Code::NotFound, "busybox:absent", "unknown tag")?;
    Ok(())
}

async fn pod_lifecycle(d: &Daemon) -> anyhow::Result<()> {
    let (id, _) = run_pod(d, "lifecycle").await?;
    let s = pod_status(d, &id).await?;
    ensure!(
        s.state == PodSandboxState::SandboxReady as i32,
        "state {}",
        s.state
    );
    let ip: std::net::Ipv4Addr = s
        .network
        .as_ref()
        .context("no network status")?
        .ip
        .parse()
        .context("pod ip")?;
    ensure!(
        ip.octets()[..3] == d.subnet.octets()[..3] && ip != d.gateway,
        "ip {ip} not a pod address in {}/24",
        d.subnet
    );
    // The netns pin lives under <state_dir>/netns and is a mounted nsfs
    // (beside the pins of the daemon's warm-pool shells).
    let pins: Vec<PathBuf> = d.pod_netns_pins().await?;
    ensure!(pins.len() == 1, "expected one netns pin, found {pins:?}");
    ensure!(pins[0].ends_with(&id), "the pin is not the pod's: {pins:?}");
    let mounted = cubelet_e2e::mounts_under(&[pins[0].as_path()]);
    ensure!(
        !mounted.is_empty(),
        "netns pin {} is not mounted",
        pins[0].display()
    );
    let dir = d.root_dir.join("sandboxes").join(&id);
    ensure!(dir.is_dir(), "no sandbox dir {}", dir.display());
    ensure!(
        s.metadata.as_ref().map(|m| m.name.as_str()) == Some("lifecycle"),
        "metadata {:?}",
        s.metadata
    );

    let mut rt = d.runtime.clone();
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("StopPodSandbox")?;
    let s = pod_status(d, &id).await?;
    ensure!(
        s.state == PodSandboxState::SandboxNotready as i32,
        "state after stop {}",
        s.state
    );
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("RemovePodSandbox")?;
    expect_code(
        pod_status(d, &id).await,
        Code::NotFound,
        "",
        "PodSandboxStatus after remove",
    )?;
    Ok(())
}

async fn list_filters(d: &Daemon) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    let (a, _) = run_pod(d, "filter-a").await?;
    let (b, _) = run_pod(d, "filter-b").await?;
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: b.clone(),
    })
    .await?;
    let list = |filter: PodSandboxFilter| {
        let mut rt = rt.clone();
        async move {
            let r = rt
                .list_pod_sandbox(ListPodSandboxRequest {
                    filter: Some(filter),
                })
                .await?;
            let mut ids: Vec<String> = r.into_inner().items.into_iter().map(|p| p.id).collect();
            ids.sort();
            anyhow::Ok(ids)
        }
    };
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    ensure!(
        list(PodSandboxFilter::default()).await? == both,
        "unfiltered list"
    );
    ensure!(
        list(PodSandboxFilter {
            id: a[..8].to_owned(),
            ..Default::default()
        })
        .await?
            == vec![a.clone()],
        "id prefix"
    );
    let state = |s: PodSandboxState| Some(PodSandboxStateValue { state: s as i32 });
    ensure!(
        list(PodSandboxFilter {
            state: state(PodSandboxState::SandboxReady),
            ..Default::default()
        })
        .await?
            == vec![a.clone()],
        "state ready"
    );
    ensure!(
        list(PodSandboxFilter {
            state: state(PodSandboxState::SandboxNotready),
            ..Default::default()
        })
        .await?
            == vec![b.clone()],
        "state notready"
    );
    let labels = |v: &str| {
        [("app".to_owned(), v.to_owned())]
            .into_iter()
            .collect::<HashMap<_, _>>()
    };
    ensure!(
        list(PodSandboxFilter {
            label_selector: labels("filter-b"),
            ..Default::default()
        })
        .await?
            == vec![b.clone()],
        "label selector"
    );
    ensure!(
        list(PodSandboxFilter {
            label_selector: labels("nobody"),
            ..Default::default()
        })
        .await?
        .is_empty(),
        "label selector without match"
    );
    Ok(())
}

/// Parses CRI log lines into (stream, tag, text).
fn parse_cri_log(text: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    text.lines()
        .map(|l| {
            let mut it = l.splitn(4, ' ');
            let (ts, stream, tag, msg) = (it.next(), it.next(), it.next(), it.next().unwrap_or(""));
            let ts = ts.context("empty line")?;
            ensure!(
                ts.len() >= 20 && ts.contains('T') && (ts.ends_with('Z') || ts.contains('+')),
                "timestamp {ts:?} in {l:?}"
            );
            ensure!(ts.contains('.'), "timestamp without fraction {ts:?}");
            let stream = stream.context("no stream")?;
            ensure!(
                stream == "stdout" || stream == "stderr",
                "stream {stream:?} in {l:?}"
            );
            let tag = tag.context("no tag")?;
            ensure!(tag == "P" || tag == "F", "tag {tag:?} in {l:?}");
            Ok((stream.to_owned(), tag.to_owned(), msg.to_owned()))
        })
        .collect()
}

async fn container_exit(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "exitcode").await?;
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config(
                "exit3",
                BUSYBOX,
                &["sh", "-c", "echo out; echo err >&2; exit 3"],
            ),
        )
        .await?;
    let s = wait_exited(d, &cid).await?;
    ensure!(s.exit_code == 3, "exit code {}", s.exit_code);
    ensure!(s.reason == "Error", "reason {:?}", s.reason);
    ensure!(
        s.started_at > 0 && s.finished_at >= s.started_at && s.created_at > 0,
        "times {s:?}"
    );
    let log_path = PathBuf::from(&cfg.log_directory).join("exit3.log");
    ensure!(
        s.log_path == "exit3.log" || Path::new(&s.log_path) == log_path,
        "status log_path {:?}",
        s.log_path
    );
    let mut lines = Vec::new();
    for _ in 0..50 {
        let text = tokio::fs::read_to_string(&log_path)
            .await
            .unwrap_or_default();
        lines = parse_cri_log(&text)?;
        if lines.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let want = [("stdout", "F", "out"), ("stderr", "F", "err")];
    for w in want {
        ensure!(
            lines
                .iter()
                .any(|(s, t, m)| (s.as_str(), t.as_str(), m.as_str()) == w),
            "log {} lacks {w:?}: {lines:?}",
            log_path.display()
        );
    }
    // A container that exits 0 is Completed.
    let ok = d
        .start_in(&pod, &cfg, container_config("exit0", BUSYBOX, &["true"]))
        .await?;
    let s = wait_exited(d, &ok).await?;
    ensure!(
        s.exit_code == 0 && s.reason == "Completed",
        "exit0: {} {:?}",
        s.exit_code,
        s.reason
    );
    Ok(())
}

/// Log rotation as kubelet does it: rename the live file, ask for a reopen,
/// and the container's output continues in a new file at the same path,
/// while the renamed one stops growing.
async fn reopen_log(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "rotate").await?;
    let script = "i=0; while :; do echo line$i; i=$((i+1)); sleep 0.1; done";
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("rotate", BUSYBOX, &["sh", "-c", script]),
        )
        .await?;
    let log = PathBuf::from(&cfg.log_directory).join("rotate.log");
    let rotated = log.with_extension("log.1");
    let lines_in = |path: PathBuf| async move {
        let text = tokio::fs::read_to_string(&path).await.unwrap_or_default();
        parse_cri_log(&text)
    };
    cubelet_e2e::eventually("first lines in the log", Duration::from_secs(10), || {
        let log = log.clone();
        async move { Ok(lines_in(log).await?.len() >= 3) }
    })
    .await?;
    tokio::fs::rename(&log, &rotated).await?;
    let reopen = |id: String| {
        let mut rt = d.runtime.clone();
        async move {
            rt.reopen_container_log(ReopenContainerLogRequest { container_id: id })
                .await
                .map(tonic::Response::into_inner)
        }
    };
    reopen(cid.clone()).await.context("ReopenContainerLog")?;
    cubelet_e2e::eventually("lines in the reopened log", Duration::from_secs(10), || {
        let log = log.clone();
        async move { Ok(lines_in(log).await?.len() >= 3) }
    })
    .await?;
    let old = lines_in(rotated.clone()).await?;
    let new = lines_in(log.clone()).await?;
    let number = |l: &(String, String, String)| l.2.trim_start_matches("line").parse::<u64>();
    let (last_old, first_new) = (
        old.last().context("rotated log is empty")?,
        new.first().context("new log is empty")?,
    );
    ensure!(
        number(last_old)? < number(first_new)?,
        "output went back in time: {last_old:?} then {first_new:?}"
    );
    // Nothing more goes to the renamed file.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let old_again = lines_in(rotated.clone()).await?;
    ensure!(
        old_again.len() == old.len(),
        "the rotated log still grows: {} then {} lines",
        old.len(),
        old_again.len()
    );

    expect_code(
        reopen("0123456789abcdef0123456789abcdef".into()).await,
        Code::NotFound,
        "0123456789abcdef",
        "ReopenContainerLog of an unknown container",
    )?;
    d.runtime
        .clone()
        .stop_container(StopContainerRequest {
            container_id: cid.clone(),
            timeout: 0,
        })
        .await
        .context("StopContainer")?;
    expect_code(
        reopen(cid.clone()).await,
        Code::FailedPrecondition,
        "not running",
        "ReopenContainerLog of a stopped container",
    )?;
    Ok(())
}

async fn stop_escalates(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "stubborn").await?;
    let script = "trap 'echo ignored TERM' TERM; echo ready; while true; do sleep 1; done";
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("stubborn", BUSYBOX, &["sh", "-c", script]),
        )
        .await?;
    let s = container_status(d, &cid).await?;
    ensure!(
        s.state == ContainerState::ContainerRunning as i32,
        "state {}",
        s.state
    );
    // Kubelet's pattern when it gives up on a pod: a stop with a long
    // grace period in flight, then one with a short one. The short one
    // kills at its own deadline (as containerd's CRI does) instead of
    // waiting out the first under the container's lock, and both answer.
    let long = tokio::spawn({
        let mut rt = d.runtime.clone();
        let cid = cid.clone();
        async move {
            rt.stop_container(StopContainerRequest {
                container_id: cid,
                timeout: 500,
            })
            .await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(!long.is_finished(), "the 500 s stop answered at once");
    tokio::time::timeout(
        Duration::from_secs(30),
        d.runtime.clone().stop_container(StopContainerRequest {
            container_id: cid.clone(),
            timeout: 2,
        }),
    )
    .await
    .context("StopContainer timeout 2 waited behind the 500 s stop")?
    .context("StopContainer timeout 2")?;
    tokio::time::timeout(Duration::from_secs(15), long)
        .await
        .context("the 500 s StopContainer did not answer after the kill")??
        .context("StopContainer timeout 500")?;
    let s = container_status(d, &cid).await?;
    ensure!(
        s.state == ContainerState::ContainerExited as i32,
        "not exited after StopContainer: {}",
        s.state
    );
    ensure!(
        s.exit_code == 137,
        "exit code {} (want 137, SIGKILL)",
        s.exit_code
    );
    Ok(())
}

/// What a Kubernetes 1.36 kubelet sends beyond the 1.32 CRI, against the
/// live daemon: the stop signal, UpdatePodSandboxResources, the Stream*
/// list calls, the image id contract (docs/cri-api.md).
async fn cri_1_36_fields(d: &Daemon) -> anyhow::Result<()> {
    use futures::StreamExt;
    let pulled = d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "cri136").await?;
    // Exits 42 on SIGUSR1 only: StopContainer must send the requested signal.
    let script = "trap 'exit 42' USR1; trap 'echo ignored TERM' TERM; while true; do sleep 1; done";
    let mut c = container_config("usr1", BUSYBOX, &["sh", "-c", script]);
    c.stop_signal = Signal::Sigusr1 as i32;
    let cid = d.start_in(&pod, &cfg, c).await?;
    let s = container_status(d, &cid).await?;
    ensure!(
        s.stop_signal == Signal::Sigusr1 as i32,
        "stop_signal {}",
        s.stop_signal
    );
    // PullImageResponse.image_ref == Image.id == ContainerStatus.image_id.
    ensure!(
        s.image_id == pulled,
        "image_id {} != pulled {pulled}",
        s.image_id
    );
    let listed = d
        .images
        .clone()
        .list_images(ListImagesRequest::default())
        .await?
        .into_inner()
        .images;
    ensure!(
        listed.iter().any(|i| i.id == pulled),
        "pulled {pulled} not an Image.id of ListImages"
    );

    // UpdatePodSandboxResources: checked, accepted.
    let mut rt = d.runtime.clone();
    let res = LinuxContainerResources {
        cpu_shares: 512,
        memory_limit_in_bytes: 128 << 20,
        ..Default::default()
    };
    rt.update_pod_sandbox_resources(UpdatePodSandboxResourcesRequest {
        pod_sandbox_id: pod.clone(),
        overhead: None,
        resources: Some(res.clone()),
    })
    .await
    .context("UpdatePodSandboxResources")?;
    expect_code(
        rt.update_pod_sandbox_resources(UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: "0123456789abcdef0123456789abcdef".into(),
            overhead: None,
            resources: Some(res.clone()),
        })
        .await,
        Code::NotFound,
        "0123456789abcdef",
        "UpdatePodSandboxResources of an unknown pod",
    )?;
    expect_code(
        rt.update_pod_sandbox_resources(UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: pod.clone(),
            overhead: Some(LinuxContainerResources {
                cpu_shares: 1,
                ..Default::default()
            }),
            resources: None,
        })
        .await,
        Code::InvalidArgument,
        "overhead.cpu_shares",
        "UpdatePodSandboxResources with bad overhead",
    )?;

    // The Stream* calls give the List calls' items.
    let filter = ContainerFilter {
        pod_sandbox_id: pod.clone(),
        ..Default::default()
    };
    let mut stream = rt
        .stream_containers(StreamContainersRequest {
            filter: Some(filter),
        })
        .await?
        .into_inner();
    let mut ids = Vec::new();
    while let Some(m) = stream.next().await {
        ids.extend(m?.containers.into_iter().map(|c| c.id));
    }
    ensure!(ids == vec![cid.clone()], "StreamContainers gave {ids:?}");
    let mut stream = d
        .images
        .clone()
        .stream_images(StreamImagesRequest::default())
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(m) = stream.next().await {
        n += m?.images.len();
    }
    ensure!(
        n == listed.len(),
        "StreamImages gave {n}, ListImages {}",
        listed.len()
    );

    // An image volume is refused naming the field, not mounted without it.
    let mut bad = container_config("imgvol", BUSYBOX, &["true"]);
    bad.mounts = vec![Mount {
        container_path: "/vol".into(),
        image: Some(image_spec(BUSYBOX)),
        image_sub_path: "bin".into(),
        ..Default::default()
    }];
    expect_code(
        rt.create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(bad),
            sandbox_config: Some(cfg.clone()),
        })
        .await,
        Code::Unimplemented,
        "config.mounts[0].image",
        "an image volume",
    )?;

    rt.stop_container(StopContainerRequest {
        container_id: cid.clone(),
        timeout: 10,
    })
    .await
    .context("StopContainer")?;
    let s = container_status(d, &cid).await?;
    ensure!(
        s.exit_code == 42,
        "exit code {} (want 42: SIGUSR1 trapped)",
        s.exit_code
    );
    Ok(())
}

async fn exec_sync(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "exec").await?;
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("sleeper", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let r = exec(d, &cid, &["sh", "-c", "echo hi; echo oops >&2; exit 5"], 10).await?;
    ensure!(
        r.stdout == b"hi\n",
        "stdout {:?}",
        String::from_utf8_lossy(&r.stdout)
    );
    ensure!(
        r.stderr == b"oops\n",
        "stderr {:?}",
        String::from_utf8_lossy(&r.stderr)
    );
    ensure!(r.exit_code == 5, "exit code {}", r.exit_code);
    let r = exec(d, &cid, &["id", "-u"], 10).await?;
    ensure!(r.stdout == b"0\n" && r.exit_code == 0, "id -u: {r:?}");
    // A command that cannot be started ends as a shell's would.
    let r = exec(d, &cid, &["no-such-command"], 10).await?;
    ensure!(
        r.exit_code == 127 && String::from_utf8_lossy(&r.stderr).contains("not found"),
        "missing command: {r:?}"
    );
    let r = exec(d, &cid, &["/etc"], 10).await?;
    ensure!(r.exit_code == 126, "a directory as the command: {r:?}");
    // A container whose command the image lacks: the workload's fault
    // (FailedPrecondition naming it), never Internal, at create or start.
    let mut rt = d.runtime.clone();
    let failed = match rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(container_config("typo", BUSYBOX, &["no-such-command"])),
            sandbox_config: Some(cfg.clone()),
        })
        .await
    {
        Err(e) => e,
        Ok(r) => rt
            .start_container(StartContainerRequest {
                container_id: r.into_inner().container_id,
            })
            .await
            .err()
            .context("a container without its command started")?,
    };
    ensure!(
        failed.code() == Code::FailedPrecondition
            && failed.message().contains("executable file not found"),
        "missing command: {failed:?}"
    );
    expect_code(
        exec(d, &cid, &["sleep", "30"], 1).await,
        Code::DeadlineExceeded,
        "",
        "ExecSync timeout 1 s",
    )?;
    expect_code(
        exec(d, "0123456789abcdef", &["true"], 5).await,
        Code::NotFound,
        "",
        "ExecSync unknown container",
    )?;
    // A client deadline (`grpc-timeout`) that passes while the call runs is
    // DEADLINE_EXCEEDED from the server, as Go clients (kubelet, critest)
    // see it, not tonic's CANCELLED. A tonic client enforces the deadline
    // itself first, so the call goes out as raw HTTP/2.
    let req = ExecSyncRequest {
        container_id: cid.clone(),
        cmd: vec!["sleep".into(), "10".into()],
        timeout: 0,
    };
    let (status, message) = raw_grpc_status(
        &d.socket,
        "/runtime.v1.RuntimeService/ExecSync",
        &req,
        "500m",
    )
    .await?;
    ensure!(
        status == Code::DeadlineExceeded as i32,
        "ExecSync past the client's deadline: grpc-status {status}: {message}"
    );
    // Many calls at once on one pod: at most 16 run in its
    // shim at a time (more deadlocked containerd 1.6's), the rest wait
    // their turn and all succeed. Each counts the calls running as it
    // starts.
    let count =
        "mkdir -p /tmp/g && touch /tmp/g/$$ && ls /tmp/g | wc -l && sleep 1 && rm /tmp/g/$$";
    let cmd = ["sh", "-c", count];
    let calls = (0..40).map(|_| exec(d, &cid, &cmd, 60));
    let mut most = 0;
    for r in futures::future::join_all(calls).await {
        let r = r.map_err(|s| anyhow::anyhow!("a concurrent ExecSync failed: {s:?}"))?;
        ensure!(r.exit_code == 0, "concurrent ExecSync: {r:?}");
        let seen: usize = String::from_utf8_lossy(&r.stdout).trim().parse()?;
        most = most.max(seen);
    }
    ensure!(
        // cubelet_pod::MAX_EXECS_PER_POD
        (2..=16).contains(&most),
        "{most} ExecSync processes ran at once in one pod"
    );
    Ok(())
}

/// The pids of the processes whose command line is a runc shim's for task
/// `id` in containerd namespace `namespace`.
fn shim_pids(namespace: &str, id: &str) -> Vec<i32> {
    let want = format!("-namespace\0{namespace}\0-id\0{id}\0");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.starts_with(b"/usr/bin/containerd-shim-runc-v2\0")
                    && c.windows(want.len()).any(|w| w == want.as_bytes())
            })
        })
        .collect()
}

/// A pod whose shim answers nothing (stopped with SIGSTOP, as containerd
/// 1.6's deadlocks) is still stopped and removed: past
/// SHIM_ANSWER_TIMEOUT (30 s) the agent checks the shim, kills it, and
/// containerd cleans up after it. Without that the stop never returned.
async fn wedged_shim(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "wedged").await?;
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("sleeper", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let shims = shim_pids(&d.namespace, &pod);
    let [shim] = shims[..] else {
        bail!("pod {pod}: shims {shims:?}");
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shim),
        nix::sys::signal::Signal::SIGSTOP,
    )?;
    let started = std::time::Instant::now();
    let mut rt = d.runtime.clone();
    let mut stop = tonic::Request::new(StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    });
    stop.set_timeout(Duration::from_secs(120));
    let stopped = rt.stop_pod_sandbox(stop).await;
    // Never leave a stopped shim behind, whatever happened.
    if std::path::Path::new(&format!("/proc/{shim}")).exists() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(shim),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    stopped.map_err(|s| anyhow::anyhow!("StopPodSandbox past a wedged shim: {s:?}"))?;
    println!(
        "StopPodSandbox past a wedged shim: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let c = container_status(d, &cid).await?;
    ensure!(
        c.state == ContainerState::ContainerExited as i32,
        "container after the stop: {c:?}"
    );
    ensure!(
        shim_pids(&d.namespace, &pod).is_empty(),
        "the wedged shim is still there"
    );
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: pod,
    })
    .await?;
    Ok(())
}

/// Sends one unary gRPC call with a `grpc-timeout` header over plain
/// HTTP/2 (no client-side deadline) and returns the server's `grpc-status`
/// and `grpc-message`.
async fn raw_grpc_status(
    socket: &Path,
    path: &str,
    msg: &impl prost::Message,
    timeout: &str,
) -> anyhow::Result<(i32, String)> {
    use http_body_util::BodyExt;
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await?;
    tokio::spawn(conn);
    let payload = msg.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(payload.len())?.to_be_bytes());
    frame.extend_from_slice(&payload);
    let req = http::Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", timeout)
        .body(http_body_util::Full::new(bytes::Bytes::from(frame)))?;
    let resp = tokio::time::timeout(Duration::from_secs(20), send.send_request(req)).await??;
    let (parts, body) = resp.into_parts();
    let trailers = if parts.headers.contains_key("grpc-status") {
        parts.headers
    } else {
        body.collect()
            .await?
            .trailers()
            .cloned()
            .context("no trailers")?
    };
    let get = |k: &str| {
        trailers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    Ok((get("grpc-status").parse()?, get("grpc-message")))
}

async fn handlers(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let cfg = d.pod_config("alt");
    let pod = d.run_pod(&cfg, "runc-alt").await?;
    let s = pod_status(d, &pod).await?;
    ensure!(
        s.runtime_handler == "runc-alt",
        "runtime_handler {:?}",
        s.runtime_handler
    );
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("alt", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let state = Path::new(cubelet_e2e::RUNC_ALT_ROOT)
        .join(&d.namespace)
        .join(&cid);
    ensure!(
        state.is_dir(),
        "{} missing: container not run by runc-alt",
        state.display()
    );
    let default_state = Path::new(cubelet_e2e::RUNC_ROOT)
        .join(&d.namespace)
        .join(&cid);
    ensure!(
        !default_state.exists(),
        "{} exists too",
        default_state.display()
    );
    let r = exec(d, &cid, &["echo", "alt"], 10).await?;
    ensure!(r.stdout == b"alt\n", "exec in runc-alt container: {r:?}");

    let bad = d.pod_config("nohandler");
    let r = d
        .runtime
        .clone()
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(bad),
            runtime_handler: "kata-nope".into(),
        })
        .await;
    expect_code(
        r,
        Code::InvalidArgument,
        "runtime_handler",
        "unknown handler",
    )
}

async fn idempotent(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let mut rt = d.runtime.clone();
    let (p1, cfg) = run_pod(d, "idem").await?;
    let p2 = d.run_pod(&cfg, "").await?;
    ensure!(p1 == p2, "RunPodSandbox retry gave {p2}, first {p1}");
    let cid = d
        .start_in(
            &p1,
            &cfg,
            container_config("idem", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    for i in 0..2 {
        rt.stop_container(StopContainerRequest {
            container_id: cid.clone(),
            timeout: 1,
        })
        .await
        .with_context(|| format!("StopContainer #{i}"))?;
    }
    for i in 0..2 {
        rt.remove_container(RemoveContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .with_context(|| format!("RemoveContainer #{i}"))?;
    }
    expect_code(
        container_status(d, &cid).await,
        Code::NotFound,
        "",
        "ContainerStatus after remove",
    )?;
    for i in 0..2 {
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: p1.clone(),
        })
        .await
        .with_context(|| format!("StopPodSandbox #{i}"))?;
    }
    for i in 0..2 {
        rt.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: p1.clone(),
        })
        .await
        .with_context(|| format!("RemovePodSandbox #{i}"))?;
    }
    let unknown = "e2e0000000000000000000000000000000000000000000000000000000000000";
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: unknown.into(),
    })
    .await
    .context("StopPodSandbox unknown")?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: unknown.into(),
    })
    .await
    .context("RemovePodSandbox unknown")?;
    rt.stop_container(StopContainerRequest {
        container_id: unknown.into(),
        timeout: 1,
    })
    .await
    .context("StopContainer unknown")?;
    rt.remove_container(RemoveContainerRequest {
        container_id: unknown.into(),
    })
    .await
    .context("RemoveContainer unknown")?;
    Ok(())
}

async fn already_exists(d: &Daemon) -> anyhow::Result<()> {
    let (_p1, _) = run_pod(d, "twin").await?;
    let other = pod_config("twin", "uid-twin-other", &d.log_base.join("twin"));
    let r = d
        .runtime
        .clone()
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(other),
            runtime_handler: String::new(),
        })
        .await;
    expect_code(
        r,
        Code::AlreadyExists,
        "",
        "second pod with the same name/namespace/attempt",
    )
}

async fn bad_inputs(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let mut rt = d.runtime.clone();
    let run = |cfg: PodSandboxConfig| {
        let mut rt = rt.clone();
        async move {
            rt.run_pod_sandbox(RunPodSandboxRequest {
                config: Some(cfg),
                runtime_handler: String::new(),
            })
            .await
        }
    };
    let mut cfg = d.pod_config("bad");
    cfg.metadata.as_mut().context("metadata")?.name = String::new();
    expect_code(
        run(cfg).await,
        Code::InvalidArgument,
        "name",
        "empty pod name",
    )?;
    let mut cfg = d.pod_config("bad");
    cfg.log_directory = "relative/logs".into();
    expect_code(
        run(cfg).await,
        Code::InvalidArgument,
        "log_directory",
        "relative log_directory",
    )?;

    // What runc would refuse deep inside the create flow is refused at the
    // edge instead, naming the field.
    let mut cfg = d.pod_config("bad");
    cfg.linux.get_or_insert_with(Default::default).cgroup_parent = format!("/{}", "x".repeat(5000));
    expect_code(
        run(cfg).await,
        Code::InvalidArgument,
        "config.linux.cgroup_parent",
        "a 5000-character cgroup_parent",
    )?;
    let mut cfg = d.pod_config("bad");
    cfg.labels.insert("nul".into(), "a\0b".into());
    expect_code(
        run(cfg).await,
        Code::InvalidArgument,
        "config.labels",
        "a NUL byte in a label",
    )?;

    let (pod, cfg) = run_pod(d, "badc").await?;
    let c_id = d
        .start_in(
            &pod,
            &cfg,
            container_config("res", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    for (field, resources) in [
        (
            "linux.cpu_shares",
            LinuxContainerResources {
                cpu_shares: 1,
                ..Default::default()
            },
        ),
        (
            "linux.cpu_quota",
            LinuxContainerResources {
                cpu_quota: 10,
                ..Default::default()
            },
        ),
        (
            "linux.oom_score_adj",
            LinuxContainerResources {
                oom_score_adj: 5000,
                ..Default::default()
            },
        ),
    ] {
        expect_code(
            rt.update_container_resources(UpdateContainerResourcesRequest {
                container_id: c_id.clone(),
                linux: Some(resources),
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            field,
            "UpdateContainerResources out of range",
        )?;
    }
    rt.stop_container(StopContainerRequest {
        container_id: c_id.clone(),
        timeout: 0,
    })
    .await?;
    rt.remove_container(RemoveContainerRequest { container_id: c_id })
        .await?;
    let create = |c: ContainerConfig| {
        let mut rt = rt.clone();
        let req = CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(c),
            sandbox_config: Some(cfg.clone()),
        };
        async move { rt.create_container(req).await }
    };
    let mut c = container_config("badlog", BUSYBOX, &["true"]);
    c.log_path = "../escape.log".into();
    expect_code(
        create(c).await,
        Code::InvalidArgument,
        "log_path",
        "`..` in log_path",
    )?;
    let mut c = container_config("badmount", BUSYBOX, &["true"]);
    c.mounts.push(Mount {
        container_path: "/data".into(),
        host_path: "/tmp/../etc".into(),
        ..Default::default()
    });
    expect_code(
        create(c).await,
        Code::InvalidArgument,
        "mounts",
        "`..` in a mount host_path",
    )?;
    let mut c = container_config("badmount2", BUSYBOX, &["true"]);
    c.mounts.push(Mount {
        container_path: "/data/../../x".into(),
        host_path: "/tmp".into(),
        ..Default::default()
    });
    expect_code(
        create(c).await,
        Code::InvalidArgument,
        "mounts",
        "`..` in a mount container_path",
    )?;
    let mut c = container_config("", BUSYBOX, &["true"]);
    c.log_path = "empty.log".into();
    expect_code(
        create(c).await,
        Code::InvalidArgument,
        "name",
        "empty container name",
    )?;

    let unknown = "e2e1111111111111111111111111111111111111111111111111111111111111";
    expect_code(
        pod_status(d, unknown).await,
        Code::NotFound,
        "",
        "PodSandboxStatus unknown",
    )?;
    expect_code(
        container_status(d, unknown).await,
        Code::NotFound,
        "",
        "ContainerStatus unknown",
    )?;
    let r = rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: unknown.into(),
            config: Some(container_config("orphan", BUSYBOX, &["true"])),
            sandbox_config: Some(cfg.clone()),
        })
        .await;
    expect_code(r, Code::NotFound, "", "CreateContainer in an unknown pod")?;
    // Nothing half-created by the rejected requests.
    let cs = rt
        .list_containers(ListContainersRequest::default())
        .await?
        .into_inner()
        .containers;
    ensure!(cs.is_empty(), "rejected CreateContainer left {cs:?}");
    Ok(())
}

/// Serves one HTTP response on `listener` and returns what the client sent.
async fn serve_once(listener: tokio::net::TcpListener) -> anyhow::Result<String> {
    let (mut s, _) = listener.accept().await?;
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await?;
    s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 8\r\n\r\ngateway\n")
        .await?;
    s.shutdown().await?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

async fn networking(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pa, ca) = run_pod(d, "net-server").await?;
    let (pb, cb) = run_pod(d, "net-client").await?;
    let ip_a = pod_status(d, &pa).await?.network.context("net a")?.ip;
    let ip_b = pod_status(d, &pb).await?.network.context("net b")?.ip;
    ensure!(ip_a != ip_b, "two pods share {ip_a}");
    let server = d
        .start_in(
            &pa,
            &ca,
            container_config(
                "httpd",
                BUSYBOX,
                &["httpd", "-f", "-p", "8080", "-h", "/www"],
            ),
        )
        .await?;
    let client = d
        .start_in(
            &pb,
            &cb,
            container_config("client", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;

    // Pod to pod over the bridge (retry while httpd starts). busybox `nc`,
    // not `wget -T`: Debian's busybox-static wget segfaults with -T (also
    // on the host, outside any container), which is not Cubelet's doing.
    let get = format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip_a} 8080");
    let mut last = String::new();
    let mut reached = false;
    for _ in 0..30 {
        let r = exec(d, &client, &["sh", "-c", &get], 10).await?;
        let out = String::from_utf8_lossy(&r.stdout).into_owned();
        if r.exit_code == 0 && out.starts_with("HTTP/1.1 200") {
            ensure!(
                out.ends_with("\r\n\r\ncubelet test\n"),
                "pod-to-pod response {out:?}"
            );
            reached = true;
            break;
        }
        last = format!(
            "exit {} out {out:?} err {:?}",
            r.exit_code,
            String::from_utf8_lossy(&r.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if !reached {
        let st = container_status(d, &server).await?;
        bail!(
            "pod {ip_b} cannot reach {ip_a}:8080: {last} (httpd state {} exit {})",
            st.state,
            st.exit_code
        );
    }
    let r = exec(
        d,
        &client,
        &["sh", "-c", &format!("ping -c1 -W2 {ip_a}")],
        10,
    )
    .await?;
    ensure!(r.exit_code == 0, "ping {ip_a} from {ip_b}: {r:?}");

    // Host to pod.
    let mut s = tokio::net::TcpStream::connect((ip_a.parse::<std::net::Ipv4Addr>()?, 8080)).await?;
    s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    ensure!(
        body.ends_with("cubelet test\n"),
        "host-to-pod response {body:?}"
    );

    // Pod to the gateway (the bridge address, served by this test).
    let listener = tokio::net::TcpListener::bind((d.gateway, 0)).await?;
    let port = listener.local_addr()?.port();
    let server = tokio::spawn(serve_once(listener));
    let gw = format!(
        "printf 'GET /from-pod HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {} {port}",
        d.gateway
    );
    let r = exec(d, &client, &["sh", "-c", &gw], 15).await?;
    ensure!(
        r.exit_code == 0 && r.stdout.ends_with(b"\r\n\r\ngateway\n"),
        "pod to gateway: {r:?}"
    );
    let req = server.await??;
    ensure!(req.starts_with("GET /from-pod"), "gateway got {req:?}");
    // The pod's own interface carries its IP.
    let ping_gw = format!("ping -c1 -W2 {}", d.gateway);
    let r = exec(d, &client, &["sh", "-c", &ping_gw], 10).await?;
    ensure!(r.exit_code == 0, "{ping_gw}: {r:?}");
    let r = exec(d, &client, &["ip", "-4", "-o", "addr", "show"], 10).await?;
    ensure!(
        String::from_utf8_lossy(&r.stdout).contains(&format!("{ip_b}/24")),
        "ip addr: {r:?}"
    );
    Ok(())
}

async fn metrics(d: &Daemon) -> anyhow::Result<()> {
    // Traffic of earlier scenarios (or this one) is counted per method and code.
    let (id, _) = run_pod(d, "metrics").await?;
    let (code, body) = cubelet_e2e::http_get(d.metrics, "/metrics").await?;
    ensure!(code == 200, "/metrics answered {code}");
    for want in [
        "cubelet_cri_requests_total{",
        "method=\"RunPodSandbox\"",
        "cubelet_cri_request_duration_seconds",
        "cubelet_flow_duration_seconds",
        "cubelet_build_info",
    ] {
        ensure!(body.contains(want), "/metrics lacks {want}");
    }
    ensure!(
        !body.contains(&id),
        "/metrics names sandbox id {id} in a label"
    );
    Ok(())
}

async fn bad_config(d: &Daemon) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("never.sock");
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!("socket: {}\nno_such_key: 1\n", socket.display()),
    )?;
    let out = tokio::process::Command::new(cubelet_e2e::cubelet_bin())
        .arg("--config")
        .arg(&config)
        .arg("--config-dir")
        .arg(dir.path().join("config.d"))
        .output()
        .await?;
    ensure!(
        out.status.code() == Some(2),
        "bad config: exit {:?}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        stderr.contains("no_such_key"),
        "error does not name the key: {stderr}"
    );
    ensure!(
        !socket.exists(),
        "bad config still bound {}",
        socket.display()
    );
    let _ = d;
    Ok(())
}

async fn concurrent_run(d: &Daemon) -> anyhow::Result<()> {
    // Two RunPodSandbox for one pod at once: one flow, one id, one netns.
    let cfg = d.pod_config("racer");
    let (a, b) = tokio::join!(d.run_pod(&cfg, ""), d.run_pod(&cfg, ""));
    let (a, b) = (a?, b?);
    ensure!(a == b, "concurrent RunPodSandbox gave {a} and {b}");
    let pods = d
        .runtime
        .clone()
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await?;
    ensure!(
        pods.into_inner().items.len() == 1,
        "more than one sandbox for one pod"
    );
    let pins = d.pod_netns_pins().await?.len();
    ensure!(pins == 1, "{pins} netns pins for one pod");
    Ok(())
}

async fn restart(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let (pod, cfg) = run_pod(d, "survivor").await?;
    let cid = d
        .start_in(
            &pod,
            &cfg,
            container_config("survivor", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let ip = pod_status(d, &pod).await?.network.context("network")?.ip;
    d.restart().await?;
    let s = pod_status(d, &pod)
        .await
        .context("PodSandboxStatus after restart")?;
    ensure!(
        s.state == PodSandboxState::SandboxReady as i32,
        "pod state after restart {}",
        s.state
    );
    ensure!(
        s.network.map(|n| n.ip) == Some(ip.clone()),
        "pod ip changed across restart (was {ip})"
    );
    let c = container_status(d, &cid)
        .await
        .context("ContainerStatus after restart")?;
    ensure!(
        c.state == ContainerState::ContainerRunning as i32,
        "container state after restart {}",
        c.state
    );
    let r = exec(d, &cid, &["echo", "still here"], 10).await?;
    ensure!(r.stdout == b"still here\n", "exec after restart: {r:?}");
    // A new pod gets a different address than the surviving one.
    let (other, _) = run_pod(d, "after-restart").await?;
    let ip2 = pod_status(d, &other).await?.network.context("network")?.ip;
    ensure!(ip2 != ip, "new pod reuses the surviving pod's address {ip}");
    Ok(())
}
