//! Containers, tasks, logs, exec, events, handlers and the sandbox provider
//! against a private containerd. Skipped (with a message) when its socket is
//! absent; see `support::socket`.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cubelet_engine::spec::{NamespaceMode, NamespaceOptions, NetworkStatus, SandboxProcess};
use cubelet_engine::{Flow, FlowContext, SandboxId, SandboxSpec, StepErrorKind};
use cubelet_runtime::container::ContainerRuntime;
use cubelet_runtime::container::ContainerState;
use cubelet_runtime::events::{ContainerEventKind, EventMonitor};
use cubelet_runtime::io::logs::parse_entry;
use cubelet_runtime::sandbox::podns::PodNamespaces;
use cubelet_runtime::sandbox::{PauseImage, PauseImageSource, SandboxMode, SandboxProvider};
use cubelet_runtime::spec::{
    ContainerNamespaces, HugepageLimit, PodNamespacePaths, Resources, UserRequest,
};
use cubelet_runtime::stats::cgroups::{CgroupSupport, ResourceKind};
use cubelet_runtime::types::ImageInfo;
use cubelet_runtime::RuntimeError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_exit_code_logs_and_events() {
    let Some(env) = support::setup("lifecycle_exit_code_logs_and_events").await else {
        return;
    };
    let id = env.id("exit3");
    let log = env.tmp.path().join("logs/exit3.log");
    let mut spec = env.sh(
        "exit3",
        "echo out; echo err >&2; echo \"$FROM_IMAGE $MINE\"; printf partial; exit 3",
    );
    spec.env = vec![("MINE".into(), "yes".into())];
    spec.log_path = Some(log.clone());
    let monitor = EventMonitor::spawn(env.client.clone(), 64);
    let mut events = monitor.subscribe();
    // Give the subscription a moment to be established before the exit.
    tokio::time::sleep(Duration::from_millis(300)).await;

    env.runtime.create(&id, &spec).await.unwrap();
    let created = env.runtime.status(&id).await.unwrap();
    assert_eq!(created.state, ContainerState::Created);
    assert!(created.started_at.is_none());
    // Same id again: AlreadyExists, and the first container is untouched.
    let again = env.runtime.create(&id, &spec).await.unwrap_err();
    assert_eq!(again.kind(), StepErrorKind::AlreadyExists, "{again}");

    let pid = env.runtime.start(&id).await.unwrap();
    assert!(pid > 0);
    let st = env.wait_exited(&id).await;
    assert_eq!(st.exit_code, Some(3));
    assert!(st.started_at.is_some() && st.finished_at.is_some());
    assert!(st.finished_at >= st.started_at);
    assert_eq!(st.runtime_handler, "runc");
    assert_eq!(st.log_path.as_deref(), Some(log.as_path()));

    let ev = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let ev = events.recv().await.unwrap();
            if ev.id == id {
                return ev;
            }
        }
    })
    .await
    .expect("exit event");
    assert!(
        matches!(ev.kind, ContainerEventKind::Exited { code: 3, .. }),
        "{ev:?}"
    );

    env.runtime.remove(&id).await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let mut entries: Vec<(String, bool, String)> = text
        .lines()
        .map(|l| {
            let (ts, stream, partial, msg) = parse_entry(l).unwrap();
            assert!(ts.ends_with('Z') && ts.contains('T'), "{l}");
            (stream.to_owned(), partial, msg.to_owned())
        })
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        vec![
            ("stderr".into(), false, "err".into()),
            ("stdout".into(), false, "1 yes".into()),
            ("stdout".into(), false, "out".into()),
            ("stdout".into(), true, "partial".into()),
        ]
    );
    // Removal is idempotent and the container is gone.
    env.runtime.remove(&id).await.unwrap();
    assert!(env.runtime.status(&id).await.unwrap_err().is_not_found());
    drop(monitor);
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_escalates_to_sigkill_and_is_idempotent() {
    let Some(env) = support::setup("stop_escalates_to_sigkill_and_is_idempotent").await else {
        return;
    };
    let log = env.tmp.path().join("stubborn.log");
    let id = env.id("stubborn");
    let mut spec = env.sh(
        "stubborn",
        "trap '' TERM; echo ready; while :; do sleep 1; done",
    );
    spec.log_path = Some(log.clone());
    env.runtime.create(&id, &spec).await.unwrap();
    // Stopping a created container (no task) is fine.
    env.runtime.stop(&id, Duration::from_secs(1)).await.unwrap();
    env.runtime.start(&id).await.unwrap();
    env.wait_for_text(&log, "ready").await;
    env.runtime.stop(&id, Duration::from_secs(1)).await.unwrap();
    let st = env.runtime.status(&id).await.unwrap();
    assert_eq!(st.state, ContainerState::Exited);
    assert_eq!(st.exit_code, Some(137), "killed by SIGKILL");
    env.runtime.stop(&id, Duration::from_secs(1)).await.unwrap();
    // The stop retired the task (deleted in the background; delete_task
    // waits for that): the exit is still reported, from the record.
    env.runtime.delete_task(&id).await.unwrap();
    let client = env.runtime.client();
    let task = client
        .tasks()
        .get(client.request(containerd_client::services::v1::GetRequest {
            container_id: id.clone(),
            exec_id: String::new(),
        }))
        .await;
    assert_eq!(task.unwrap_err().code(), tonic::Code::NotFound);
    let st = env.runtime.status(&id).await.unwrap();
    assert_eq!(st.state, ContainerState::Exited);
    assert_eq!(st.exit_code, Some(137));
    assert!(st.finished_at.is_some());

    // A process that honours TERM exits with its own code.
    let id2 = env.id("polite");
    let log2 = env.tmp.path().join("polite.log");
    let mut spec = env.sh(
        "polite",
        "trap 'exit 7' TERM; echo ready; while :; do sleep 1; done",
    );
    spec.log_path = Some(log2.clone());
    env.runtime.create(&id2, &spec).await.unwrap();
    env.runtime.start(&id2).await.unwrap();
    env.wait_for_text(&log2, "ready").await;
    env.runtime
        .stop(&id2, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(env.runtime.status(&id2).await.unwrap().exit_code, Some(7));
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sync_output_exit_code_timeout_and_user() {
    let Some(env) = support::setup("exec_sync_output_exit_code_timeout_and_user").await else {
        return;
    };
    let id = env.id("exec");
    let mut spec = env.sh("exec", "exec sleep 100000");
    spec.user = UserRequest::Name {
        name: "tester".into(),
        gid: None,
    };
    spec.supplemental_groups = vec![3000];
    env.runtime.create(&id, &spec).await.unwrap();
    env.runtime.start(&id).await.unwrap();

    let cmd = |s: &str| vec!["sh".to_string(), "-c".to_string(), s.to_string()];
    let out = env
        .runtime
        .exec_sync(
            &id,
            &cmd("echo hi; echo oops >&2; exit 5"),
            Some(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert_eq!(out.exit_code, 5);

    let ids = env
        .runtime
        .exec_sync(&id, &cmd("id -u; id -g; id -G"), None)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&ids.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "1234");
    assert_eq!(lines[1], "1234");
    let groups: Vec<&str> = lines[2].split_whitespace().collect();
    assert!(
        groups.contains(&"2000") && groups.contains(&"3000"),
        "{text}"
    );

    let err = env
        .runtime
        .exec_sync(&id, &cmd("sleep 60"), Some(Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert!(matches!(err, RuntimeError::Timeout { .. }), "{err}");
    assert_eq!(err.kind(), StepErrorKind::DeadlineExceeded);
    // The container is still usable after a timed-out exec.
    let ok = env
        .runtime
        .exec_sync(&id, &cmd("true"), None)
        .await
        .unwrap();
    assert_eq!(ok.exit_code, 0);

    // A background child keeps the output open past the exit: what the
    // command printed is still returned (it was lost before), after the
    // drain wait.
    let bg = env
        .runtime
        .exec_sync(&id, &cmd("sleep 30 & echo hi; echo oops >&2"), None)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&bg.stdout), "hi\n");
    assert_eq!(String::from_utf8_lossy(&bg.stderr), "oops\n");
    assert_eq!(bg.exit_code, 0);
    env.teardown().await;
}

/// The OCI spec containerd holds for container `id`.
async fn recorded_spec(
    env: &support::TestEnv,
    id: &str,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let c = env
        .client
        .containers()
        .get(
            env.client
                .request(containerd_client::services::v1::GetContainerRequest {
                    id: id.to_owned(),
                }),
        )
        .await?
        .into_inner()
        .container
        .ok_or("no container")?;
    let spec = c.spec.ok_or("no spec")?;
    Ok(serde_json::from_slice(&spec.value)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_score_adj_is_clamped_and_resources_update() {
    let Some(env) = support::setup("oom_score_adj_is_clamped_and_resources_update").await else {
        return;
    };
    let own: i32 = std::fs::read_to_string("/proc/self/oom_score_adj")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let low = env.id("low");
    let mut spec = env.sh("low", "exec sleep 100000");
    spec.resources = Resources {
        oom_score_adj: -900,
        memory_limit: 64 << 20,
        ..Default::default()
    };
    env.runtime.create(&low, &spec).await.unwrap();
    let pid = env.runtime.start(&low).await.unwrap();
    let got: i32 = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(got, own.max(-900), "clamped to the agent's own score");

    let high = env.id("high");
    let mut spec = env.sh("high", "exec sleep 100000");
    spec.resources.oom_score_adj = 500;
    env.runtime.create(&high, &spec).await.unwrap();
    let pid = env.runtime.start(&high).await.unwrap();
    let got: i32 = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(got, 500.max(own));

    // Memory limit from the spec, then updated on the running task.
    let limit_file = format!(
        "/sys/fs/cgroup/memory{}/{low}/memory.limit_in_bytes",
        env.cgroup_parent
    );
    assert_eq!(
        std::fs::read_to_string(&limit_file).unwrap().trim(),
        (64u64 << 20).to_string()
    );
    env.runtime
        .update_resources(
            &low,
            &Resources {
                memory_limit: 128 << 20,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(&limit_file).unwrap().trim(),
        (128u64 << 20).to_string()
    );
    // The new limit is recorded in the container's spec too.
    let spec = recorded_spec(&env, &low).await.unwrap();
    assert_eq!(
        spec["linux"]["resources"]["memory"]["limit"],
        serde_json::json!(128u64 << 20)
    );
    assert!(spec["linux"]["resources"]["devices"]
        .as_array()
        .is_some_and(|d| !d.is_empty()));
    // An update of one field (kubelet's CPU manager sends only the cpuset)
    // keeps the other limits in the record.
    env.runtime
        .update_resources(
            &low,
            &Resources {
                cpuset_cpus: "0".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let spec = recorded_spec(&env, &low).await.unwrap();
    let r = &spec["linux"]["resources"];
    assert_eq!(r["memory"]["limit"], serde_json::json!(128u64 << 20), "{r}");
    assert_eq!(r["cpu"]["cpus"], "0", "{r}");
    assert!(r["devices"].as_array().is_some_and(|d| !d.is_empty()));
    env.teardown().await;
}

/// What kubelet sends for every container on this node: a zero hugepage
/// limit per page size in `/sys/kernel/mm/hugepages` and a swap limit equal
/// to the memory limit. The container starts, with each limit the node can
/// enforce in its cgroup; a non-zero hugepage limit where the node has no
/// hugetlb controller is refused (naming the field) when the node is strict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelets_resources_start_whatever_the_node_can_enforce() {
    let Some(env) = support::setup("kubelets_resources_start_whatever_the_node_can_enforce").await
    else {
        return;
    };
    let sizes: Vec<HugepageLimit> = std::fs::read_dir("/sys/kernel/mm/hugepages")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let kb: u64 = e
                        .file_name()
                        .to_str()?
                        .strip_prefix("hugepages-")?
                        .strip_suffix("kB")?
                        .parse()
                        .ok()?;
                    let page_size = if kb >= 1 << 20 {
                        format!("{}GB", kb >> 20)
                    } else {
                        format!("{}MB", kb >> 10)
                    };
                    Some(HugepageLimit {
                        page_size,
                        limit: 0,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let id = env.id("kubelet");
    let mut spec = env.sh("kubelet", "exec sleep 100000");
    spec.resources = Resources {
        cpu_shares: 51,
        cpu_quota: 20_000,
        cpu_period: 100_000,
        memory_limit: 64 << 20,
        memory_swap_limit: 64 << 20,
        hugepages: sizes.clone(),
        ..Default::default()
    };
    env.runtime.create(&id, &spec).await.unwrap();
    env.runtime.start(&id).await.unwrap();
    assert_eq!(
        env.runtime.status(&id).await.unwrap().state,
        ContainerState::Running
    );
    let support = env.runtime.cgroups().report();
    if Path::new("/sys/fs/cgroup/memory").is_dir() {
        let dir = format!("/sys/fs/cgroup/memory{}/{id}", env.cgroup_parent);
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).unwrap();
        assert_eq!(
            read("memory.limit_in_bytes").trim(),
            (64u64 << 20).to_string()
        );
        if support.swap {
            assert_eq!(
                read("memory.memsw.limit_in_bytes").trim(),
                (64u64 << 20).to_string()
            );
        }
    }
    if !sizes.is_empty() && !env.runtime.cgroups().has("hugetlb") {
        assert!(
            support.dropped.contains(&ResourceKind::Hugetlb),
            "{support:?}"
        );
        // The same limits, one of them non-zero, on a strict node.
        let strict = CgroupSupport::new(
            support.version,
            support.controllers.iter().cloned().collect(),
            support.swap,
            support.hugepage_sizes.iter().cloned().collect(),
            false,
        );
        let runtime = ContainerRuntime::with_cgroups(
            env.client.clone(),
            env.runtime.config().clone(),
            Arc::new(strict),
        );
        let refused = env.id("refused");
        let mut spec = env.sh("refused", "exec sleep 100000");
        spec.resources.hugepages = sizes;
        spec.resources.hugepages[0].limit = 2 << 20;
        let err = runtime.create(&refused, &spec).await.unwrap_err();
        assert_eq!(err.kind(), StepErrorKind::FailedPrecondition, "{err}");
        assert!(
            err.to_string()
                .contains("linux.resources.hugepage_limits[0]"),
            "{err}"
        );
        // Refused before anything was made.
        assert!(env
            .runtime
            .status(&refused)
            .await
            .unwrap_err()
            .is_not_found());
    }
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_handlers_select_runc_roots_and_unknown_is_rejected() {
    let Some(env) =
        support::setup("runtime_handlers_select_runc_roots_and_unknown_is_rejected").await
    else {
        return;
    };
    let a = env.id("a");
    let b = env.id("b");
    let spec_a = env.sh("a", "exec sleep 100000");
    let mut spec_b = env.sh("b", "exec sleep 100000");
    spec_b.runtime_handler = "runc-b".into();
    env.runtime.create(&a, &spec_a).await.unwrap();
    env.runtime.create(&b, &spec_b).await.unwrap();
    env.runtime.start(&a).await.unwrap();
    env.runtime.start(&b).await.unwrap();
    // runc keeps its state under <root>/<containerd namespace>/<id>.
    assert!(env.root_a.join(&env.ns).join(&a).exists());
    assert!(!env.root_a.join(&env.ns).join(&b).exists());
    assert!(env.root_b.join(&env.ns).join(&b).exists());
    assert_eq!(
        env.runtime.status(&b).await.unwrap().runtime_handler,
        "runc-b"
    );

    let mut bad = env.sh("c", "true");
    bad.runtime_handler = "nope".into();
    let err = env.runtime.create(&env.id("c"), &bad).await.unwrap_err();
    match &err {
        RuntimeError::InvalidArgument { field, .. } => assert_eq!(field, "runtime_handler"),
        other => panic!("unexpected {other}"),
    }
    assert_eq!(err.kind(), StepErrorKind::InvalidArgument);
    env.runtime.remove(&a).await.unwrap();
    env.runtime.remove(&b).await.unwrap();
    assert!(!env.root_b.join(&env.ns).join(&b).exists());
    env.teardown().await;
}

#[derive(Debug)]
struct TestPause(ImageInfo);

#[async_trait::async_trait]
impl PauseImageSource for TestPause {
    fn reference(&self) -> String {
        "cubelet-test/busybox:test".into()
    }
    async fn pause_image(&self) -> Result<ImageInfo, RuntimeError> {
        Ok(self.0.clone())
    }
}

fn ns_ino(pid: &str, ns: &str) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/{ns}"))
        .expect("namespace file")
        .ino()
}

/// A network namespace for the test, pinned by `ip netns`; removed on drop.
struct TestNetns(String);

impl TestNetns {
    fn new(name: String) -> Self {
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip");
        assert!(ok.success());
        Self(name)
    }
    fn path(&self) -> std::path::PathBuf {
        format!("/run/netns/{}", self.0).into()
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_provider_create_destroy_cleanup() {
    let Some(env) = support::setup("sandbox_provider_create_destroy_cleanup").await else {
        return;
    };
    let provider =
        SandboxProvider::new(env.runtime.clone(), Arc::new(TestPause(env.image.clone())));
    let netns = TestNetns::new(env.ns.clone());

    // Pod namespaces: own IPC/UTS/PID, the pinned netns.
    let sid = SandboxId::parse(&env.id("pod")).unwrap();
    let spec = SandboxSpec {
        name: "web".into(),
        namespace: "default".into(),
        uid: "u1".into(),
        hostname: "web-host".into(),
        cgroup_parent: Some(env.cgroup_parent.clone()),
        ..Default::default()
    };
    let ctx = FlowContext::new(sid.clone(), Arc::new(spec));
    ctx.publish(NetworkStatus {
        netns_path: Some(netns.path()),
        ..Default::default()
    });
    provider.create(&ctx).await.unwrap();
    let proc_ = ctx.get::<SandboxProcess>().unwrap();
    assert_eq!(proc_.runtime_handler, "runc");
    let pid = proc_.pid.expect("an infra process").to_string();
    assert_eq!(
        ns_ino(&pid, "net"),
        std::fs::metadata(netns.path()).unwrap().ino()
    );
    for ns in ["ipc", "uts", "pid", "mnt"] {
        assert_ne!(
            ns_ino(&pid, ns),
            ns_ino("self", ns),
            "{ns} must be the pod's own"
        );
    }
    let out = env
        .runtime
        .exec_sync(sid.as_str(), &["hostname".to_string()], None)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "web-host");

    provider.destroy(&ctx).await.unwrap();
    assert!(env
        .runtime
        .status(sid.as_str())
        .await
        .unwrap_err()
        .is_not_found());
    provider.destroy(&ctx).await.unwrap();
    provider.cleanup(&ctx).await.unwrap();
    provider.cleanup(&ctx).await.unwrap();

    // Host network (and node IPC/PID): the pause process shares the node's.
    let hid = SandboxId::parse(&env.id("hostpod")).unwrap();
    let spec = SandboxSpec {
        name: "hostnet".into(),
        namespaces: NamespaceOptions {
            network: NamespaceMode::Node,
            pid: NamespaceMode::Pod,
            ipc: NamespaceMode::Node,
            target_id: None,
            userns: None,
        },
        cgroup_parent: Some(env.cgroup_parent.clone()),
        ..Default::default()
    };
    let ctx = FlowContext::new(hid.clone(), Arc::new(spec));
    provider.create(&ctx).await.unwrap();
    let pid = ctx
        .get::<SandboxProcess>()
        .unwrap()
        .pid
        .unwrap()
        .to_string();
    for ns in ["net", "uts", "ipc"] {
        assert_eq!(
            ns_ino(&pid, ns),
            ns_ino("self", ns),
            "{ns} must be the node's"
        );
    }
    assert_ne!(ns_ino(&pid, "pid"), ns_ino("self", "pid"));
    // Cleanup without destroy first also tears everything down.
    provider.cleanup(&ctx).await.unwrap();
    assert!(env
        .runtime
        .status(hid.as_str())
        .await
        .unwrap_err()
        .is_not_found());

    // Unknown handler fails before anything is made.
    let bad = FlowContext::new(
        SandboxId::parse(&env.id("bad")).unwrap(),
        Arc::new(SandboxSpec {
            runtime_handler: "nope".into(),
            ..Default::default()
        }),
    );
    let err = provider.create(&bad).await.unwrap_err();
    assert_eq!(err.kind(), StepErrorKind::InvalidArgument);
    drop(netns);
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_without_infra_pins_what_its_containers_share() {
    let test = "a_sandbox_without_infra_pins_what_its_containers_share";
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP {test}: needs root to pin namespaces");
        return;
    }
    let Some(env) = support::setup(test).await else {
        return;
    };
    let pins = PodNamespaces::new(env.tmp.path().join("podns"));
    let provider =
        SandboxProvider::new(env.runtime.clone(), Arc::new(TestPause(env.image.clone())))
            .with_pinned_namespaces(pins.clone(), SandboxMode::Auto);
    provider.init().await.unwrap();
    let netns = TestNetns::new(format!("{}-x", env.ns));
    let sid = SandboxId::parse(&env.id("pinned")).unwrap();
    let spec = SandboxSpec {
        name: "pinned".into(),
        hostname: "pinned-host".into(),
        namespaces: NamespaceOptions {
            pid: NamespaceMode::Container,
            ..Default::default()
        },
        cgroup_parent: Some(env.cgroup_parent.clone()),
        ..Default::default()
    };
    let ctx = FlowContext::new(sid.clone(), Arc::new(spec.clone()));
    ctx.publish(NetworkStatus {
        netns_path: Some(netns.path()),
        ..Default::default()
    });
    provider.create(&ctx).await.unwrap();
    let process = ctx.get::<SandboxProcess>().unwrap();
    assert_eq!(process.pid, None);
    assert_eq!(process.runtime_handler, "runc");
    assert_eq!(process.pins_dir, Some(pins.sandbox_dir(&sid)));
    assert!(cubelet_runtime::sandbox::podns::pins_alive(&process));
    assert!(
        env.runtime
            .status(sid.as_str())
            .await
            .unwrap_err()
            .is_not_found(),
        "no pause container"
    );

    // Two containers join the pins (and the netns pin): one IPC namespace
    // (a message queue one makes, the other sees), one hostname.
    let pod = PodNamespacePaths::of_sandbox(&process, Some(&netns.path()));
    let namespaces = ContainerNamespaces::for_pod_container(&spec.namespaces, &pod, None).unwrap();
    let mut a = env.sh(
        "a",
        "touch /dev/mqueue/cubelet-q && readlink /proc/self/ns/ipc > /tmp/ipc && exec sleep 100000",
    );
    a.namespaces = namespaces.clone();
    a.hostname = "pinned-host".into();
    let mut b = env.sh("b", "exec sleep 100000");
    b.namespaces = namespaces;
    b.hostname = "pinned-host".into();
    let (ida, idb) = (env.id("a"), env.id("b"));
    for (id, c) in [(&ida, &a), (&idb, &b)] {
        env.runtime.create(id, c).await.unwrap();
        env.runtime.start(id).await.unwrap();
    }
    let exec = |id: String, cmd: &'static str| {
        let rt = env.runtime.clone();
        async move {
            let out = rt
                .exec_sync(&id, &["sh".into(), "-c".into(), cmd.into()], None)
                .await
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        }
    };
    let mut queue = String::new();
    for _ in 0..50 {
        queue = exec(idb.clone(), "ls /dev/mqueue").await;
        if !queue.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(queue, "cubelet-q");
    let ipc_b = exec(idb.clone(), "readlink /proc/self/ns/ipc").await;
    assert_eq!(exec(ida.clone(), "cat /tmp/ipc").await, ipc_b);
    let pin_ino = std::fs::metadata(process.ipc_path.as_ref().unwrap())
        .unwrap()
        .ino();
    assert_eq!(ipc_b, format!("ipc:[{pin_ino}]"));
    for id in [&ida, &idb] {
        assert_eq!(exec(id.clone(), "hostname").await, "pinned-host");
    }
    let (pa, pb) = (
        exec(ida.clone(), "readlink /proc/self/ns/pid").await,
        exec(idb.clone(), "readlink /proc/self/ns/pid").await,
    );
    assert_ne!(pa, pb, "a PID namespace each");
    for id in [&ida, &idb] {
        env.runtime.remove(id).await.unwrap();
    }

    // Teardown unpins and never asks containerd; twice is fine.
    provider.destroy(&ctx).await.unwrap();
    assert!(!pins.sandbox_dir(&sid).exists());
    assert!(!cubelet_runtime::sandbox::podns::pins_alive(&process));
    provider.destroy(&ctx).await.unwrap();
    provider.cleanup(&ctx).await.unwrap();

    // A pod sharing one PID namespace still gets a pause container, and
    // pause mode gives every pod one.
    let shared = SandboxId::parse(&env.id("shared")).unwrap();
    let ctx = FlowContext::new(
        shared.clone(),
        Arc::new(SandboxSpec {
            namespaces: NamespaceOptions::default(),
            ..spec.clone()
        }),
    );
    provider.create(&ctx).await.unwrap();
    assert!(ctx.get::<SandboxProcess>().unwrap().pid.is_some());
    assert!(!pins.sandbox_dir(&shared).exists());
    provider.cleanup(&ctx).await.unwrap();
    let pause = SandboxProvider::new(env.runtime.clone(), Arc::new(TestPause(env.image.clone())))
        .with_pinned_namespaces(pins.clone(), SandboxMode::Pause);
    let always = SandboxId::parse(&env.id("always")).unwrap();
    let ctx = FlowContext::new(always.clone(), Arc::new(spec.clone()));
    pause.create(&ctx).await.unwrap();
    assert!(ctx.get::<SandboxProcess>().unwrap().pid.is_some());
    pause.cleanup(&ctx).await.unwrap();
    assert!(env
        .runtime
        .status(always.as_str())
        .await
        .unwrap_err()
        .is_not_found());
    let _ = nix::mount::umount2(pins.dir(), nix::mount::MntFlags::MNT_DETACH);
    drop(netns);
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reattach_resumes_logging_after_restart() {
    let Some(env) = support::setup("reattach_resumes_logging_after_restart").await else {
        return;
    };
    let id = env.id("long");
    let log = env.tmp.path().join("long.log");
    let mut spec = env.sh(
        "long",
        "echo first; while [ ! -e /tmp/go ]; do sleep 1; done; echo second; exec sleep 100000",
    );
    spec.log_path = Some(log.clone());
    env.runtime.create(&id, &spec).await.unwrap();
    env.runtime.start(&id).await.unwrap();
    env.wait_for_text(&log, "first").await;

    // A second runtime over the same state dir stands in for the restarted agent.
    let restarted = cubelet_runtime::container::ContainerRuntime::new(
        env.client.clone(),
        env.runtime.config().clone(),
    );
    // The old agent's copiers are gone with it.
    env.runtime.detach(&id).await;
    restarted.reattach(&id).await.unwrap();
    env.runtime
        .exec_sync(&id, &["touch".into(), "/tmp/go".into()], None)
        .await
        .unwrap();
    env.wait_for_text(&log, "second").await;
    restarted.remove(&id).await.unwrap();
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_with_the_builtin_pause_image() {
    let test = "sandbox_with_the_builtin_pause_image";
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/cubelet-pause");
    let bin = std::env::var_os("PAUSE_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or(bin);
    if !bin.exists() {
        eprintln!(
            "SKIP {test}: no cubelet-pause binary at {} (hack/build-pause.sh)",
            bin.display()
        );
        return;
    }
    let Some(env) = support::setup(test).await else {
        return;
    };
    let images = cubelet_runtime::image::ImageService::new(
        env.client.clone(),
        "/nonexistent/cubelet-test-certs.d",
    );
    let pause = Arc::new(PauseImage::builtin(images.clone(), &bin));
    let provider = SandboxProvider::new(env.runtime.clone(), pause);
    let sid = SandboxId::parse(&env.id("real")).unwrap();
    let spec = SandboxSpec {
        name: "real".into(),
        cgroup_parent: Some(env.cgroup_parent.clone()),
        ..Default::default()
    };
    let ctx = FlowContext::new(sid.clone(), Arc::new(spec));
    provider.create(&ctx).await.unwrap();
    let pid = ctx.get::<SandboxProcess>().unwrap().pid.unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        cmdline.starts_with(b"/pause"),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    assert_eq!(
        env.runtime.status(sid.as_str()).await.unwrap().state,
        ContainerState::Running
    );
    provider.cleanup(&ctx).await.unwrap();
    assert!(env
        .runtime
        .status(sid.as_str())
        .await
        .unwrap_err()
        .is_not_found());
    images
        .remove(&cubelet_runtime::sandbox::pause::pause_image_ref())
        .await
        .unwrap();
    env.teardown().await;
}

/// Creates share one lease for their new snapshots (no lease calls of
/// their own), and a lease lost under the runtime is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_share_one_snapshot_lease() {
    let Some(env) = support::setup("creates_share_one_snapshot_lease").await else {
        return;
    };
    let leases = || async {
        let list = env
            .client
            .leases()
            .list(
                env.client
                    .request(containerd_client::services::v1::ListRequest { filters: vec![] }),
            )
            .await
            .unwrap()
            .into_inner()
            .leases;
        list.into_iter().map(|l| l.id).collect::<Vec<_>>()
    };
    let ids: Vec<_> = (0..3).map(|n| env.id(&format!("lease{n}"))).collect();
    for (n, id) in ids.iter().enumerate() {
        let spec = env.sh(&format!("lease{n}"), "true");
        env.runtime.create(id, &spec).await.unwrap();
    }
    let shared = leases().await;
    assert_eq!(shared.len(), 1, "{shared:?}");
    env.client
        .leases()
        .delete(
            env.client
                .request(containerd_client::services::v1::DeleteRequest {
                    id: shared[0].clone(),
                    sync: true,
                }),
        )
        .await
        .unwrap();
    let late = env.id("lease-late");
    env.runtime
        .create(&late, &env.sh("lease-late", "true"))
        .await
        .unwrap();
    let renewed = leases().await;
    assert_eq!(renewed.len(), 1, "{renewed:?}");
    assert_ne!(renewed, shared);
    for id in ids.iter().chain([&late]) {
        env.runtime.remove(id).await.unwrap();
    }
    env.teardown().await;
}
