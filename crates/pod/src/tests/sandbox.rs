//! Pod sandbox rules: run, stop, remove, admission, rollback, cancellation.

use std::time::Duration;

use cubelet_engine::fake::Behavior;
use cubelet_engine::{EngineError, FlowKind};
use cubelet_store::SandboxState;

use super::harness::{drain, spec, within, Rig};
use crate::{PodError, PodEventKind};

#[tokio::test]
async fn run_makes_a_ready_sandbox_with_what_the_steps_published() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let rec = r.sandbox(&id).unwrap();
    assert_eq!(rec.state, SandboxState::Ready);
    assert_eq!(rec.spec, spec("web"));
    let process = rec.process.expect("the sandbox step published its process");
    assert_eq!(process.runtime_handler, "sandbox");
    assert_eq!(r.held(), 3);
    assert_eq!(id.as_str().len(), 64);
    assert!(id.as_str().chars().all(|c| c.is_ascii_hexdigit()));
}

#[tokio::test]
async fn every_sandbox_gets_a_fresh_id() {
    let r = Rig::new();
    let a = r.ready_pod("a").await;
    let b = r.ready_pod("b").await;
    assert_ne!(a, b);
}

#[tokio::test]
async fn a_retry_for_the_same_pod_joins_its_sandbox() {
    let r = Rig::new();
    let first = r.ready_pod("web").await;
    let again = r.ready_pod("web").await;
    assert_eq!(first, again);
    assert_eq!(r.pods.list_sandboxes().unwrap().len(), 1);
    assert_eq!(r.pods.history(&first).len(), 1, "one create flow ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_runs_for_one_pod_make_one_sandbox() {
    let r = Rig::new();
    r.fake("sandbox")
        .set(FlowKind::Create, Behavior::Delay(Duration::from_millis(20)));
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let pods = r.pods.clone();
            tokio::spawn(async move { pods.run_sandbox(spec("web")).await })
        })
        .collect();
    let mut ids = Vec::new();
    for run in runs {
        ids.push(within("run", run).await.unwrap().unwrap());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(r.pods.list_sandboxes().unwrap().len(), 1);
}

#[tokio::test]
async fn another_uid_under_the_same_name_is_already_exists() {
    let r = Rig::new();
    let first = r.ready_pod("web").await;
    let mut other = spec("web");
    other.uid = "uid-other".into();
    let err = r.pods.run_sandbox(other).await.unwrap_err();
    match err {
        PodError::AlreadyExists { kind, name, by } => {
            assert_eq!(kind, "pod sandbox");
            assert_eq!(name, "web_test_0");
            assert_eq!(by, first.to_string());
        }
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
}

#[tokio::test]
async fn a_new_attempt_gets_a_new_sandbox() {
    let r = Rig::new();
    let first = r.ready_pod("web").await;
    let mut next = spec("web");
    next.attempt = 1;
    let second = r.pods.run_sandbox(next).await.unwrap();
    assert_ne!(first, second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_run_writes_nothing() {
    let r = Rig::with_limits(1, 4);
    r.fake("sandbox").set(FlowKind::Create, Behavior::Hang);
    let pods = r.pods.clone();
    let hung = tokio::spawn(async move { pods.run_sandbox(spec("slow")).await });
    within("first create holds the slot", async {
        while r.fake("sandbox").held() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let err = r.pods.run_sandbox(spec("fast")).await.unwrap_err();
    assert!(
        matches!(
            err,
            PodError::Engine(EngineError::Rejected {
                flow: FlowKind::Create,
                limit: 1
            })
        ),
        "{err:?}"
    );
    let recs = r.pods.list_sandboxes().unwrap();
    assert_eq!(recs.len(), 1, "only the admitted pod is recorded");
    assert_eq!(recs[0].spec.name, "slow");
    assert_eq!(
        r.store.list_flows().unwrap().len(),
        1,
        "no journal entry either"
    );
    r.shutdown.cancel();
    let _ = within("hung create ends at shutdown", hung).await;
}

#[tokio::test]
async fn a_failed_create_rolls_back_and_leaves_nothing() {
    let r = Rig::new();
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let err = r.pods.run_sandbox(spec("web")).await.unwrap_err();
    assert!(err.to_string().contains("sandbox create failed"), "{err}");
    assert!(r.pods.list_sandboxes().unwrap().is_empty());
    assert_eq!(r.held(), 0);
    assert!(
        r.store.list_flows().unwrap().is_empty(),
        "journal forgotten"
    );
}

#[tokio::test]
async fn a_failed_rollback_leaves_the_record_for_the_gc() {
    let r = Rig::new();
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.fake("network").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    r.pods.run_sandbox(spec("web")).await.unwrap_err();
    let recs = r.pods.list_sandboxes().unwrap();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].state, SandboxState::NeedsCleanup);
    assert!(recs[0]
        .last_error
        .as_deref()
        .unwrap_or("")
        .contains("network destroy failed"));
    let candidates = r.pods.gc_candidates(Duration::from_secs(3600)).unwrap();
    assert_eq!(candidates.len(), 1);
}

#[tokio::test]
async fn a_pod_left_for_cleanup_does_not_block_a_new_run() {
    let r = Rig::new();
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.fake("network").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    r.pods.run_sandbox(spec("web")).await.unwrap_err();
    r.fake("sandbox").set(FlowKind::Create, Behavior::Ok);
    let id = r.ready_pod("web").await;
    assert_eq!(r.sandbox(&id).unwrap().state, SandboxState::Ready);
    assert_eq!(r.pods.list_sandboxes().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_still_gets_its_sandbox() {
    let r = Rig::new();
    r.fake("sandbox")
        .set(FlowKind::Create, Behavior::Delay(Duration::from_millis(50)));
    let pods = r.pods.clone();
    let call = tokio::spawn(async move { pods.run_sandbox(spec("web")).await });
    within("create under way", async {
        while r.pods.list_sandboxes().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    call.abort(); // kubelet's deadline passed: the request future is dropped
    let rec = within("the create still finishes", async {
        loop {
            let recs = r.pods.list_sandboxes().unwrap();
            if recs.first().is_some_and(|r| r.state == SandboxState::Ready) {
                return recs[0].clone();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    // kubelet's retry joins it.
    assert_eq!(r.ready_pod("web").await, rec.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_a_create_in_flight_and_rolls_it_back() {
    let r = Rig::new();
    r.fake("network").set(FlowKind::Create, Behavior::Hang);
    let pods = r.pods.clone();
    let call = tokio::spawn(async move { pods.run_sandbox(spec("web")).await });
    within("network step running", async {
        while r.fake("network").held() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    r.shutdown.cancel();
    let err = within("cancelled", call).await.unwrap().unwrap_err();
    assert!(
        matches!(err, PodError::Engine(EngineError::Cancelled { .. })),
        "{err:?}"
    );
    assert_eq!(r.held(), 0, "rolled back");
    assert!(r.pods.list_sandboxes().unwrap().is_empty());
}

#[tokio::test]
async fn run_emits_created_and_started_for_the_sandbox() {
    let r = Rig::new();
    let mut rx = r.pods.subscribe();
    let id = r.ready_pod("web").await;
    assert_eq!(
        drain(&mut rx),
        [
            (id.to_string(), PodEventKind::Created),
            (id.to_string(), PodEventKind::Started)
        ]
    );
}

#[tokio::test]
async fn events_carry_the_pod_as_it_was() {
    let r = Rig::new();
    let mut rx = r.pods.subscribe();
    let id = r.ready_pod("web").await;
    let c = r.created(&id, "app").await;
    let mut last = None;
    while let Ok(e) = rx.try_recv() {
        last = Some(e);
    }
    let e = last.unwrap();
    assert_eq!(e.container_id, c);
    assert_eq!(e.sandbox_id, id);
    assert_eq!(e.sandbox.unwrap().state, SandboxState::Ready);
    assert_eq!(e.containers.len(), 1);
}

#[tokio::test]
async fn stop_stops_every_container_then_destroys() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let a = r.running(&id, "a").await;
    let b = r.running(&id, "b").await;
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    for c in [a, b] {
        assert_eq!(
            r.container(&c).unwrap().state,
            cubelet_store::ContainerState::Exited
        );
    }
    let rec = r.sandbox(&id).unwrap();
    assert_eq!(rec.state, SandboxState::NotReady);
    assert!(rec.stopped_at.is_some());
    assert!(rec.process.is_none());
    assert_eq!(r.held(), 0, "destroy released every step");
    // Only StopContainer waits for the runtime to let go of the tasks.
    assert_eq!(r.runtime.calls("settle"), 0);
    // Each stop reported its exit: no status call after it.
    assert_eq!(r.runtime.calls("stop"), 2);
    assert_eq!(r.runtime.calls("status"), 0);
}

#[tokio::test]
async fn stopping_twice_or_an_unknown_pod_is_ok() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    let stopped_at = r.sandbox(&id).unwrap().stopped_at;
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    assert_eq!(r.sandbox(&id).unwrap().stopped_at, stopped_at);
    r.pods.stop_sandbox(&"f".repeat(64)).await.unwrap();
}

#[tokio::test]
async fn stop_keeps_a_pod_marked_for_cleanup() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.store
        .update_sandbox(&id, |s| s.state = SandboxState::NeedsCleanup)
        .unwrap();
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    assert_eq!(r.sandbox(&id).unwrap().state, SandboxState::NeedsCleanup);
}

#[tokio::test]
async fn stop_emits_stopped_for_the_containers_and_the_sandbox() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let c = r.running(&id, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    assert_eq!(
        drain(&mut rx),
        [
            (c, PodEventKind::Stopped),
            (id.to_string(), PodEventKind::Stopped)
        ]
    );
}

#[tokio::test]
async fn a_failed_destroy_is_returned_and_the_pod_stays_ready() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.fake("storage").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    let err = r.pods.stop_sandbox(id.as_str()).await.unwrap_err();
    assert!(err.to_string().contains("storage destroy failed"), "{err}");
    assert_eq!(r.sandbox(&id).unwrap().state, SandboxState::Ready);
}

#[tokio::test]
async fn a_unique_prefix_names_a_pod() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let rec = r
        .pods
        .require_sandbox("pod_sandbox_id", &id.as_str()[..12])
        .unwrap();
    assert_eq!(rec.id, id);
    r.pods.stop_sandbox(&id.as_str()[..12]).await.unwrap();
    assert_eq!(r.sandbox(&id).unwrap().state, SandboxState::NotReady);
}

#[tokio::test]
async fn an_ambiguous_prefix_is_invalid_argument() {
    let r = Rig::new();
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(r.ready_pod(&format!("p{i}")).await);
    }
    // Among 40 random hex ids two share a first digit.
    let first = |id: &cubelet_engine::SandboxId| id.as_str()[..1].to_owned();
    let shared = ids
        .iter()
        .find(|a| ids.iter().filter(|b| first(b) == first(a)).count() > 1)
        .map(first)
        .unwrap();
    match r.pods.find_sandbox("pod_sandbox_id", &shared).unwrap_err() {
        PodError::InvalidArgument { field, reason } => {
            assert_eq!(field, "pod_sandbox_id");
            assert!(reason.contains("ambiguous"));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_malformed_id_is_invalid_argument_naming_the_field() {
    let r = Rig::new();
    for bad in ["", "../etc", "A B"] {
        match r.pods.stop_sandbox(bad).await.unwrap_err() {
            PodError::InvalidArgument { field, .. } => assert_eq!(field, "pod_sandbox_id"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(matches!(
        r.pods.require_sandbox("pod_sandbox_id", &"a".repeat(64)),
        Err(PodError::NotFound {
            kind: "pod sandbox",
            ..
        })
    ));
}

#[tokio::test]
async fn remove_takes_the_containers_runs_cleanup_and_forgets() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let c = r.running(&id, "app").await;
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
    assert!(r.sandbox(&id).is_none());
    assert!(r.container(&c).is_none());
    assert!(
        r.runtime.container(&c).is_none(),
        "removed from the runtime"
    );
    assert_eq!(r.held(), 0);
    assert!(r.pods.history(&id).is_empty(), "journal forgotten");
}

#[tokio::test]
async fn removing_twice_or_an_unknown_pod_is_ok() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
    r.pods.remove_sandbox(&"e".repeat(64)).await.unwrap();
}

#[tokio::test]
async fn a_failed_cleanup_marks_the_pod_and_counts_attempts() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.fake("storage").set(
        FlowKind::Cleanup,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    for attempt in 1..=2 {
        r.pods.remove_sandbox(id.as_str()).await.unwrap_err();
        let rec = r.sandbox(&id).unwrap();
        assert_eq!(rec.state, SandboxState::NeedsCleanup);
        assert_eq!(rec.cleanup_attempts, attempt);
        assert!(rec.last_error.unwrap().contains("storage cleanup failed"));
    }
    r.fake("storage").set(FlowKind::Cleanup, Behavior::Ok);
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
    assert!(r.sandbox(&id).is_none());
}

#[tokio::test]
async fn a_rejected_cleanup_changes_nothing() {
    let r = Rig::with_limits(16, 1);
    let id = r.ready_pod("web").await;
    let busy = r.pods.engine().admit(FlowKind::Cleanup).unwrap();
    let err = r.pods.remove_sandbox(id.as_str()).await.unwrap_err();
    assert!(
        matches!(
            err,
            PodError::Engine(EngineError::Rejected {
                flow: FlowKind::Cleanup,
                ..
            })
        ),
        "{err:?}"
    );
    let rec = r.sandbox(&id).unwrap();
    assert_eq!(rec.state, SandboxState::Ready);
    assert_eq!(rec.cleanup_attempts, 0);
    drop(busy);
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
}

#[tokio::test]
async fn remove_emits_deleted_for_the_containers_and_the_sandbox() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    let c = r.created(&id, "app").await;
    let mut rx = r.pods.subscribe();
    r.pods.remove_sandbox(id.as_str()).await.unwrap();
    assert_eq!(
        drain(&mut rx),
        [
            (c, PodEventKind::Deleted),
            (id.to_string(), PodEventKind::Deleted)
        ]
    );
}

#[tokio::test]
async fn gc_candidates_are_pods_left_for_cleanup_and_long_stopped_ones() {
    let r = Rig::new();
    let ready = r.ready_pod("ready").await;
    let stopped = r.ready_pod("stopped").await;
    r.pods.stop_sandbox(stopped.as_str()).await.unwrap();
    let marked = r.ready_pod("marked").await;
    r.store
        .update_sandbox(&marked, |s| s.state = SandboxState::NeedsCleanup)
        .unwrap();
    let ids = |ttl| {
        let mut v: Vec<_> = r
            .pods
            .gc_candidates(ttl)
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        ids(Duration::from_secs(3600)),
        std::slice::from_ref(&marked)
    );
    let mut both = vec![marked, stopped];
    both.sort();
    assert_eq!(ids(Duration::ZERO), both);
    assert!(!ids(Duration::ZERO).contains(&ready));
}

#[tokio::test]
async fn stopped_pods_kubelet_still_lists_are_not_gc_candidates() {
    let r = Rig::new();
    let listed = r.ready_pod("listed").await;
    let forgotten = r.ready_pod("forgotten").await;
    r.pods.stop_sandbox(listed.as_str()).await.unwrap();
    r.pods.stop_sandbox(forgotten.as_str()).await.unwrap();
    let ttl = Duration::from_millis(300);
    let ids = || {
        let mut v: Vec<_> = r
            .pods
            .gc_candidates(ttl)
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        v.sort();
        v
    };
    // Both stopped just now, and the service started just now: kept.
    assert!(ids().is_empty());
    // kubelet keeps naming `listed` (ListPodSandbox, PodSandboxStatus)
    // while both are stopped longer than the TTL.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        r.pods.note_seen([&listed]);
    }
    assert_eq!(ids(), std::slice::from_ref(&forgotten));
    // Once kubelet stops naming it for the TTL, it goes too.
    tokio::time::sleep(ttl).await;
    let mut both = vec![listed, forgotten];
    both.sort();
    assert_eq!(ids(), both);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_and_remove_of_one_pod_never_overlap() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    r.fake("sandbox").set(
        FlowKind::Destroy,
        Behavior::Delay(Duration::from_millis(30)),
    );
    let (a, b) = tokio::join!(
        r.pods.stop_sandbox(id.as_str()),
        r.pods.remove_sandbox(id.as_str())
    );
    a.unwrap();
    b.unwrap();
    // Whichever ran second saw the first one's result, not a half-done pod.
    assert!(r.sandbox(&id).is_none());
    assert_eq!(r.held(), 0);
    assert!(r.pods.history(&id).is_empty());
}

#[tokio::test]
async fn port_forward_needs_a_ready_pod() {
    let r = Rig::new();
    let id = r.ready_pod("web").await;
    assert_eq!(r.pods.ready_sandbox(&id.as_str()[..8]).unwrap().id, id);
    r.pods.stop_sandbox(id.as_str()).await.unwrap();
    let e = r.pods.ready_sandbox(id.as_str()).unwrap_err();
    assert!(matches!(e, PodError::FailedPrecondition(_)), "{e}");
    assert!(e.to_string().contains("not ready"), "{e}");
    let e = r.pods.ready_sandbox(&"e".repeat(64)).unwrap_err();
    assert!(matches!(e, PodError::NotFound { .. }), "{e}");
    let e = r.pods.ready_sandbox("").unwrap_err();
    assert!(e.to_string().contains("pod_sandbox_id"), "{e}");
}
