//! Reconciliation after a restart.

use std::sync::Arc;
use std::time::Duration;

use cubelet_engine::fake::Behavior;
use cubelet_engine::{FlowContext, FlowKind};
use cubelet_store::{ContainerState, SandboxRecord, SandboxState};

use super::harness::{spec, within, Rig};

#[tokio::test]
async fn a_create_the_restart_interrupted_is_left_for_cleanup() {
    let r = Rig::new();
    let id = cubelet_engine::SandboxId::new_unchecked("c".repeat(64));
    r.store
        .put_sandbox(&SandboxRecord::new(id.clone(), spec("web")))
        .unwrap();
    let report = r.pods.reconcile().await.unwrap();
    assert_eq!(report.abandoned, 1);
    let rec = r.sandbox(&id).unwrap();
    assert_eq!(rec.state, SandboxState::NeedsCleanup);
    assert_eq!(
        rec.last_error.as_deref(),
        Some("agent restarted during create")
    );
    assert_eq!(
        r.pods.gc_candidates(Duration::from_secs(60)).unwrap().len(),
        1
    );
}

#[tokio::test]
async fn a_ready_pod_without_its_infra_process_is_not_ready() {
    let r = Rig::new();
    let alive = r.ready_pod("alive").await;
    let dead = r.ready_pod("dead").await;
    r.runtime.set_infra_running(alive.as_str());
    let report = r.pods.reconcile().await.unwrap();
    assert_eq!(report.not_ready, 1);
    assert_eq!(r.sandbox(&alive).unwrap().state, SandboxState::Ready);
    assert_eq!(r.sandbox(&dead).unwrap().state, SandboxState::NotReady);
}

#[tokio::test]
async fn a_pod_without_infra_is_ready_while_its_pins_are() {
    let r = Rig::new();
    let kept = r.infraless_pod("kept").await;
    let lost = r.infraless_pod("lost").await;
    r.runtime.set_pins_alive("/pins/lost", false);
    let status_calls = r.runtime.calls("status");
    let report = r.pods.reconcile().await.unwrap();
    assert_eq!(report.not_ready, 1);
    assert_eq!(r.sandbox(&kept).unwrap().state, SandboxState::Ready);
    assert_eq!(r.sandbox(&lost).unwrap().state, SandboxState::NotReady);
    assert_eq!(
        r.runtime.calls("status"),
        status_calls,
        "no infra task is asked about"
    );
}

#[tokio::test]
async fn running_containers_are_reattached_and_lost_ones_unknown() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.runtime.set_infra_running(sb.as_str());
    let kept = r.running(&sb, "kept").await;
    let lost = r.running(&sb, "lost").await;
    r.runtime.forget(&lost);
    let report = r.pods.reconcile().await.unwrap();
    assert_eq!((report.reattached, report.lost), (1, 1));
    assert_eq!(r.runtime.calls("reattach"), 1);
    assert_eq!(r.container(&kept).unwrap().state, ContainerState::Running);
    let lost = r.container(&lost).unwrap();
    assert_eq!(lost.state, ContainerState::Unknown);
    // Dated when noticed (as containerd's CRI), not left at the epoch.
    let finished = lost
        .finished_at
        .expect("a finish time for a lost container");
    assert!(finished >= lost.started_at.unwrap());
}

#[tokio::test]
async fn exits_while_the_agent_was_down_are_recorded() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    let _ = r.runtime.exit(&id, 9);
    r.pods.reconcile().await.unwrap();
    let rec = r.container(&id).unwrap();
    assert_eq!(
        (rec.state, rec.exit_code),
        (ContainerState::Exited, Some(9))
    );
}

#[tokio::test]
async fn a_container_that_had_exited_stays_exited_when_the_runtime_forgot_it() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let id = r.running(&sb, "app").await;
    r.pods.stop_container(&id, Duration::ZERO).await.unwrap();
    r.runtime.forget(&id);
    r.pods.reconcile().await.unwrap();
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Exited);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_a_crash_left_open_are_settled() {
    let r = Rig::new();
    r.fake("sandbox").set(FlowKind::Create, Behavior::Hang);
    let engine = r.pods.engine().clone();
    let id = cubelet_engine::SandboxId::new_unchecked("a".repeat(64));
    let ctx = Arc::new(FlowContext::new(id.clone(), Arc::new(spec("web"))));
    let run = tokio::spawn(async move { engine.run(FlowKind::Create, ctx).await });
    within("create holds", async {
        while r.fake("sandbox").held() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    run.abort(); // the process died here
    let _ = run.await;
    r.fake("sandbox").set(FlowKind::Create, Behavior::Ok);
    let report = r.pods.reconcile().await.unwrap();
    assert_eq!(report.settled, [(id, FlowKind::Destroy)]);
    assert_eq!(r.held(), 0);
}

#[tokio::test]
async fn orphan_shims_are_reaped_and_counted() {
    let r = Rig::new();
    r.runtime.set_orphan_shims(3);
    assert_eq!(r.pods.reconcile().await.unwrap().shims_reaped, 3);
    assert_eq!(r.pods.reconcile().await.unwrap().shims_reaped, 0);
}

#[tokio::test]
async fn a_runtime_that_cannot_answer_fails_reconciliation() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    r.runtime.set_infra_running(sb.as_str());
    let id = r.running(&sb, "app").await;
    r.runtime.fail_next("status", |_| {
        cubelet_runtime::RuntimeError::FailedPrecondition("containerd down".into())
    });
    // The first status call (the infra process) fails: not alive, not fatal.
    r.runtime.fail_next("status", |_| {
        cubelet_runtime::RuntimeError::FailedPrecondition("containerd down".into())
    });
    let err = r.pods.reconcile().await.unwrap_err();
    assert!(err.to_string().contains("containerd down"), "{err}");
    assert_eq!(r.container(&id).unwrap().state, ContainerState::Running);
}

/// Exits containerd sent while the event stream was down never reach
/// `apply_event`; the resync after the resubscription applies them.
#[tokio::test]
async fn exits_the_event_stream_missed_are_applied_on_resync() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let quiet = r.ready_pod("quiet").await;
    r.runtime.set_infra_running(sb.as_str());
    r.runtime.set_infra_running(quiet.as_str());
    let gone = r.running(&sb, "gone").await;
    let alive = r.running(&sb, "alive").await;
    let mut rx = r.pods.subscribe();
    // Both exit while no subscription stands: their events are lost.
    let _lost = r.runtime.exit(&gone, 4);
    let _lost = r.runtime.exit(quiet.as_str(), 0);
    assert_eq!(r.container(&gone).unwrap().state, ContainerState::Running);
    assert_eq!(r.sandbox(&quiet).unwrap().state, SandboxState::Ready);

    assert_eq!(r.pods.resync_exits().await, 2);
    let rec = r.container(&gone).unwrap();
    assert_eq!(rec.state, ContainerState::Exited);
    assert_eq!(rec.exit_code, Some(4));
    assert!(rec.finished_at.is_some());
    assert_eq!(r.container(&alive).unwrap().state, ContainerState::Running);
    assert_eq!(r.sandbox(&quiet).unwrap().state, SandboxState::NotReady);
    assert_eq!(r.sandbox(&sb).unwrap().state, SandboxState::Ready);
    assert_eq!(
        super::harness::drain(&mut rx),
        [(gone, crate::PodEventKind::Stopped)]
    );
    // Nothing is left to apply.
    assert_eq!(r.pods.resync_exits().await, 0);
}
