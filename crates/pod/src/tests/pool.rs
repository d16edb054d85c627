//! The warm pool at the engine/pod seam: claims, misses, refill, one pod
//! per shell, priority of user flows, shutdown and restart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cubelet_engine::fake::Behavior;
use cubelet_engine::spec::NamespaceMode;
use cubelet_engine::{FlowKind, SandboxId};
use cubelet_store::ShellRecord;

use super::harness::{spec, within, Rig};
use crate::PoolObserver;

#[derive(Debug, Default)]
struct Counts {
    hits: AtomicUsize,
    misses: AtomicUsize,
    ready: AtomicUsize,
}

impl PoolObserver for Counts {
    fn claimed(&self, hit: bool) {
        if hit {
            self.hits.fetch_add(1, Ordering::SeqCst);
        } else {
            self.misses.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn ready(&self, n: usize) {
        self.ready.store(n, Ordering::SeqCst);
    }
}

impl Counts {
    fn get(&self) -> (usize, usize, usize) {
        (
            self.hits.load(Ordering::SeqCst),
            self.misses.load(Ordering::SeqCst),
            self.ready.load(Ordering::SeqCst),
        )
    }
}

fn rig(size: usize) -> (Rig, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let rig = Rig::with_pool(size, counts.clone());
    (rig, counts)
}

/// Waits until `n` shells are ready.
async fn filled(rig: &Rig, n: usize) {
    within("pool fill", async {
        while rig.pods.pool_ready() < n {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

fn shells(rig: &Rig) -> Vec<SandboxId> {
    rig.store
        .list_shells()
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect()
}

fn infraless(name: &str) -> cubelet_engine::SandboxSpec {
    let mut s = spec(name);
    s.namespaces.pid = NamespaceMode::Container;
    s
}

#[tokio::test]
async fn a_pod_claims_a_ready_shell_and_takes_its_id() {
    let (rig, counts) = rig(2);
    assert!(rig.pods.pool_enabled());
    rig.pods.start_pool();
    filled(&rig, 2).await;
    let ready = shells(&rig);
    assert_eq!(ready.len(), 2);
    // Every provider built its part of each shell.
    for id in &ready {
        for name in ["storage", "network", "sandbox"] {
            assert!(rig.fake(name).holds(id), "{name} holds {id}");
        }
    }
    assert_eq!(counts.get(), (0, 0, 2));

    let id = rig.pods.run_sandbox(infraless("web")).await.unwrap();
    assert!(ready.contains(&id), "the pod took a shell's id");
    let rec = rig.sandbox(&id).unwrap();
    assert_eq!(rec.state, crate::SandboxState::Ready);
    assert_eq!(rec.spec.name, "web");
    assert!(!shells(&rig).contains(&id), "no longer a shell");
    assert_eq!(counts.get().0, 1);
    // The create flow still ran every step (for the pod's own part).
    let log = rig.fake("sandbox").log();
    assert!(log.iter().any(|l| l == "prewarm:sandbox:end"), "{log:?}");
    assert!(log.iter().any(|l| l == "create:sandbox:end"), "{log:?}");
    // Its history shows the shell's prewarm, then the pod's create.
    let kinds: Vec<_> = rig.pods.history(&id).iter().map(|f| f.kind).collect();
    assert_eq!(kinds, [FlowKind::Prewarm, FlowKind::Create]);

    // It lives and dies as any pod.
    rig.pods.stop_sandbox(id.as_str()).await.unwrap();
    rig.pods.remove_sandbox(id.as_str()).await.unwrap();
    assert!(rig.sandbox(&id).is_none());
    for name in ["storage", "network", "sandbox"] {
        assert!(!rig.fake(name).holds(&id), "{name} released {id}");
    }
}

#[tokio::test]
async fn pods_no_shell_fits_and_an_empty_pool_take_the_cold_path() {
    let (rig, counts) = rig(1);
    rig.pods.start_pool();
    filled(&rig, 1).await;
    let shell = shells(&rig)[0].clone();
    // Later shells take long: the pool stays empty after the claim below.
    rig.fake("network")
        .set(FlowKind::Prewarm, Behavior::Delay(Duration::from_secs(30)));

    let mut host = infraless("host");
    host.namespaces.network = NamespaceMode::Node;
    let mut userns = infraless("userns");
    userns.namespaces.userns = Some(Default::default());
    let mut node_ipc = infraless("ipc");
    node_ipc.namespaces.ipc = NamespaceMode::Node;
    for s in [host, userns, node_ipc] {
        let id = rig.pods.run_sandbox(s).await.unwrap();
        assert_ne!(id, shell, "a pod no shell fits builds its own");
    }
    assert_eq!(counts.get(), (0, 3, 1));
    assert_eq!(shells(&rig), std::slice::from_ref(&shell));

    // A pause-mode pod (pod PID namespace) fits: network and storage serve it.
    let first = rig.pods.run_sandbox(spec("pause")).await.unwrap();
    assert_eq!(first, shell);
    let second = rig.pods.run_sandbox(infraless("second")).await.unwrap();
    assert_ne!(second, shell);
    assert_eq!(counts.get(), (1, 4, 0));
}

#[tokio::test]
async fn the_pool_refills_in_the_background_and_never_reuses_a_shell() {
    let (rig, counts) = rig(2);
    rig.pods.start_pool();
    let mut used = HashSet::new();
    for i in 0..6 {
        filled(&rig, 2).await;
        let id = rig
            .pods
            .run_sandbox(infraless(&format!("p{i}")))
            .await
            .unwrap();
        assert!(used.insert(id.clone()), "{id} served two pods");
        rig.pods.stop_sandbox(id.as_str()).await.unwrap();
        rig.pods.remove_sandbox(id.as_str()).await.unwrap();
    }
    assert_eq!(counts.get().0, 6);
    filled(&rig, 2).await;
    for shell in shells(&rig) {
        assert!(!used.contains(&shell), "a removed pod's id came back");
    }
    // What is held is exactly the two ready shells' parts.
    assert_eq!(rig.held(), 2 * 3);
}

#[tokio::test]
async fn prewarm_never_delays_or_rejects_a_user_create() {
    let (rig, counts) = rig(1);
    // A prewarm that never finishes holds the prewarm limit (1) for good.
    rig.fake("network").set(FlowKind::Prewarm, Behavior::Hang);
    rig.pods.start_pool();
    within("prewarm start", async {
        while !rig
            .fake("network")
            .log()
            .iter()
            .any(|l| l == "prewarm:network:start")
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    // User creates neither wait for it nor are rejected.
    for i in 0..3 {
        within(
            "user create",
            rig.pods.run_sandbox(infraless(&format!("u{i}"))),
        )
        .await
        .unwrap();
    }
    assert_eq!(counts.get(), (0, 3, 0));
    let create = rig
        .pods
        .engine()
        .limits()
        .into_iter()
        .find(|(k, _)| *k == FlowKind::Create)
        .unwrap()
        .1;
    assert_eq!(create.rejected, 0);
}

#[tokio::test]
async fn no_prewarm_starts_while_a_user_create_runs() {
    let (rig, _counts) = rig(1);
    rig.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Delay(Duration::from_millis(300)),
    );
    let pods = rig.pods.clone();
    let user = tokio::spawn(async move { pods.run_sandbox(infraless("slow")).await });
    // The create is under way before the pool starts.
    within("user create start", async {
        while !rig
            .fake("sandbox")
            .log()
            .iter()
            .any(|l| l == "create:sandbox:start")
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    rig.pods.start_pool();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let log = rig.fake("network").log();
    assert!(
        !log.iter().any(|l| l.starts_with("prewarm:")),
        "prewarm started beside a user create: {log:?}"
    );
    user.await.unwrap().unwrap();
    filled(&rig, 1).await;
}

/// Shells whose `prewarm` flow has started so far.
fn prewarms(rig: &Rig) -> usize {
    rig.fake("network")
        .log()
        .iter()
        .filter(|l| *l == "prewarm:network:start")
        .count()
}

#[tokio::test]
async fn no_prewarm_starts_in_the_quiet_spell_after_a_user_call() {
    // Half the pool stays ready after the claim: it is not low.
    let (rig, _counts) = rig(2);
    rig.pods.start_pool();
    filled(&rig, 2).await;
    let prewarms = || prewarms(&rig);
    assert_eq!(prewarms(), 2);
    // The claim wakes the refill, but the pod's next calls (its
    // containers) come within the spell: no shell starts in it.
    rig.pods.run_sandbox(infraless("web")).await.unwrap();
    let ended = std::time::Instant::now();
    loop {
        let started = prewarms();
        // Read before the clock: a shell counted here started before.
        if ended.elapsed() >= crate::pool::QUIET {
            break;
        }
        assert_eq!(
            started,
            2,
            "a shell started {:?} after a call",
            ended.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // After it the pool fills again.
    filled(&rig, 2).await;
    assert_eq!(prewarms(), 3);
}

/// Keeps the pod service making calls 10 ms apart (pods no shell fits, so
/// they claim nothing) until `until` holds or `limit` passes: no gap
/// between them is a quiet spell. Returns whether `until` held.
async fn calls_until(rig: &Rig, limit: Duration, until: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut n = 0;
    while std::time::Instant::now() < deadline {
        if until() {
            return true;
        }
        let mut host = infraless(&format!("host-{n}"));
        host.namespaces.network = NamespaceMode::Node;
        rig.pods.run_sandbox(host).await.unwrap();
        n += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    until()
}

#[tokio::test]
async fn a_pool_below_half_refills_between_calls_without_a_quiet_spell() {
    let (rig, counts) = rig(4);
    rig.pods.start_pool();
    filled(&rig, 4).await;
    // A burst claims three of four shells: the pool is low (the refill
    // may start as soon as the third call ends).
    for name in ["a", "b", "c"] {
        rig.pods.run_sandbox(infraless(name)).await.unwrap();
    }
    assert_eq!(counts.get().0, 3, "three hits");
    // Calls keep coming with no quiet spell between them, yet the pool
    // refills in their gaps up to half...
    assert!(
        calls_until(&rig, Duration::from_secs(10), || rig.pods.pool_ready() >= 2).await,
        "a low pool was not refilled between calls: {} ready",
        rig.pods.pool_ready()
    );
    // ...and no further while they go on (five quiet spells' time).
    let before = prewarms(&rig);
    let more = calls_until(&rig, crate::pool::QUIET * 5, || prewarms(&rig) > before).await;
    assert!(
        !more,
        "a shell started between calls with half the pool ready"
    );
    assert_eq!(rig.pods.pool_ready(), 2);
    filled(&rig, 4).await;
}

#[tokio::test]
async fn a_failed_prewarm_is_rolled_back_and_leaves_nothing() {
    let (rig, counts) = rig(1);
    rig.fake("sandbox").set(
        FlowKind::Prewarm,
        Behavior::FailTimes(Arc::new(std::sync::Mutex::new(1))),
    );
    rig.pods.start_pool();
    // The first fails (rolled back by cleanup), the retry succeeds.
    within("refill after a failure", async {
        while rig.pods.pool_ready() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(shells(&rig).len(), 1);
    assert_eq!(rig.held(), 3, "only the ready shell's parts are held");
    assert_eq!(counts.get().2, 1);
}

#[tokio::test]
async fn shutdown_destroys_the_ready_shells() {
    let (rig, counts) = rig(3);
    rig.pods.start_pool();
    filled(&rig, 3).await;
    rig.shutdown.cancel();
    assert_eq!(within("close pool", rig.pods.close_pool()).await, 3);
    assert_eq!(rig.held(), 0);
    assert!(shells(&rig).is_empty());
    assert_eq!(counts.get().2, 0);
    assert!(
        rig.store.list_flows().unwrap().is_empty(),
        "journal forgotten"
    );
}

#[tokio::test]
async fn restart_destroys_the_shells_the_last_run_left() {
    let (rig, _counts) = rig(0);
    assert!(!rig.pods.pool_enabled());
    let orphan = SandboxId::new_unchecked("aa".repeat(32));
    rig.store
        .put_shell(&ShellRecord::new(orphan.clone()))
        .unwrap();
    // A shell whose claim was recorded: its record goes, its sandbox stays.
    let claimed = rig.ready_pod("claimed").await;
    rig.store
        .put_shell(&ShellRecord::new(claimed.clone()))
        .unwrap();
    let report = rig.pods.reconcile().await.unwrap();
    assert_eq!(report.shells_destroyed, 1);
    assert!(shells(&rig).is_empty());
    assert!(rig.sandbox(&claimed).is_some());
    let log = rig.fake("network").log();
    assert!(log.iter().any(|l| l == "cleanup:network:end"), "{log:?}");
}

#[tokio::test]
async fn the_pool_off_changes_nothing() {
    let (rig, counts) = rig(0);
    rig.pods.start_pool();
    let id = rig.pods.run_sandbox(infraless("cold")).await.unwrap();
    assert!(rig.sandbox(&id).is_some());
    assert_eq!(counts.get(), (0, 0, 0));
    assert!(!rig
        .fake("network")
        .log()
        .iter()
        .any(|l| l.starts_with("prewarm:")));
    assert_eq!(rig.pods.close_pool().await, 0);
}
