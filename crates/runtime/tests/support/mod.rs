//! Shared set-up for the tests against a private containerd: a fresh
//! containerd namespace per test, a busybox rootfs imported as a committed
//! snapshot, a runtime with two runc handlers, and a teardown that removes
//! everything and asserts the namespace is empty.

#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::namespaces_client::NamespacesClient;
use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, ListSnapshotsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{DeleteNamespaceRequest, ListContainersRequest};
use cubelet_runtime::container::{ContainerRuntime, ContainerState, HandlerConfig, RuntimeConfig};
use cubelet_runtime::spec::ContainerSpec;
use cubelet_runtime::types::{ImageConfig, ImageInfo};
use cubelet_runtime::Containerd;
use futures::StreamExt;

pub const SNAPSHOTTER: &str = "overlayfs";

pub struct TestEnv {
    pub client: Containerd,
    pub ns: String,
    pub tmp: tempfile::TempDir,
    pub runtime: Arc<ContainerRuntime>,
    pub image: ImageInfo,
    pub cgroup_parent: String,
    pub root_a: PathBuf,
    pub root_b: PathBuf,
}

pub fn socket() -> PathBuf {
    std::env::var_os("CUBELET_TEST_CONTAINERD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/cubelet-test/containerd/containerd.sock"))
}

fn rand_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{:x}{:x}", std::process::id(), nanos)
}

/// Connects to the private containerd, or prints why the test is skipped.
pub async fn setup(test: &str) -> Option<TestEnv> {
    let sock = socket();
    if !sock.exists() {
        eprintln!(
            "SKIP {test}: no containerd socket at {} (set CUBELET_TEST_CONTAINERD or run hack/containerd.sh start)",
            sock.display()
        );
        return None;
    }
    let suffix = rand_suffix();
    let ns = format!("cubelet-test-{suffix}");
    let client = Containerd::connect(&sock, &ns).await.unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root_a = tmp.path().join("runc-a");
    let root_b = tmp.path().join("runc-b");
    let mut config = RuntimeConfig::new(tmp.path().join("state"));
    config.handlers = BTreeMap::from([
        (
            "runc".to_owned(),
            HandlerConfig {
                root: Some(root_a.clone()),
                ..Default::default()
            },
        ),
        (
            "runc-b".to_owned(),
            HandlerConfig {
                root: Some(root_b.clone()),
                binary: Some("/usr/sbin/runc".into()),
                ..Default::default()
            },
        ),
    ]);
    let runtime = Arc::new(ContainerRuntime::new(client.clone(), config));
    let image = import_busybox(&client, &ns).await;
    Some(TestEnv {
        client,
        cgroup_parent: format!("/cubelet-test-{suffix}"),
        ns,
        tmp,
        runtime,
        image,
        root_a,
        root_b,
    })
}

fn busybox_key(ns: &str) -> String {
    format!("{ns}-busybox")
}

/// Imports a rootfs with Debian's static busybox as a committed snapshot.
async fn import_busybox(client: &Containerd, ns: &str) -> ImageInfo {
    let active = format!("{ns}-busybox-active");
    let mounts = client
        .snapshots()
        .prepare(client.request(PrepareSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: active.clone(),
            parent: String::new(),
            labels: gc_root(),
        }))
        .await
        .unwrap()
        .into_inner()
        .mounts;
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    let m = &mounts[0];
    assert_eq!(m.r#type, "bind", "{m:?}");
    fill_rootfs(Path::new(&m.source));
    client
        .snapshots()
        .commit(client.request(CommitSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            name: busybox_key(ns),
            key: active,
            labels: gc_root(),
        }))
        .await
        .unwrap();
    ImageInfo {
        id: "sha256:test".into(),
        repo_tags: vec!["cubelet-test/busybox:test".into()],
        chain_id: busybox_key(ns),
        config: std::sync::Arc::new(ImageConfig {
            env: vec!["PATH=/bin".into(), "FROM_IMAGE=1".into()],
            cmd: vec!["sh".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Keeps containerd's GC off the test image snapshots (removed in teardown).
fn gc_root() -> HashMap<String, String> {
    HashMap::from([(
        "containerd.io/gc.root".to_owned(),
        "cubelet-test".to_owned(),
    )])
}

fn fill_rootfs(root: &Path) {
    for d in ["bin", "etc", "proc", "sys", "dev", "tmp", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let list = std::process::Command::new("/bin/busybox")
        .arg("--list")
        .output()
        .unwrap();
    for applet in String::from_utf8(list.stdout).unwrap().lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\ntester:x:1234:1234:t:/tmp:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(
        root.join("etc/group"),
        "root:x:0:\ntester:x:1234:\nextra:x:2000:tester\n",
    )
    .unwrap();
    std::fs::write(root.join("pause"), "#!/bin/sh\nexec sleep 999999999\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("pause"), std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl TestEnv {
    /// A spec running `sh -c script` in the busybox rootfs.
    pub fn sh(&self, name: &str, script: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.into(),
            image_ref: "cubelet-test/busybox:test".into(),
            image: self.image.clone(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            cgroup_parent: Some(self.cgroup_parent.clone()),
            ..Default::default()
        }
    }

    pub fn id(&self, name: &str) -> String {
        format!("{}-{name}", self.ns)
    }

    /// Polls status until the container has exited.
    pub async fn wait_exited(&self, id: &str) -> cubelet_runtime::container::ContainerStatus {
        for _ in 0..600 {
            let s = self.runtime.status(id).await.unwrap();
            if s.state == ContainerState::Exited {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("container {id} did not exit");
    }

    /// Polls a file until it contains `needle`.
    pub async fn wait_for_text(&self, path: &Path, needle: &str) -> String {
        for _ in 0..600 {
            let t = std::fs::read_to_string(path).unwrap_or_default();
            if t.contains(needle) {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} never contained {needle:?}", path.display());
    }

    /// Removes every container of the namespace, the busybox snapshot and the
    /// namespace; asserts nothing was left behind.
    pub async fn teardown(self) {
        let containers = self
            .client
            .containers()
            .list(
                self.client
                    .request(ListContainersRequest { filters: vec![] }),
            )
            .await
            .unwrap()
            .into_inner()
            .containers;
        for c in &containers {
            self.runtime.remove(&c.id).await.unwrap();
        }
        self.client
            .snapshots()
            .remove(self.client.request(RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: busybox_key(&self.ns),
            }))
            .await
            .unwrap();
        let left = self
            .client
            .containers()
            .list(
                self.client
                    .request(ListContainersRequest { filters: vec![] }),
            )
            .await
            .unwrap()
            .into_inner()
            .containers;
        assert!(left.is_empty(), "containers left: {left:?}");
        let mut stream = self
            .client
            .snapshots()
            .list(self.client.request(ListSnapshotsRequest {
                snapshotter: SNAPSHOTTER.into(),
                filters: vec![],
            }))
            .await
            .unwrap()
            .into_inner();
        let mut snaps = Vec::new();
        while let Some(r) = stream.next().await {
            snaps.extend(r.unwrap().info.into_iter().map(|i| i.name));
        }
        assert!(snaps.is_empty(), "snapshots left: {snaps:?}");
        let channel = containerd_client::connect(socket()).await.unwrap();
        NamespacesClient::new(channel)
            .delete(DeleteNamespaceRequest {
                name: self.ns.clone(),
            })
            .await
            .unwrap();
        // runc removes each container's cgroup; the per-test parent is ours.
        let parent = self.cgroup_parent.trim_start_matches('/');
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in rd.flatten() {
                let p = h.path().join(parent);
                if p.exists() {
                    std::fs::remove_dir(&p)
                        .unwrap_or_else(|e| panic!("rmdir {}: {e}", p.display()));
                }
            }
        }
        let io = self.runtime.config().state_dir.join("io");
        let leftover: Vec<_> = std::fs::read_dir(&io)
            .map(|r| r.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(leftover.is_empty(), "fifo dirs left: {leftover:?}");
    }
}
