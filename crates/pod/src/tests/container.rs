//! Container rules: create, start, stop, remove, status, exec, updates,
//! and the runtime's events.

use std::time::{Duration, SystemTime};

use cubelet_engine::fake::Behavior;
use cubelet_engine::spec::NamespaceMode;
use cubelet_engine::FlowKind;
use cubelet_runtime::container::{ContainerState as RtState, ExecOutput};
use cubelet_runtime::events::{ContainerEvent, ContainerEventKind};
use cubelet_runtime::spec::{NamespaceJoin, Resources};
use cubelet_runtime::RuntimeError;
use cubelet_store::{ContainerState, SandboxState};

use super::harness::{busybox, drain, request, until, within, Rig};
use crate::{PodError, PodEventKind};

fn failed(message: &'static str) -> impl Fn(&str) -> RuntimeError + Send + Sync {
    move |_| RuntimeError::FailedPrecondition(message.to_owned())
}

#[tokio::test]
async fn create_records_the_container_and_completes_it_from_the_pod() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Created);
    assert_eq!(rec.sandbox_id, sb);
    assert_eq!(rec.image_ref, "sha256:1111");
    let spec = r.runtime.container(&id).unwrap().spec;
    assert_eq!(spec.name, "app");
    assert_eq!(spec.hostname, "web");
    assert_eq!(spec.runtime_handler, "runc");
    assert_eq!(spec.cgroup_parent.as_deref(), Some("/kubepods/pod-test"));
    assert_eq!(spec.sysctls.len(), 1);
    assert_eq!(
        spec.log_path.as_deref(),
        Some(std::path::Path::new("/var/log/pods/test_web/app/0.log"))
    );
    // The fake sandbox step's infra process is pid 1.
    assert_eq!(
        spec.namespaces.network,
        NamespaceJoin::Path("/proc/1/ns/net".into())
    );
    assert_eq!(
        spec.namespaces.pid,
        NamespaceJoin::Path("/proc/1/ns/pid".into())
    );
}

#[tokio::test]
async fn create_in_an_unknown_pod_is_not_found() {
    let r = Rig::new();
    let err = r
        .pods
        .create_container(&"a".repeat(64), request("app"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PodError::NotFound {
                kind: "pod sandbox",
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn create_in_a_stopped_pod_is_failed_precondition() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.pods.stop_sandbox(sb.as_str()).await.unwrap();
    let err = r
        .pods
        .create_container(sb.as_str(), request("app"))
        .await
        .unwrap_err();
    match err {
        PodError::FailedPrecondition(m) => assert!(m.contains("not ready"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(r.runtime.container_ids().is_empty());
}

#[tokio::test]
async fn a_name_and_attempt_in_use_is_already_exists() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let first = r.created(&sb, "app").await;
    match r
        .pods
        .create_container(sb.as_str(), request("app"))
        .await
        .unwrap_err()
    {
        PodError::AlreadyExists { kind, name, by } => {
            assert_eq!((kind, name.as_str()), ("container", "app_0"));
            assert_eq!(by, first);
        }
        other => panic!("{other:?}"),
    }
    let mut next = request("app");
    next.attempt = 1;
    r.pods.create_container(sb.as_str(), next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_of_one_name_make_one_container() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.runtime.delay("create", Duration::from_millis(10));
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let pods = r.pods.clone();
            let sb = sb.clone();
            tokio::spawn(async move { pods.create_container(sb.as_str(), request("app")).await })
        })
        .collect();
    let mut ok = 0;
    for c in calls {
        match within("create", c).await.unwrap() {
            Ok(_) => ok += 1,
            Err(PodError::AlreadyExists { .. }) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(r.pods.containers_of(&sb).unwrap().len(), 1);
    assert_eq!(r.runtime.calls("create"), 1);
}

#[tokio::test]
async fn a_missing_image_is_not_found_and_records_nothing() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let mut req = request("app");
    req.image = "nginx".into();
    let err = r.pods.create_container(sb.as_str(), req).await.unwrap_err();
    assert!(
        matches!(err, PodError::NotFound { kind: "image", ref id } if id == "nginx"),
        "{err:?}"
    );
    assert!(r.pods.list_containers().unwrap().is_empty());
}

#[tokio::test]
async fn a_runtime_create_failure_drops_the_record() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.runtime.fail_next("create", failed("snapshot failed"));
    let err = r
        .pods
        .create_container(sb.as_str(), request("app"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("snapshot failed"));
    assert!(r.pods.list_containers().unwrap().is_empty());
    // The name is free again.
    r.created(&sb, "app").await;
}

#[tokio::test]
async fn a_log_path_without_a_log_directory_is_invalid() {
    let r = Rig::new();
    let mut spec = super::harness::spec("web");
    spec.log_directory = None;
    let sb = r.pods.run_sandbox(spec).await.unwrap();
    match r
        .pods
        .create_container(sb.as_str(), request("app"))
        .await
        .unwrap_err()
    {
        PodError::InvalidArgument { field, .. } => assert_eq!(field, "config.log_path"),
        other => panic!("{other:?}"),
    }
    let mut no_log = request("app");
    no_log.log_path = None;
    let id = r.pods.create_container(sb.as_str(), no_log).await.unwrap();
    assert!(r.container(&id).unwrap().log_path.is_none());
}

#[tokio::test]
async fn the_image_shown_is_what_the_user_wrote_else_a_tag_for_an_id() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let mut by_user = request("a");
    by_user.user_specified_image = "busybox:1.36".into();
    let a = r.pods.create_container(sb.as_str(), by_user).await.unwrap();
    assert_eq!(r.container(&a).unwrap().image, "busybox:1.36");
    let mut by_id = request("b");
    by_id.image = "sha256:1111".into();
    let b = r.pods.create_container(sb.as_str(), by_id).await.unwrap();
    assert_eq!(
        r.container(&b).unwrap().image,
        "127.0.0.1:5000/busybox:latest"
    );
    let c = r.created(&sb, "c").await;
    assert_eq!(r.container(&c).unwrap().image, "busybox");
    assert_eq!(
        r.container(&c).unwrap().config["image_repo_digest"],
        busybox().repo_digests[0]
    );
}

#[tokio::test]
async fn a_target_pid_namespace_joins_the_target_container() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let target = r.running(&sb, "main").await;
    let pid = r.container(&target).unwrap().pid.unwrap();
    let mut req = request("debug");
    req.pid = Some((NamespaceMode::Target, Some(target.clone())));
    let id = r.pods.create_container(sb.as_str(), req).await.unwrap();
    let spec = r.runtime.container(&id).unwrap().spec;
    assert_eq!(
        spec.namespaces.pid,
        NamespaceJoin::Path(format!("/proc/{pid}/ns/pid").into())
    );
    let mut own = request("own");
    own.pid = Some((NamespaceMode::Container, None));
    let id = r.pods.create_container(sb.as_str(), own).await.unwrap();
    assert_eq!(
        r.runtime.container(&id).unwrap().spec.namespaces.pid,
        NamespaceJoin::New
    );
}

#[tokio::test]
async fn containers_of_a_pod_without_infra_join_its_pins() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    let mut req = request("app");
    req.pid = Some((NamespaceMode::Container, None));
    let id = r.pods.create_container(sb.as_str(), req).await.unwrap();
    let ns = r.runtime.container(&id).unwrap().spec.namespaces;
    assert_eq!(ns.network, NamespaceJoin::Path("/netns/web".into()));
    assert_eq!(ns.ipc, NamespaceJoin::Path("/pins/web/ipc".into()));
    assert_eq!(ns.uts, NamespaceJoin::Path("/pins/web/uts".into()));
    assert_eq!(ns.pid, NamespaceJoin::New);
    // Without a request of its own the pod's choice (one per container) holds.
    let id = r.created(&sb, "plain").await;
    assert_eq!(
        r.runtime.container(&id).unwrap().spec.namespaces.pid,
        NamespaceJoin::New
    );
}

#[tokio::test]
async fn a_pod_pid_namespace_asked_of_a_pod_without_infra_is_refused() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    let mut req = request("app");
    req.pid = Some((NamespaceMode::Pod, None));
    let err = r.pods.create_container(sb.as_str(), req).await.unwrap_err();
    assert!(
        matches!(err, PodError::Runtime(RuntimeError::FailedPrecondition(_))),
        "{err:?}"
    );
    assert!(err.to_string().contains("PID namespace"), "{err}");
    assert_eq!(r.runtime.calls("create"), 0, "nothing was created");
    assert!(
        r.pods.containers_of(&sb).unwrap().is_empty(),
        "nothing recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_being_stopped_gains_no_container() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.fake("sandbox").set(
        FlowKind::Destroy,
        Behavior::Delay(Duration::from_millis(300)),
    );
    let pods = r.pods.clone();
    let id = sb.clone();
    let stop = tokio::spawn(async move { pods.stop_sandbox(id.as_str()).await });
    let sandbox = r.fake("sandbox");
    until("the sandbox step's destroy", || {
        sandbox.log().iter().any(|l| l == "destroy:sandbox:start")
    })
    .await;
    let err = r
        .pods
        .create_container(sb.as_str(), request("late"))
        .await
        .unwrap_err();
    assert!(matches!(err, PodError::FailedPrecondition(_)), "{err:?}");
    within("stop", stop).await.unwrap().unwrap();
    assert!(r.runtime.container_ids().is_empty());
}

#[tokio::test]
async fn start_runs_a_created_container() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods.start_container(&id).await.unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Running);
    assert!(rec.pid.is_some_and(|p| p > 1000));
    assert!(rec.started_at.is_some());
    assert_eq!(drain(&mut rx), [(id, PodEventKind::Started)]);
}

#[tokio::test]
async fn starting_twice_is_refused_and_the_container_keeps_running() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    match r.pods.start_container(&id).await.unwrap_err() {
        PodError::FailedPrecondition(m) => assert!(m.contains("not created"), "{m}"),
        other => panic!("{other:?}"),
    }
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Running);
    assert_eq!(rec.exit_code, None);
    assert_eq!(r.runtime.calls("start"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_starts_start_once_and_it_stays_running() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    // A slow start widens the window the old check-before-lock left open.
    r.runtime.delay("start", Duration::from_millis(20));
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let pods = r.pods.clone();
            let id = id.clone();
            tokio::spawn(async move { pods.start_container(&id).await })
        })
        .collect();
    let mut ok = 0;
    for c in calls {
        match within("start", c).await.unwrap() {
            Ok(()) => ok += 1,
            Err(PodError::FailedPrecondition(_)) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(r.runtime.calls("start"), 1, "one start reached the runtime");
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Running);
    assert_eq!(rec.reason, None);
    assert_eq!(rec.exit_code, None);
}

#[tokio::test]
async fn a_failed_start_is_recorded_as_start_error_128() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    r.runtime
        .fail_next("start", failed("exec: \"nope\": not found"));
    r.pods.start_container(&id).await.unwrap_err();
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert_eq!(rec.exit_code, Some(128));
    assert_eq!(rec.reason.as_deref(), Some("StartError"));
    assert!(rec.message.unwrap().contains("nope"));
    assert!(rec.finished_at.is_some());
}

#[tokio::test]
async fn starting_an_unknown_container_is_not_found() {
    let r = Rig::new();
    let err = r.pods.start_container(&"c".repeat(64)).await.unwrap_err();
    assert!(
        matches!(
            err,
            PodError::NotFound {
                kind: "container",
                ..
            }
        ),
        "{err:?}"
    );
    match r.pods.start_container("").await.unwrap_err() {
        PodError::InvalidArgument { field, .. } => assert_eq!(field, "container_id"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_that_overtakes_start_is_kept() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    let mut rx = r.pods.subscribe();
    // The process exits at once: containerd's exit event is applied while
    // StartContainer is still on its way back from the runtime.
    r.runtime.delay("start", Duration::from_millis(300));
    let pods = r.pods.clone();
    let starting = id.clone();
    let start = tokio::spawn(async move { pods.start_container(&starting).await });
    until("the runtime's start", || r.runtime.calls("start") == 1).await;
    r.pods.apply_event(&ContainerEvent {
        id: id.clone(),
        kind: ContainerEventKind::Exited {
            code: 3,
            at: None,
            exec_id: String::new(),
            pid: 7,
        },
    });
    within("start", start).await.unwrap().unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(
        rec.state,
        ContainerState::Exited,
        "the start does not undo the exit"
    );
    assert_eq!(rec.exit_code, Some(3));
    assert!(rec.pid.is_some() && rec.started_at.is_some());
    assert!(rec.started_at <= rec.finished_at);
    assert_eq!(
        drain(&mut rx),
        [
            (id.clone(), PodEventKind::Started),
            (id, PodEventKind::Stopped)
        ]
    );
}

#[tokio::test]
async fn stop_records_the_exit() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods
        .stop_container(&id, Duration::from_secs(1))
        .await
        .unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert_eq!(rec.exit_code, Some(137));
    assert!(rec.finished_at.is_some());
    assert_eq!(drain(&mut rx), [(id, PodEventKind::Stopped)]);
    // It answers once the runtime let go of the exited task.
    assert_eq!(r.runtime.calls("settle"), 1);
    // The exit came with the stop: no status call to learn it.
    assert_eq!(r.runtime.calls("status"), 0);
}

/// A running container that ignores its stop signal, with a stop of a
/// 500 s grace period in flight on it (the runtime is already waiting).
async fn stopping_for_500_s() -> (Rig, String, tokio::task::JoinHandle<crate::PodResult<()>>) {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.ignore_stop_signal(&id);
    let long = tokio::spawn({
        let pods = r.pods.clone();
        let id = id.clone();
        async move { pods.stop_container(&id, Duration::from_secs(500)).await }
    });
    while r.runtime.calls("stop") == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (r, id, long)
}

/// Kubelet stops with a long grace period, then with a short one (or
/// removes): the later stop kills at its own deadline instead of waiting
/// behind the first under the container's lock, and both answer.
#[tokio::test]
async fn a_shorter_stop_overtakes_a_longer_one_in_flight() {
    let (r, id, long) = stopping_for_500_s().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!long.is_finished());
    // A bound that only catches a hang: the short stop must not wait 500 s.
    tokio::time::timeout(
        Duration::from_secs(30),
        r.pods.stop_container(&id, Duration::from_millis(200)),
    )
    .await
    .expect("the short stop waited behind the long one")
    .unwrap();
    tokio::time::timeout(Duration::from_secs(30), long)
        .await
        .expect("the long stop did not end with the kill")
        .unwrap()
        .unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert_eq!(rec.exit_code, Some(137));
}

/// A removal forces a container down at once, also while a graceful stop
/// of it is in flight.
#[tokio::test]
async fn a_removal_kills_a_container_a_long_stop_is_waiting_on() {
    let (r, id, long) = stopping_for_500_s().await;
    tokio::time::timeout(Duration::from_secs(30), r.pods.remove_container(&id))
        .await
        .expect("the removal waited behind the long stop")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), long)
        .await
        .expect("the long stop did not end with the kill")
        .unwrap()
        .unwrap();
    assert!(r.container(&id).is_none());
    r.pods.drain_removals().await;
    assert!(r.runtime.container(&id).is_none());
}

#[tokio::test]
async fn stopping_a_stopped_created_or_unknown_container_is_ok() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    assert_eq!(
        r.runtime.calls("stop"),
        1,
        "only a running container is signalled"
    );
    let created = r.created(&sb, "idle").await;
    r.pods
        .stop_container(&created, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        r.container(&created).unwrap().state,
        ContainerState::Created
    );
    r.pods
        .stop_container(&"d".repeat(64), Duration::ZERO)
        .await
        .unwrap();
}

#[tokio::test]
async fn stop_of_a_task_the_runtime_lost_records_an_exit() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.forget(&id);
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert!(rec.finished_at.is_some());
}

#[tokio::test]
async fn a_stop_the_runtime_refuses_is_returned_and_nothing_changes() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.fail_next("stop", failed("kill refused"));
    let err = r
        .pods
        .stop_container(&id, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("kill refused"));
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Running);
}

#[tokio::test]
async fn remove_forces_a_running_container_down_and_forgets_it() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods.remove_container(&id).await.unwrap();
    assert!(r.container(&id).is_none());
    r.pods.drain_removals().await;
    assert!(r.runtime.container(&id).is_none());
    assert_eq!(r.runtime.calls("stop"), 1);
    assert_eq!(drain(&mut rx), [(id, PodEventKind::Deleted)]);
}

#[tokio::test]
async fn remove_answers_before_the_runtime_is_done_and_the_pod_waits_for_it() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    r.runtime.delay("remove", Duration::from_millis(300));
    r.pods.remove_container(&id).await.unwrap();
    // Forgotten at once; the runtime's part is still under way, and the
    // GC's containerd collector is told so.
    assert!(r.container(&id).is_none());
    assert!(r.runtime.container(&id).is_some());
    assert!(r.pods.removing().contains(&id));
    r.pods.remove_sandbox(sb.as_str()).await.unwrap();
    assert!(r.runtime.container(&id).is_none());
    assert!(r.pods.removing().is_empty());
}

#[tokio::test]
async fn removing_twice_or_an_unknown_container_is_ok() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    r.pods.remove_container(&id).await.unwrap();
    r.pods.remove_container(&id).await.unwrap();
    r.pods.remove_container(&"b".repeat(64)).await.unwrap();
}

#[tokio::test]
async fn a_remove_the_runtime_refuses_leaves_its_objects_to_the_gc() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    r.runtime.fail_next("remove", failed("snapshot busy"));
    r.pods.remove_container(&id).await.unwrap();
    assert!(r.container(&id).is_none());
    r.pods.drain_removals().await;
    // Objects of no record and no removal under way: the GC's orphans.
    assert!(r.runtime.container(&id).is_some());
    assert!(r.pods.removing().is_empty());
}

#[tokio::test]
async fn a_pod_removal_the_runtime_refuses_keeps_the_container_record() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    r.runtime.fail_next("remove", failed("snapshot busy"));
    r.pods.remove_sandbox(sb.as_str()).await.unwrap_err();
    assert!(r.container(&id).is_some());
    r.pods.remove_sandbox(sb.as_str()).await.unwrap();
    assert!(r.container(&id).is_none());
    assert!(r.runtime.container(&id).is_none());
}

#[tokio::test]
async fn a_failed_stop_before_remove_does_not_stop_the_remove() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.fail_next("stop", failed("kill refused"));
    r.pods.remove_container(&id).await.unwrap();
    assert!(r.container(&id).is_none());
}

#[tokio::test]
async fn status_reads_an_exit_the_events_have_not_brought_yet() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let _ = r.runtime.exit(&id, 2); // the event is never applied
    let rec = r.pods.container_status(&id).await.unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert_eq!(rec.exit_code, Some(2));
}

#[tokio::test]
async fn status_of_an_unknown_container_is_not_found() {
    let r = Rig::new();
    let err = r.pods.container_status(&"9".repeat(64)).await.unwrap_err();
    assert!(matches!(
        err,
        PodError::NotFound {
            kind: "container",
            ..
        }
    ));
}

#[tokio::test]
async fn status_of_a_created_container_asks_the_runtime_nothing() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    let before = r.runtime.calls("status");
    assert_eq!(
        r.pods.container_status(&id).await.unwrap().state,
        ContainerState::Created
    );
    assert_eq!(r.runtime.calls("status"), before);
}

#[tokio::test]
async fn exec_sync_returns_the_output() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let out = r
        .pods
        .exec_sync(&id, &["echo".into(), "hi".into()], None)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"echo hi");
    assert_eq!(out.exit_code, 0);
}

#[tokio::test]
async fn exec_in_a_container_that_is_not_running_is_failed_precondition() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    let err = r
        .pods
        .exec_sync(&id, &["true".into()], None)
        .await
        .unwrap_err();
    assert!(matches!(err, PodError::FailedPrecondition(_)), "{err:?}");
    assert_eq!(r.runtime.calls("exec_sync"), 0);
}

#[tokio::test]
async fn a_command_that_cannot_start_exits_as_a_shell_would() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.set_exec(Err(
        "OCI runtime exec failed: exec: \"nope\": executable file not found in $PATH".into(),
    ));
    let out = r.pods.exec_sync(&id, &["nope".into()], None).await.unwrap();
    assert_eq!(out.exit_code, 127);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    r.runtime.set_exec(Err(
        "OCI runtime exec failed: exec: \"/etc\": permission denied".into(),
    ));
    assert_eq!(
        r.pods
            .exec_sync(&id, &["/etc".into()], None)
            .await
            .unwrap()
            .exit_code,
        126
    );
    r.runtime.set_exec(Ok(ExecOutput {
        stdout: Vec::new(),
        stderr: Vec::new(),
        exit_code: 4,
    }));
    assert_eq!(
        r.pods
            .exec_sync(&id, &["false".into()], None)
            .await
            .unwrap()
            .exit_code,
        4
    );
}

#[tokio::test]
async fn an_exec_past_its_timeout_is_deadline_exceeded() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let err = r
        .pods
        .exec_sync(
            &id,
            &["sleep".into(), "9".into()],
            Some(Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
    match err {
        PodError::DeadlineExceeded(m) => assert!(m.contains("timed out after 1s"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn other_exec_failures_are_errors() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.runtime.set_exec(Err("shim died".into()));
    assert!(matches!(
        r.pods.exec_sync(&id, &["true".into()], None).await,
        Err(PodError::Runtime(_))
    ));
}

#[tokio::test]
async fn an_update_reaches_the_runtime() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let res = Resources {
        cpu_shares: 512,
        ..Default::default()
    };
    r.pods.update_resources(&id, &res).await.unwrap();
    assert_eq!(r.runtime.container(&id).unwrap().resources, Some(res));
    let err = r
        .pods
        .update_resources(&"7".repeat(64), &Resources::default())
        .await
        .unwrap_err();
    assert!(matches!(err, PodError::NotFound { .. }));
}

#[tokio::test]
async fn only_a_running_container_reopens_its_log() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    assert!(matches!(
        r.pods.reopen_log(&id).await,
        Err(PodError::FailedPrecondition(_))
    ));
    r.pods.start_container(&id).await.unwrap();
    r.pods.reopen_log(&id).await.unwrap();
    assert_eq!(r.runtime.calls("reopen_log"), 1);
    assert_eq!(r.pods.running_container(&id).unwrap(), id);
}

fn exited(id: &str, code: u32, exec_id: &str) -> ContainerEvent {
    ContainerEvent {
        id: id.to_owned(),
        kind: ContainerEventKind::Exited {
            code,
            at: None,
            exec_id: exec_id.to_owned(),
            pid: 1,
        },
    }
}

#[tokio::test]
async fn an_exit_event_records_the_code_once() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods.apply_event(&exited(&id, 1, ""));
    r.pods.apply_event(&exited(&id, 1, ""));
    let rec = r.container(&id).unwrap();
    assert_eq!(
        (rec.state, rec.exit_code),
        (ContainerState::Exited, Some(1))
    );
    assert_eq!(
        drain(&mut rx),
        [(id, PodEventKind::Stopped)],
        "one event for two exits"
    );
}

#[tokio::test]
async fn an_exec_process_exit_changes_nothing() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.pods.apply_event(&exited(&id, 1, "exec-1"));
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Running);
}

#[tokio::test]
async fn an_oom_kill_is_the_reason() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.pods.apply_event(&ContainerEvent {
        id: id.clone(),
        kind: ContainerEventKind::Oom,
    });
    r.pods.apply_event(&exited(&id, 137, ""));
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.reason.as_deref(), Some("OOMKilled"));
    assert_eq!(rec.exit_code, Some(137));
}

#[tokio::test]
async fn a_sigkill_exit_the_memory_cgroup_counts_as_an_oom_kill_is_one_without_the_event() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    // Killed by the OOM killer; the shim's OOM event never came.
    let oom = r.running(&sb, "oom").await;
    r.runtime.set_oom_killed(&oom);
    r.pods.apply_event(&exited(&oom, 137, ""));
    assert_eq!(
        r.container(&oom).unwrap().reason.as_deref(),
        Some("OOMKilled")
    );
    // SIGKILLed by someone else: no reason of its own.
    let killed = r.running(&sb, "killed").await;
    r.pods.apply_event(&exited(&killed, 137, ""));
    assert_eq!(r.container(&killed).unwrap().reason, None);
    // An earlier OOM kill in a container that then exits by itself is not
    // why it exited.
    let later = r.running(&sb, "later").await;
    r.runtime.set_oom_killed(&later);
    r.pods.apply_event(&exited(&later, 1, ""));
    assert_eq!(r.container(&later).unwrap().reason, None);
}

#[tokio::test]
async fn the_infra_process_exiting_makes_the_pod_not_ready() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.pods.apply_event(&exited(sb.as_str(), 0, ""));
    assert_eq!(r.sandbox(&sb).unwrap().state, SandboxState::NotReady);
    // An exec in the infra container changes nothing.
    let other = r.ready_pod("other").await;
    r.pods.apply_event(&exited(other.as_str(), 0, "exec"));
    assert_eq!(r.sandbox(&other).unwrap().state, SandboxState::Ready);
}

#[tokio::test]
async fn events_for_unknown_ids_are_ignored() {
    let r = Rig::new();
    r.pods.apply_event(&exited(&"f".repeat(64), 0, ""));
    r.pods.apply_event(&exited("NOT A VALID ID", 0, ""));
    r.pods.apply_event(&ContainerEvent {
        id: "gone".into(),
        kind: ContainerEventKind::Oom,
    });
    assert!(r.pods.list_sandboxes().unwrap().is_empty());
}

#[tokio::test]
async fn the_runtime_state_of_a_fake_container_follows_the_calls() {
    // The fake must behave like containerd for the rules above to mean anything.
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "app").await;
    assert_eq!(r.runtime.container(&id).unwrap().state, RtState::Created);
    r.pods.start_container(&id).await.unwrap();
    assert_eq!(r.runtime.container(&id).unwrap().state, RtState::Running);
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    assert_eq!(r.runtime.container(&id).unwrap().state, RtState::Exited);
}

#[tokio::test]
async fn a_caller_check_reads_the_pod_under_its_lock_and_a_refusal_creates_nothing() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let saw = std::sync::Arc::clone(&seen);
    let err = r
        .pods
        .create_container_checked(sb.as_str(), request("app"), move |pod| {
            *saw.lock().unwrap() = Some(pod.id.clone());
            Err(PodError::invalid("config.linux", "refused by the caller"))
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("refused by the caller"), "{err}");
    assert_eq!(seen.lock().unwrap().as_ref(), Some(&sb));
    assert_eq!(r.runtime.calls("create"), 0);
    assert!(r.pods.containers_of(&sb).unwrap().is_empty());
    // Accepted: created as by `create_container`.
    let id = r
        .pods
        .create_container_checked(sb.as_str(), request("app"), |_| Ok::<(), PodError>(()))
        .await
        .unwrap();
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Created);
}

#[tokio::test]
async fn a_pod_without_infra_gets_one_stats_anchor_once_a_container_runs() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    let id = r.created(&sb, "app").await;
    assert!(r.runtime.anchors().is_empty(), "nothing before a start");
    r.pods.start_container(&id).await.unwrap();
    until("the anchor", || !r.runtime.anchors().is_empty()).await;
    assert_eq!(r.runtime.anchors(), [sb.as_str().to_owned()]);
    // It goes into the pod's shim, grouped by the sandbox id as the pod's
    // containers are.
    assert_eq!(r.runtime.anchor_groups(), [Some(sb.as_str().to_owned())]);
    assert_eq!(
        r.runtime.container(&id).unwrap().spec.annotations
            [cubelet_runtime::sandbox::anchor::SHIM_GROUP_ANNOTATION],
        sb.as_str()
    );
    // A second container finds it running: still one.
    r.running(&sb, "sidecar").await;
    until("the second ensure", || {
        r.runtime.calls("ensure_stats_anchor") == 2
    })
    .await;
    assert_eq!(r.runtime.anchors().len(), 1);
    assert_eq!(r.runtime.anchor_counts(), (1, 0));
}

#[tokio::test]
async fn stats_anchors_wait_while_other_containers_are_starting() {
    let r = Rig::new();
    r.runtime.set_anchor_delay(Duration::from_millis(100));
    let web = r.infraless_pod("web").await;
    let db = r.infraless_pod("db").await;
    let first = r.created(&web, "app").await;
    let second = r.created(&db, "app").await;
    r.pods.start_container(&first).await.unwrap();
    // Another pod's start, in flight well past the first one's anchor delay.
    r.runtime.delay("start", Duration::from_secs(1));
    let pods = r.pods.clone();
    let slow = tokio::spawn(async move { pods.start_container(&second).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        r.runtime.calls("ensure_stats_anchor"),
        0,
        "no anchor while a start is in flight"
    );
    slow.await.unwrap().unwrap();
    // Both follow the burst, one at a time.
    until("both anchors", || r.runtime.anchors().len() == 2).await;
    assert_eq!(r.runtime.anchor_counts(), (2, 0));
}

#[tokio::test]
async fn a_pod_with_an_infra_process_gets_no_stats_anchor() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.running(&sb, "app").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(r.runtime.calls("ensure_stats_anchor"), 0);
}

#[tokio::test]
async fn a_stopped_pod_gets_no_stats_anchor() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    r.pods.stop_sandbox(sb.as_str()).await.unwrap();
    // As if a start had asked for it just before the stop.
    r.pods.anchor_later(&sb);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(r.runtime.calls("ensure_stats_anchor"), 0);
    assert!(r.runtime.anchors().is_empty());
}

#[tokio::test]
async fn a_pod_stopped_before_the_anchor_delay_gets_none_and_its_stop_waits_for_nothing() {
    let r = Rig::new();
    r.runtime.set_anchor_delay(Duration::from_millis(300));
    let sb = r.infraless_pod("web").await;
    r.running(&sb, "app").await;
    within("the stop", r.pods.stop_sandbox(sb.as_str()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(r.runtime.calls("ensure_stats_anchor"), 0);
    assert!(r.runtime.anchors().is_empty());
}

#[tokio::test]
async fn a_failed_stats_anchor_is_counted_and_the_start_still_succeeds() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    r.runtime
        .fail_next("ensure_stats_anchor", failed("runc create failed"));
    let id = r.created(&sb, "app").await;
    r.pods.start_container(&id).await.unwrap();
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Running);
    until("the failure counted", || {
        r.runtime.anchor_counts() == (0, 1)
    })
    .await;
    assert_eq!(r.sandbox(&sb).unwrap().state, SandboxState::Ready);
}

#[tokio::test]
async fn the_exit_of_a_stats_anchor_leaves_its_pod_ready() {
    let r = Rig::new();
    let sb = r.infraless_pod("web").await;
    r.pods.apply_event(&ContainerEvent {
        id: sb.as_str().to_owned(),
        kind: ContainerEventKind::Exited {
            code: 137,
            at: None,
            exec_id: String::new(),
            pid: 1,
        },
    });
    assert_eq!(r.sandbox(&sb).unwrap().state, SandboxState::Ready);
}

#[tokio::test]
async fn a_created_containers_stop_lets_its_task_go_and_it_stays_created() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.created(&sb, "idle").await;
    let mut rx = r.pods.subscribe();
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    // The runtime is asked: a task made at the create goes unstarted.
    assert_eq!(r.runtime.calls("stop"), 1);
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Created);
    // The end of that task is no exit of the container's.
    r.runtime.set_unstarted(&id, 4242);
    r.pods.apply_event(&ContainerEvent {
        id: id.clone(),
        kind: ContainerEventKind::Exited {
            code: 137,
            at: Some(SystemTime::now()),
            exec_id: String::new(),
            pid: 4242,
        },
    });
    let rec = r.container(&id).unwrap();
    assert_eq!(rec.state, ContainerState::Created);
    assert_eq!(rec.exit_code, None);
    assert!(drain(&mut rx).is_empty());
    // It starts as any created container.
    r.pods.start_container(&id).await.unwrap();
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Running);
    // The pod's stop asks for the task of a container never started too.
    let idle = r.created(&sb, "idle2").await;
    r.pods.stop_sandbox(sb.as_str()).await.unwrap();
    assert_eq!(r.container(&idle).unwrap().state, ContainerState::Created);
}
