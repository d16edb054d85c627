//! Engine tests with fake providers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use proptest::prelude::*;
use tokio::sync::Barrier;

use crate::fake::{Behavior, FakeFlow};
use crate::*;

/// Keeps the fakes' deliberate panics out of the test output.
fn quiet_fake_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !msg.starts_with("fake-panic") {
                default(info);
            }
        }));
    });
}

#[derive(Default)]
struct CountingObserver {
    rejected: AtomicUsize,
    started: AtomicUsize,
    finished: Mutex<Vec<(FlowKind, Outcome)>>,
    steps: Mutex<Vec<(FlowKind, String, Outcome)>>,
    rollbacks: Mutex<Vec<Outcome>>,
    limits: Mutex<HashMap<FlowKind, usize>>,
    waits: Mutex<Vec<(FlowKind, Duration, bool)>>,
}

impl FlowObserver for CountingObserver {
    fn flow_started(&self, _flow: FlowKind) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }
    fn flow_finished(&self, flow: FlowKind, outcome: Outcome, _elapsed: Duration) {
        self.finished.lock().unwrap().push((flow, outcome));
    }
    fn step_finished(&self, flow: FlowKind, step: &str, outcome: Outcome, _elapsed: Duration) {
        self.steps
            .lock()
            .unwrap()
            .push((flow, step.to_owned(), outcome));
    }
    fn rejected(&self, _flow: FlowKind, _limit: usize) {
        self.rejected.fetch_add(1, Ordering::SeqCst);
    }
    fn rollback(&self, _flow: FlowKind, outcome: Outcome) {
        self.rollbacks.lock().unwrap().push(outcome);
    }
    fn limit_changed(&self, flow: FlowKind, limit: usize) {
        self.limits.lock().unwrap().insert(flow, limit);
    }
    fn admission_waited(&self, flow: FlowKind, waited: Duration, admitted: bool) {
        self.waits.lock().unwrap().push((flow, waited, admitted));
    }
}

/// One journal write the engine made: its flow, whether it was the flow's
/// first (`begin_stage`), whether it settled the flow and whether it had to
/// be durable on return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Write {
    flow: FlowId,
    first: bool,
    settles: bool,
    durable: bool,
}

/// A [`MemJournal`] that also lists the batched writes made to it.
#[derive(Default)]
struct CountingJournal {
    inner: MemJournal,
    writes: Mutex<Vec<Write>>,
}

impl CountingJournal {
    fn records(&self) -> Vec<FlowRecord> {
        self.inner.records()
    }
    fn writes_of(&self, flow: FlowId) -> Vec<Write> {
        let writes = self.writes.lock().unwrap();
        writes.iter().filter(|w| w.flow == flow).copied().collect()
    }
}

impl Journal for CountingJournal {
    fn begin(&self, start: FlowStart<'_>) -> Result<FlowId, JournalError> {
        self.inner.begin(start)
    }
    fn step(&self, id: FlowId, step: &str, event: StepEvent<'_>) -> Result<(), JournalError> {
        self.inner.step(id, step, event)
    }
    fn finish(&self, id: FlowId, s: FlowState, e: Option<&str>) -> Result<(), JournalError> {
        self.inner.finish(id, s, e)
    }
    fn begin_stage(
        &self,
        start: FlowStart<'_>,
        started: &[StepEntry<'_>],
    ) -> Result<FlowId, JournalError> {
        let id = self.inner.begin_stage(start, started)?;
        self.writes.lock().unwrap().push(Write {
            flow: id,
            first: true,
            settles: false,
            durable: start.durable,
        });
        Ok(id)
    }
    fn record(
        &self,
        id: FlowId,
        events: &[StepEntry<'_>],
        settle: Option<Settle<'_>>,
    ) -> Result<(), JournalError> {
        self.writes.lock().unwrap().push(Write {
            flow: id,
            first: false,
            settles: settle.is_some(),
            durable: settle.is_some_and(|s| s.durable),
        });
        self.inner.record(id, events, settle)
    }
    fn open_flows(&self) -> Result<Vec<FlowRecord>, JournalError> {
        self.inner.open_flows()
    }
    fn sandbox_history(&self, sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, JournalError> {
        self.inner.sandbox_history(sandbox_id)
    }
    fn forget(&self, sandbox_id: &SandboxId) -> Result<usize, JournalError> {
        self.inner.forget(sandbox_id)
    }
}

/// Checks that flow `rec` made one journal write per stage boundary: a
/// first write, at most one between each two of its `stages`, and at most
/// one settling write, which comes last.
fn assert_one_write_per_stage(journal: &CountingJournal, rec: &FlowRecord, stages: usize) {
    let writes = journal.writes_of(rec.id);
    assert!(
        writes.first().is_some_and(|w| w.first),
        "flow {} did not start with its first write: {writes:?}",
        rec.id
    );
    assert_eq!(writes.iter().filter(|w| w.first).count(), 1, "{writes:?}");
    assert!(writes.len() <= stages + 1, "{stages} stages: {writes:?}");
    let settling: Vec<usize> = (0..writes.len()).filter(|&i| writes[i].settles).collect();
    assert!(settling.len() <= 1, "{writes:?}");
    if let Some(&i) = settling.first() {
        assert_eq!(i, writes.len() - 1, "settling write not last: {writes:?}");
    }
}

struct Rig {
    engine: Engine,
    fakes: HashMap<String, Arc<FakeFlow>>,
    journal: Arc<CountingJournal>,
    observer: Arc<CountingObserver>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Rig {
    fn fake(&self, name: &str) -> &FakeFlow {
        &self.fakes[name]
    }
    fn held(&self) -> usize {
        self.fakes.values().map(|f| f.held()).sum()
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

fn config(create: &[&[&str]], concurrent: i64) -> WorkflowConfig {
    let stages = |s: &[&[&str]]| -> Vec<Vec<String>> {
        s.iter()
            .map(|st| st.iter().map(|n| n.to_string()).collect())
            .collect()
    };
    let all: Vec<&str> = create.iter().flat_map(|s| s.iter().copied()).collect();
    let reversed: Vec<&[&str]> = create.iter().rev().copied().collect();
    let mut flows = std::collections::BTreeMap::new();
    flows.insert(
        "create".into(),
        FlowConfig {
            concurrent,
            steps: stages(create),
            admission_wait: std::time::Duration::ZERO,
        },
    );
    flows.insert(
        "destroy".into(),
        FlowConfig {
            concurrent: 32,
            steps: stages(&reversed),
            admission_wait: std::time::Duration::ZERO,
        },
    );
    flows.insert(
        "cleanup".into(),
        FlowConfig {
            concurrent: 4,
            steps: vec![stages(&[&all])[0].clone()],
            admission_wait: std::time::Duration::ZERO,
        },
    );
    WorkflowConfig { flows }
}

fn rig_with(create: &[&[&str]], concurrent: i64, options: EngineOptions) -> Rig {
    rig_config(create, &config(create, concurrent), options)
}

fn rig_config(create: &[&[&str]], config: &WorkflowConfig, options: EngineOptions) -> Rig {
    let log = Arc::new(Mutex::new(Vec::new()));
    let journal = Arc::new(CountingJournal::default());
    let observer = Arc::new(CountingObserver::default());
    let mut builder = EngineBuilder::new()
        .journal(journal.clone())
        .observer(observer.clone())
        .options(options);
    let mut fakes = HashMap::new();
    for name in create.iter().flat_map(|s| s.iter()) {
        let fake = FakeFlow::with_log(name, log.clone());
        builder = builder.provider(*name, fake.clone());
        fakes.insert(name.to_string(), fake);
    }
    let engine = builder.build(config).unwrap();
    Rig {
        engine,
        fakes,
        journal,
        observer,
        log,
    }
}

fn rig(create: &[&[&str]], concurrent: i64) -> Rig {
    rig_with(create, concurrent, EngineOptions::default())
}

fn ctx(id: &str) -> Arc<FlowContext> {
    Arc::new(FlowContext::new(SandboxId::new_unchecked(id), Arc::default()).with_failover(true))
}

const DEFAULT: &[&[&str]] = &[&["storage", "network"], &["sandbox"]];

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 10s"))
}

#[tokio::test]
async fn steps_of_a_stage_run_in_parallel() {
    let r = rig(DEFAULT, 16);
    // With two parties, the barrier only opens if both steps wait at once.
    let barrier = Arc::new(Barrier::new(2));
    r.fake("storage")
        .set(FlowKind::Create, Behavior::Barrier(barrier.clone()));
    r.fake("network")
        .set(FlowKind::Create, Behavior::Barrier(barrier));
    within("parallel stage", r.engine.run(FlowKind::Create, ctx("a")))
        .await
        .unwrap();
    assert_eq!(r.held(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_blocking_its_thread_does_not_hold_up_its_siblings() {
    let r = rig(DEFAULT, 16);
    // Each step blocks its thread until the other has come too: steps that
    // only took turns on one task would find themselves alone.
    let meet = crate::fake::Rendezvous::new(2, Duration::from_secs(5));
    for step in ["storage", "network"] {
        r.fake(step)
            .set(FlowKind::Create, Behavior::Rendezvous(meet.clone()));
    }
    r.engine.run(FlowKind::Create, ctx("a")).await.unwrap();
    assert_eq!(r.held(), 3);
    assert!(
        !r.log().iter().any(|l| l.ends_with(":alone")),
        "{:?}",
        r.log()
    );
}

#[tokio::test]
async fn a_success_the_caller_commits_is_settled_buffered_a_failure_durably() {
    let r = rig(DEFAULT, 16);
    let committed = |id: &str| {
        Arc::new(
            FlowContext::new(SandboxId::new_unchecked(id), Arc::default())
                .with_failover(true)
                .with_caller_commit(true),
        )
    };
    let settling = |sandbox: &str| -> Vec<Write> {
        let rec = r
            .journal
            .records()
            .into_iter()
            .find(|rec| rec.sandbox_id.as_str() == sandbox && rec.kind == FlowKind::Create)
            .unwrap();
        r.journal
            .writes_of(rec.id)
            .into_iter()
            .filter(|w| w.settles)
            .collect()
    };
    r.engine
        .run(FlowKind::Create, committed("a"))
        .await
        .unwrap();
    let a = settling("a");
    assert_eq!(a.len(), 1, "{a:?}");
    assert!(!a[0].durable, "the caller's write makes it durable: {a:?}");

    r.engine.run(FlowKind::Create, ctx("b")).await.unwrap();
    let b = settling("b");
    assert!(b.len() == 1 && b[0].durable, "{b:?}");

    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.engine
        .run(FlowKind::Create, committed("c"))
        .await
        .unwrap_err();
    let c = settling("c");
    assert!(c.len() == 1 && c[0].durable, "a failure is durable: {c:?}");
}

#[tokio::test]
async fn each_stage_boundary_is_one_journal_write() {
    let r = rig(DEFAULT, 16);
    r.engine.run(FlowKind::Create, ctx("a")).await.unwrap();
    r.engine.run(FlowKind::Destroy, ctx("a")).await.unwrap();
    r.engine.run(FlowKind::Cleanup, ctx("a")).await.unwrap();
    let recs = r.journal.records();
    let kinds: Vec<FlowKind> = recs.iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [FlowKind::Create, FlowKind::Destroy, FlowKind::Cleanup]
    );
    let write = |first, settles| Write {
        flow: 0,
        first,
        settles,
        durable: first || settles,
    };
    for (rec, stages) in recs.iter().zip([2, 2, 1]) {
        assert_one_write_per_stage(&r.journal, rec, stages);
        let shape: Vec<Write> = r
            .journal
            .writes_of(rec.id)
            .into_iter()
            .map(|w| Write { flow: 0, ..w })
            .collect();
        // First (durable), one buffered write per later stage, settling (durable).
        let mut want = vec![write(true, false)];
        want.extend((1..stages).map(|_| write(false, false)));
        want.push(write(false, true));
        assert_eq!(shape, want, "{:?}", rec.kind);
        assert_eq!(rec.state, FlowState::Succeeded);
        // The history is what one write per event used to give.
        assert!(rec
            .steps
            .iter()
            .all(|s| s.duration.is_some() && s.error.is_none()));
    }
    let mut steps: Vec<(usize, &str)> = recs[0]
        .steps
        .iter()
        .map(|s| (s.stage, s.step.as_str()))
        .collect();
    steps.sort();
    assert_eq!(steps, [(0, "network"), (0, "storage"), (1, "sandbox")]);
}

#[tokio::test]
async fn a_failed_stage_is_recorded_with_the_settling_write() {
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let err = r.engine.run(FlowKind::Create, ctx("a")).await.unwrap_err();
    assert!(!err.rollback_failed(), "{err}");
    let recs = r.journal.records();
    assert_eq!(recs.len(), 2);
    assert_one_write_per_stage(&r.journal, &recs[0], 2);
    assert_one_write_per_stage(&r.journal, &recs[1], 2);
    let failed = recs[0].steps.iter().find(|s| s.step == "sandbox").unwrap();
    assert_eq!(failed.stage, 1);
    assert!(failed.duration.is_some());
    assert!(
        failed.error.as_deref().unwrap().contains("sandbox"),
        "{failed:?}"
    );
    assert_eq!(recs[0].state, FlowState::Compensated);
    assert_eq!(recs[1].compensates, Some(recs[0].id));
}

#[tokio::test]
async fn stages_run_in_order_and_outputs_flow_forward() {
    let r = rig(DEFAULT, 16);
    let c = ctx("a");
    r.engine.run(FlowKind::Create, c.clone()).await.unwrap();
    let log = r.log();
    let sandbox_start = log
        .iter()
        .position(|l| l == "create:sandbox:start")
        .unwrap();
    for first in ["create:storage:end", "create:network:end"] {
        assert!(
            log.iter().position(|l| l == first).unwrap() < sandbox_start,
            "{log:?}"
        );
    }
    // The last stage's step published last.
    let process = c.get::<crate::spec::SandboxProcess>();
    assert_eq!(
        process.map(|p| p.runtime_handler).as_deref(),
        Some("sandbox")
    );

    r.engine.run(FlowKind::Destroy, ctx("a")).await.unwrap();
    let log = r.log();
    let sandbox_end = log.iter().position(|l| l == "destroy:sandbox:end").unwrap();
    let net_start = log
        .iter()
        .position(|l| l == "destroy:network:start")
        .unwrap();
    assert!(
        sandbox_end < net_start,
        "destroy runs stages in its own order: {log:?}"
    );
    assert_eq!(r.held(), 0);
}

#[tokio::test]
async fn flow_past_the_limit_is_rejected_at_once() {
    let n = 3;
    let r = rig(DEFAULT, n as i64);
    let barrier = Arc::new(Barrier::new(n + 1));
    r.fake("sandbox")
        .set(FlowKind::Create, Behavior::Barrier(barrier.clone()));
    let mut held = Vec::new();
    for i in 0..n {
        let engine = r.engine.clone();
        held.push(tokio::spawn(async move {
            engine.run(FlowKind::Create, ctx(&format!("s{i}"))).await
        }));
    }
    // Wait until all n are in flight.
    within("admission", async {
        while r.engine.limits()[0].1.inflight < n {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let err = r
        .engine
        .run(FlowKind::Create, ctx("extra"))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::Rejected { flow: FlowKind::Create, limit } if limit == n));
    assert_eq!(r.observer.rejected.load(Ordering::SeqCst), 1);
    assert_eq!(r.engine.limits()[0].1.rejected, 1);
    // The rejected flow never touched a provider or the journal.
    assert!(!r.log().iter().any(|l| l.contains("extra")));
    assert!(r
        .journal
        .records()
        .iter()
        .all(|rec| rec.sandbox_id.as_str() != "extra"));
    barrier.wait().await;
    for h in held {
        within("held flows", h).await.unwrap().unwrap();
    }
    assert_eq!(r.engine.limits()[0].1.peak, n);
}

#[tokio::test]
async fn limit_can_change_at_run_time() {
    let r = rig(DEFAULT, 1);
    assert_eq!(r.observer.limits.lock().unwrap()[&FlowKind::Create], 1);
    let barrier = Arc::new(Barrier::new(2));
    r.fake("sandbox")
        .set(FlowKind::Create, Behavior::Barrier(barrier.clone()));
    let engine = r.engine.clone();
    let first = tokio::spawn(async move { engine.run(FlowKind::Create, ctx("a")).await });
    within("admission", async {
        while r.engine.limits()[0].1.inflight < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(matches!(
        r.engine.run(FlowKind::Create, ctx("b")).await,
        Err(EngineError::Rejected { .. })
    ));
    r.engine.set_limit(FlowKind::Create, 2).unwrap();
    assert_eq!(r.observer.limits.lock().unwrap()[&FlowKind::Create], 2);
    r.fake("sandbox").set(FlowKind::Create, Behavior::Ok);
    r.engine.run(FlowKind::Create, ctx("b")).await.unwrap();
    barrier.wait().await;
    first.await.unwrap().unwrap();
}

#[tokio::test]
async fn failover_destroys_every_provider_even_those_never_created() {
    let r = rig(DEFAULT, 16);
    r.fake("storage").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let err = r.engine.run(FlowKind::Create, ctx("a")).await.unwrap_err();
    match &err {
        EngineError::Failed {
            failures, rollback, ..
        } => {
            assert_eq!(
                failures.len(),
                1,
                "cancelled siblings are not failures: {failures:?}"
            );
            assert_eq!(failures[0].step, "storage");
            assert!(matches!(
                rollback.as_deref(),
                Some(RollbackError::RolledBack)
            ));
        }
        other => panic!("unexpected {other:?}"),
    }
    let log = r.log();
    assert!(
        !log.contains(&"create:sandbox:start".to_owned()),
        "stage 2 never ran"
    );
    for p in ["storage", "network", "sandbox"] {
        assert!(
            log.contains(&format!("destroy:{p}:end")),
            "{p} not destroyed: {log:?}"
        );
    }
    assert_eq!(r.held(), 0);
    assert_eq!(*r.observer.rollbacks.lock().unwrap(), vec![Outcome::Ok]);
    let recs = r.journal.records();
    assert_eq!(recs[0].state, FlowState::Compensated);
    assert_eq!(recs[1].kind, FlowKind::Destroy);
    assert_eq!(recs[1].compensates, Some(recs[0].id));
    assert!(r.journal.open_flows().unwrap().is_empty());
    assert!(err.to_string().contains("storage create failed"), "{err}");
}

#[tokio::test]
async fn a_panicking_step_is_an_error_not_a_crash() {
    quiet_fake_panics();
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Panic {
            after_acquire: true,
        },
    );
    let err = r.engine.run(FlowKind::Create, ctx("a")).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("step panicked: fake-panic: sandbox"),
        "{err}"
    );
    assert_eq!(err.step_kind(), Some(StepErrorKind::Internal));
    assert_eq!(r.held(), 0);
    // The engine still works.
    r.fake("sandbox").set(FlowKind::Create, Behavior::Ok);
    r.engine.run(FlowKind::Create, ctx("b")).await.unwrap();
}

#[tokio::test]
async fn cancellation_mid_stage_stops_forward_steps_and_rolls_back() {
    let r = rig(DEFAULT, 16);
    r.fake("network").set(FlowKind::Create, Behavior::Hang);
    let c = ctx("a");
    let token = c.cancel_token().clone();
    let engine = r.engine.clone();
    let run = tokio::spawn(async move { engine.run(FlowKind::Create, c).await });
    within("hang start", async {
        while !r.fake("network").holds(&SandboxId::new_unchecked("a")) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    token.cancel();
    let err = within("cancelled flow", run).await.unwrap().unwrap_err();
    assert!(
        matches!(err, EngineError::Cancelled { ref rollback, .. }
        if matches!(rollback.as_deref(), Some(RollbackError::RolledBack))),
        "{err:?}"
    );
    assert!(!r.log().contains(&"create:sandbox:start".to_owned()));
    assert_eq!(r.held(), 0);
    assert!(r
        .observer
        .finished
        .lock()
        .unwrap()
        .contains(&(FlowKind::Create, Outcome::Cancelled)));
}

#[tokio::test]
async fn a_run_dropped_half_way_is_left_open_for_recovery() {
    // The pod service drives every run to its end; a run that still stops
    // half-way (the process was killed) is what the journal is for.
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(FlowKind::Create, Behavior::Hang);
    let c = ctx("a");
    let engine = r.engine.clone();
    let run = tokio::spawn(async move { engine.run(FlowKind::Create, c).await });
    within("hang start", async {
        while !r.fake("sandbox").holds(&SandboxId::new_unchecked("a")) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    run.abort();
    let _ = run.await;
    assert_eq!(r.engine.limits()[0].1.inflight, 0, "the slot came back");
    assert_eq!(r.journal.open_flows().unwrap().len(), 1);
    let report = r.engine.recover().await.unwrap();
    assert_eq!(report.settled.len(), 1);
    assert_eq!(r.held(), 0);
    assert!(r.journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn admission_comes_before_any_record_and_holds_its_slot() {
    let r = rig(DEFAULT, 1);
    let admitted = r.engine.admit(FlowKind::Create).unwrap();
    assert_eq!(admitted.kind(), FlowKind::Create);
    // Admitting writes nothing: the journal is still empty.
    assert!(r.journal.records().is_empty());
    let err = r.engine.admit(FlowKind::Create).unwrap_err();
    assert!(
        matches!(err, EngineError::Rejected { limit: 1, .. }),
        "{err:?}"
    );
    assert!(
        r.journal.records().is_empty(),
        "a rejection records nothing"
    );
    admitted.run(ctx("a")).await.unwrap();
    assert_eq!(r.journal.records().len(), 1);
    // The slot came back when the run ended; an unused admission gives
    // its slot back when dropped.
    drop(r.engine.admit(FlowKind::Create).unwrap());
    r.engine.admit(FlowKind::Create).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_full_flow_waits_its_admission_wait_then_rejects() {
    let mut cfg = config(DEFAULT, 1);
    if let Some(create) = cfg.flows.get_mut("create") {
        create.admission_wait = Duration::from_millis(200);
    }
    let r = rig_config(DEFAULT, &cfg, EngineOptions::default());
    // A slot that frees within the wait admits the waiting request.
    let held = r.engine.admit(FlowKind::Create).unwrap();
    let engine = r.engine.clone();
    let waiting = tokio::spawn(async move { engine.admit_waiting(FlowKind::Create).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "a full flow made the request wait");
    drop(held);
    let admitted = waiting.await.unwrap().unwrap();
    admitted.run(ctx("a")).await.unwrap();
    // One that does not is rejected once the wait runs out, recording
    // nothing, and the plain `admit` never waits.
    let held = r.engine.admit(FlowKind::Create).unwrap();
    let started = tokio::time::Instant::now();
    let err = r.engine.run(FlowKind::Create, ctx("b")).await.unwrap_err();
    assert!(
        matches!(err, EngineError::Rejected { limit: 1, .. }),
        "{err:?}"
    );
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    assert!(r.engine.admit(FlowKind::Create).is_err());
    drop(held);
    assert_eq!(r.journal.records().len(), 1, "only the admitted run wrote");
    assert_eq!(r.observer.rejected.load(Ordering::SeqCst), 2);
    assert_eq!(
        *r.observer.waits.lock().unwrap(),
        [
            (FlowKind::Create, Duration::from_millis(50), true),
            (FlowKind::Create, Duration::from_millis(200), false),
        ]
    );
}

#[tokio::test]
async fn teardown_runs_every_step_and_reports_every_failure() {
    let r = rig(DEFAULT, 16);
    r.engine.run(FlowKind::Create, ctx("a")).await.unwrap();
    r.fake("sandbox").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    r.fake("storage").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    let err = r.engine.run(FlowKind::Destroy, ctx("a")).await.unwrap_err();
    let EngineError::Failed { failures, .. } = &err else {
        panic!("{err:?}")
    };
    let steps: Vec<_> = failures.iter().map(|f| f.step.as_str()).collect();
    assert_eq!(steps.len(), 2);
    assert!(steps.contains(&"sandbox") && steps.contains(&"storage"));
    assert!(
        !r.fake("network").holds(&SandboxId::new_unchecked("a")),
        "network still torn down"
    );
    // The failed destroy stays open; recovery finishes it.
    assert_eq!(r.journal.open_flows().unwrap().len(), 1);
    r.fake("sandbox").set(FlowKind::Destroy, Behavior::Ok);
    r.fake("storage").set(FlowKind::Destroy, Behavior::Ok);
    let report = r.engine.recover().await.unwrap();
    assert_eq!(report.settled.len(), 1);
    assert!(report.failed.is_empty());
    assert_eq!(r.held(), 0);
    assert!(r.journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn rollback_is_not_rejected_when_destroy_is_full() {
    let r = rig(DEFAULT, 16);
    r.engine.set_limit(FlowKind::Destroy, 1).unwrap();
    // Hold the only destroy slot with a user destroy that waits.
    let barrier = Arc::new(Barrier::new(2));
    r.engine.run(FlowKind::Create, ctx("held")).await.unwrap();
    r.fake("sandbox")
        .set(FlowKind::Destroy, Behavior::Barrier(barrier.clone()));
    let engine = r.engine.clone();
    let user = tokio::spawn(async move { engine.run(FlowKind::Destroy, ctx("held")).await });
    within("destroy admitted", async {
        while r.engine.limits()[1].1.inflight < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(matches!(
        r.engine.run(FlowKind::Destroy, ctx("other")).await,
        Err(EngineError::Rejected { .. })
    ));
    // A failing create still gets its rollback.
    r.fake("network").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.fake("sandbox").set(FlowKind::Destroy, Behavior::Ok);
    let err = within(
        "create with rollback",
        r.engine.run(FlowKind::Create, ctx("b")),
    )
    .await
    .unwrap_err();
    assert!(!err.rollback_failed(), "{err}");
    assert!(!r
        .fakes
        .values()
        .any(|f| f.holds(&SandboxId::new_unchecked("b"))));
    barrier.wait().await;
    user.await.unwrap().unwrap();
}

#[tokio::test]
async fn rollback_that_times_out_is_reported_and_left_open() {
    let r = rig_with(
        DEFAULT,
        16,
        EngineOptions {
            rollback_timeout: Duration::from_millis(50),
            rollback_concurrency: 1,
        },
    );
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.fake("network").set(FlowKind::Destroy, Behavior::Hang);
    let err = r.engine.run(FlowKind::Create, ctx("a")).await.unwrap_err();
    assert!(err.rollback_failed());
    assert!(err.to_string().contains("rollback timed out"), "{err}");
    assert_eq!(*r.observer.rollbacks.lock().unwrap(), vec![Outcome::Error]);
    // Both the create and its rollback stay open for recovery / GC.
    assert_eq!(r.journal.open_flows().unwrap().len(), 2);
    r.fake("network").set(FlowKind::Destroy, Behavior::Ok);
    let report = r.engine.recover().await.unwrap();
    assert_eq!(
        report.settled,
        vec![(SandboxId::new_unchecked("a"), FlowKind::Destroy)]
    );
    assert_eq!(r.held(), 0);
}

#[tokio::test]
async fn without_failover_recover_undoes_the_failed_create() {
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let c = Arc::new(FlowContext::new(
        SandboxId::new_unchecked("a"),
        Arc::default(),
    ));
    let err = r.engine.run(FlowKind::Create, c).await.unwrap_err();
    assert!(matches!(err, EngineError::Failed { rollback: None, .. }));
    assert_eq!(r.held(), 3);
    assert_eq!(r.journal.open_flows().unwrap()[0].state, FlowState::Failed);
    let report = r.engine.recover().await.unwrap();
    assert_eq!(report.settled.len(), 1);
    assert_eq!(r.held(), 0);
    assert!(r.journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn prewarm_runs_the_create_stages_under_a_limit_of_its_own() {
    let r = rig(DEFAULT, 1);
    // Left out of the configuration: the create flow's stages, one at a time.
    assert_eq!(
        r.engine.stages(FlowKind::Prewarm),
        r.engine.stages(FlowKind::Create)
    );
    let prewarm = r.engine.admit(FlowKind::Prewarm).unwrap();
    assert!(matches!(
        r.engine.admit(FlowKind::Prewarm),
        Err(EngineError::Rejected {
            flow: FlowKind::Prewarm,
            limit: 1
        })
    ));
    // Its permit is not the create flow's: a create is admitted beside it.
    r.engine.run(FlowKind::Create, ctx("user")).await.unwrap();
    prewarm.run(ctx("shell")).await.unwrap();
    let log = r.log();
    for name in ["storage", "network", "sandbox"] {
        assert!(log.contains(&format!("prewarm:{name}:end")), "{log:?}");
    }
    assert_eq!(r.held(), 6);
    // A claimed create of the shell runs with what prewarm published.
    let shell = SandboxOutputs {
        process: Some(crate::spec::SandboxProcess::default()),
        ..Default::default()
    };
    let claim = Arc::new(
        FlowContext::new(SandboxId::new_unchecked("shell"), Arc::default()).with_shell(shell),
    );
    assert!(claim.claimed());
    assert!(claim.get::<crate::spec::SandboxProcess>().is_some());
    r.engine.run(FlowKind::Create, claim).await.unwrap();
    assert_eq!(r.held(), 6, "the claim took what the shell held");
}

/// The record of flow `kind` of sandbox `id`.
fn flow_of(r: &Rig, kind: FlowKind, id: &str) -> FlowRecord {
    r.journal
        .records()
        .into_iter()
        .find(|f| f.kind == kind && f.sandbox_id.as_str() == id)
        .unwrap()
}

/// Whether the first write of flow `kind` of sandbox `id` was durable.
fn first_write_durable(r: &Rig, kind: FlowKind, id: &str) -> bool {
    let writes = r.journal.writes_of(flow_of(r, kind, id).id);
    assert!(writes[0].first, "{writes:?}");
    writes[0].durable
}

/// Whether the last write of flow `kind` of sandbox `id` settled it
/// durably.
fn settled_durably(r: &Rig, kind: FlowKind, id: &str) -> bool {
    let writes = r.journal.writes_of(flow_of(r, kind, id).id);
    writes.last().is_some_and(|w| w.settles && w.durable)
}

fn claim(id: &str) -> Arc<FlowContext> {
    Arc::new(
        FlowContext::new(SandboxId::new_unchecked(id), Arc::default())
            .with_failover(true)
            .with_shell(SandboxOutputs::default()),
    )
}

#[tokio::test]
async fn only_a_claim_every_step_confines_to_its_shell_starts_buffered() {
    let r = rig(DEFAULT, 16);
    // No step says so (the default): durable.
    r.engine.run(FlowKind::Create, claim("c0")).await.unwrap();
    assert!(first_write_durable(&r, FlowKind::Create, "c0"));
    // Every step but one: durable.
    r.fake("storage").set_confined(true);
    r.fake("network").set_confined(true);
    r.engine.run(FlowKind::Create, claim("c1")).await.unwrap();
    assert!(first_write_durable(&r, FlowKind::Create, "c1"));
    // Every step: buffered; the settle is durable (no caller commit).
    r.fake("sandbox").set_confined(true);
    r.engine.run(FlowKind::Create, claim("c2")).await.unwrap();
    assert!(!first_write_durable(&r, FlowKind::Create, "c2"));
    assert!(settled_durably(&r, FlowKind::Create, "c2"));
    // A cold create with the same steps: durable.
    r.engine.run(FlowKind::Create, ctx("cold")).await.unwrap();
    assert!(first_write_durable(&r, FlowKind::Create, "cold"));
    // The teardowns of a confined claim start durably as ever.
    r.engine.run(FlowKind::Destroy, claim("c2")).await.unwrap();
    r.engine.run(FlowKind::Cleanup, claim("c2")).await.unwrap();
    assert!(first_write_durable(&r, FlowKind::Destroy, "c2"));
    assert!(first_write_durable(&r, FlowKind::Cleanup, "c2"));
    // A confined claim that fails is rolled back, and the rollback and the
    // failure are durable.
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    r.engine
        .run(FlowKind::Create, claim("c3"))
        .await
        .unwrap_err();
    assert!(!first_write_durable(&r, FlowKind::Create, "c3"));
    assert!(first_write_durable(&r, FlowKind::Destroy, "c3"));
    assert_eq!(
        flow_of(&r, FlowKind::Create, "c3").state,
        FlowState::Compensated
    );
    assert!(settled_durably(&r, FlowKind::Create, "c3"));
    assert!(!r
        .fakes
        .values()
        .any(|f| f.holds(&SandboxId::new_unchecked("c3"))));
}

#[tokio::test]
async fn a_failed_prewarm_is_rolled_back_by_cleanup() {
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(
        FlowKind::Prewarm,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let err = r
        .engine
        .run(FlowKind::Prewarm, ctx("shell"))
        .await
        .unwrap_err();
    assert!(!err.rollback_failed(), "{err}");
    assert_eq!(r.held(), 0);
    let log = r.log();
    assert!(log.iter().any(|l| l == "cleanup:network:end"), "{log:?}");
    assert!(!log.iter().any(|l| l.starts_with("destroy:")), "{log:?}");
}

#[tokio::test]
async fn recovery_rolls_an_interrupted_prewarm_back_with_cleanup() {
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(FlowKind::Prewarm, Behavior::Hang);
    let run = r.engine.run(FlowKind::Prewarm, ctx("half"));
    // Dropped half-way, as a kill -9 would leave it.
    assert!(tokio::time::timeout(Duration::from_millis(50), run)
        .await
        .is_err());
    assert!(r.held() > 0);
    let report = r.engine.recover().await.unwrap();
    assert_eq!(
        report.settled,
        [(SandboxId::new_unchecked("half"), FlowKind::Cleanup)]
    );
    assert_eq!(r.held(), 0);
    assert!(r.journal.open_flows().unwrap().is_empty());
}

#[test]
fn a_configured_prewarm_flow_is_validated_like_the_others() {
    let mut cfg = config(DEFAULT, 16);
    cfg.flows.insert(
        "prewarm".into(),
        FlowConfig {
            concurrent: 2,
            steps: vec![vec!["network".into()], vec!["nope".into()]],
            admission_wait: std::time::Duration::ZERO,
        },
    );
    let err = cfg
        .validate(["storage", "network", "sandbox"])
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("flows.prewarm.steps[1]"), "{err}");
    cfg.flows.get_mut("prewarm").unwrap().steps = vec![vec!["network".into()]];
    let flows = cfg.validate(["storage", "network", "sandbox"]).unwrap();
    let prewarm = flows.iter().find(|f| f.kind == FlowKind::Prewarm).unwrap();
    assert_eq!(prewarm.concurrent, 2);
    assert_eq!(prewarm.stages, vec![vec!["network".to_owned()]]);
}

#[tokio::test]
async fn failed_recovery_is_reported_and_stays_open() {
    let r = rig(DEFAULT, 16);
    r.fake("sandbox").set(
        FlowKind::Create,
        Behavior::Fail {
            after_acquire: true,
        },
    );
    let c = Arc::new(FlowContext::new(
        SandboxId::new_unchecked("a"),
        Arc::default(),
    ));
    r.engine.run(FlowKind::Create, c).await.unwrap_err();
    r.fake("storage").set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    let report = r.engine.recover().await.unwrap();
    assert_eq!(report.failed.len(), 1);
    assert!(report.failed[0]
        .1
        .to_string()
        .contains("storage destroy failed"));
    assert!(!r.journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn init_runs_every_provider_once() {
    let r = rig(DEFAULT, 16);
    r.engine.init().await.unwrap();
    for f in r.fakes.values() {
        assert_eq!(f.init_calls(), 1);
    }
}

#[test]
fn build_refuses_unknown_providers() {
    let err = EngineBuilder::new()
        .provider("storage", FakeFlow::new("storage"))
        .build(&WorkflowConfig::default())
        .unwrap_err();
    assert!(
        err.to_string().contains("unknown provider \"network\""),
        "{err}"
    );
}

// ---- deferred work ---------------------------------------------------------

type Gate = tokio::sync::oneshot::Sender<Result<(), StepError>>;

/// A provider whose steps defer work that waits, when the test queued a
/// gate for it, until the test opens the gate with the work's result.
#[derive(Default)]
struct Deferring {
    gates: Mutex<std::collections::VecDeque<tokio::sync::oneshot::Receiver<Result<(), StepError>>>>,
    done: Arc<AtomicUsize>,
}

impl Deferring {
    fn hold(&self) -> Gate {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.gates.lock().unwrap().push_back(rx);
        tx
    }
    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }
    async fn defer(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let gate = self.gates.lock().unwrap().pop_front();
        let done = Arc::clone(&self.done);
        ctx.defer("finish the test teardown", async move {
            let result = match gate {
                Some(rx) => rx.await.unwrap_or(Ok(())),
                None => Ok(()),
            };
            done.fetch_add(1, Ordering::SeqCst);
            result
        })
        .await
    }
}

#[async_trait::async_trait]
impl Flow for Deferring {
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        if self.gates.lock().unwrap().is_empty() {
            return Ok(());
        }
        self.defer(ctx).await
    }
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.defer(ctx).await
    }
    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.defer(ctx).await
    }
}

fn deferring_engine(journal: Arc<CountingJournal>) -> (Engine, Arc<Deferring>) {
    let flow = Arc::new(Deferring::default());
    let engine = EngineBuilder::new()
        .journal(journal)
        .provider("net", flow.clone())
        .build(&config(&[&["net"]], 16))
        .unwrap();
    (engine, flow)
}

fn record_of(journal: &CountingJournal, kind: FlowKind) -> FlowRecord {
    journal
        .records()
        .into_iter()
        .rev()
        .find(|r| r.kind == kind)
        .unwrap()
}

#[tokio::test]
async fn a_teardown_answers_before_its_deferred_work_and_the_next_flow_waits_for_it() {
    let journal = Arc::new(CountingJournal::default());
    let (engine, flow) = deferring_engine(journal.clone());
    engine.run(FlowKind::Create, ctx("a")).await.unwrap();
    let gate = flow.hold();
    within("destroy", engine.run(FlowKind::Destroy, ctx("a")))
        .await
        .unwrap();
    // Answered; the work still runs and the flow stays open meanwhile.
    assert_eq!(flow.done(), 0);
    assert_eq!(engine.deferred_running(), 1);
    let destroy = record_of(&journal, FlowKind::Destroy);
    assert_eq!(destroy.state, FlowState::Running);
    assert_eq!(journal.open_flows().unwrap().len(), 1);

    let e = engine.clone();
    let cleanup = tokio::spawn(async move { e.run(FlowKind::Cleanup, ctx("a")).await });
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(!cleanup.is_finished(), "the next flow waits for the work");
    assert!(journal
        .records()
        .iter()
        .all(|r| r.kind != FlowKind::Cleanup));
    gate.send(Ok(())).unwrap();
    within("cleanup", cleanup).await.unwrap().unwrap();
    within("drain", engine.drain()).await;
    assert_eq!(flow.done(), 2);
    assert_eq!(engine.deferred_running(), 0);
    let destroy = record_of(&journal, FlowKind::Destroy);
    assert_eq!(destroy.state, FlowState::Succeeded);
    assert!(destroy.steps.iter().all(|s| s.duration.is_some()));
    assert_one_write_per_stage(&journal, &destroy, 1);
    assert!(journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn deferred_work_that_fails_leaves_its_flow_to_recovery() {
    let journal = Arc::new(CountingJournal::default());
    let (engine, flow) = deferring_engine(journal.clone());
    let gate = flow.hold();
    engine.run(FlowKind::Destroy, ctx("a")).await.unwrap();
    gate.send(Err(StepError::internal(Message("veth busy".into()))))
        .unwrap();
    within("drain", engine.drain()).await;
    let destroy = record_of(&journal, FlowKind::Destroy);
    assert_eq!(destroy.state, FlowState::Failed);
    assert!(
        destroy.error.as_deref().unwrap().contains("veth busy"),
        "{destroy:?}"
    );
    let report = within("recover", engine.recover()).await.unwrap();
    assert_eq!(report.settled.len(), 1);
    assert!(report.failed.is_empty());
    // Recovery ran the teardown again and waited for its work.
    assert_eq!(flow.done(), 2);
    assert!(journal.open_flows().unwrap().is_empty());
}

#[tokio::test]
async fn a_crash_before_deferred_work_is_done_leaves_an_open_flow() {
    let journal = Arc::new(CountingJournal::default());
    let (engine, flow) = deferring_engine(journal.clone());
    let _never_opened = flow.hold();
    engine.run(FlowKind::Destroy, ctx("a")).await.unwrap();
    // The agent dies here: a new engine on the same journal recovers.
    let (restarted, flow2) = deferring_engine(journal.clone());
    assert_eq!(journal.open_flows().unwrap().len(), 1);
    let report = within("recover", restarted.recover()).await.unwrap();
    assert_eq!(
        report.settled,
        [(SandboxId::new_unchecked("a"), FlowKind::Destroy)]
    );
    assert_eq!(flow2.done(), 1);
    assert!(journal.open_flows().unwrap().is_empty());
    assert_eq!(flow.done(), 0);
}

#[tokio::test]
async fn a_failed_teardown_runs_its_deferred_work_before_it_settles() {
    let journal = Arc::new(CountingJournal::default());
    let flow = Arc::new(Deferring::default());
    let failing = FakeFlow::with_log("box", Arc::default());
    failing.set(
        FlowKind::Destroy,
        Behavior::Fail {
            after_acquire: false,
        },
    );
    let engine = EngineBuilder::new()
        .journal(journal.clone())
        .provider("net", flow.clone())
        .provider("box", failing)
        .build(&config(&[&["net", "box"]], 16))
        .unwrap();
    let gate = flow.hold();
    let e = engine.clone();
    let run = tokio::spawn(async move { e.run(FlowKind::Destroy, ctx("a")).await });
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(!run.is_finished(), "a failed teardown waits for the work");
    gate.send(Ok(())).unwrap();
    let err = within("destroy", run).await.unwrap().unwrap_err();
    assert!(err.to_string().contains("box"), "{err}");
    assert_eq!(flow.done(), 1);
    assert_eq!(engine.deferred_running(), 0);
    assert_eq!(
        record_of(&journal, FlowKind::Destroy).state,
        FlowState::Failed
    );
}

#[tokio::test]
async fn without_an_engine_deferred_work_runs_in_the_step() {
    let flow = Deferring::default();
    let gate = flow.hold();
    gate.send(Err(StepError::internal(Message("no".into()))))
        .unwrap();
    let err = flow.destroy(&ctx("a")).await.unwrap_err();
    assert!(err.to_string().contains("no"), "{err}");
    assert_eq!(flow.done(), 1);
}

#[tokio::test]
async fn a_create_waits_for_its_deferred_work_and_fails_with_it() {
    let journal = Arc::new(CountingJournal::default());
    let (engine, flow) = deferring_engine(journal.clone());
    let gate = flow.hold();
    let e = engine.clone();
    let run = tokio::spawn(async move { e.run(FlowKind::Create, ctx("b")).await });
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(!run.is_finished(), "a create settles only after its work");
    gate.send(Err(StepError::internal(Message("no".into()))))
        .unwrap();
    let err = within("create", run).await.unwrap().unwrap_err();
    assert!(!err.rollback_failed(), "{err}");
    assert!(err.to_string().contains("net"), "the step failed: {err}");
    assert_eq!(
        record_of(&journal, FlowKind::Create).state,
        FlowState::Compensated
    );
    // The rollback's own work ran before it settled.
    assert_eq!(
        record_of(&journal, FlowKind::Destroy).state,
        FlowState::Succeeded
    );
    assert_eq!(engine.deferred_running(), 0);
    assert_eq!(flow.done(), 2);
}

// ---- property test -------------------------------------------------------

#[derive(Debug, Clone)]
enum Fault {
    Ok,
    Fail { after_acquire: bool },
    Panic { after_acquire: bool },
    Hang,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => Just(Fault::Ok),
        2 => any::<bool>().prop_map(|after_acquire| Fault::Fail { after_acquire }),
        1 => any::<bool>().prop_map(|after_acquire| Fault::Panic { after_acquire }),
        1 => Just(Fault::Hang),
    ]
}

/// Stages of 1–3 uniquely named providers, 1–3 stages, each with a fault.
fn plan() -> impl Strategy<Value = Vec<Vec<Fault>>> {
    prop::collection::vec(prop::collection::vec(fault(), 1..=3), 1..=3)
}

const NAMES: [&str; 9] = ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8"];

fn run_case(plan: &[Vec<Fault>], failover: bool) -> Result<(), TestCaseError> {
    quiet_fake_panics();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut k = 0;
        let stages: Vec<Vec<&str>> = plan
            .iter()
            .map(|s| {
                s.iter()
                    .map(|_| {
                        k += 1;
                        NAMES[k - 1]
                    })
                    .collect()
            })
            .collect();
        let stage_refs: Vec<&[&str]> = stages.iter().map(Vec::as_slice).collect();
        let r = rig(&stage_refs, 16);
        let mut hang = None;
        for (stage, faults) in stages.iter().zip(plan) {
            for (name, f) in stage.iter().zip(faults) {
                let b = match f {
                    Fault::Ok => Behavior::Ok,
                    Fault::Fail { after_acquire } => Behavior::Fail {
                        after_acquire: *after_acquire,
                    },
                    Fault::Panic { after_acquire } => Behavior::Panic {
                        after_acquire: *after_acquire,
                    },
                    Fault::Hang => {
                        hang.get_or_insert(*name);
                        Behavior::Hang
                    }
                };
                r.fake(name).set(FlowKind::Create, b);
            }
        }
        let id = SandboxId::new_unchecked("prop");
        let c = Arc::new(FlowContext::new(id.clone(), Arc::default()).with_failover(failover));
        let token = c.cancel_token().clone();
        let engine = r.engine.clone();
        let run = tokio::spawn(async move { engine.run(FlowKind::Create, c).await });
        if let Some(h) = hang {
            // Cancel once the flow is stuck in the hanging step, or has ended.
            while !run.is_finished() && !r.fake(h).holds(&id) {
                tokio::task::yield_now().await;
            }
            token.cancel();
        }
        let result = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .map_err(|_| TestCaseError::fail("flow did not finish"))?
            .map_err(|e| TestCaseError::fail(format!("join: {e}")))?;
        let all_ok = plan.iter().flatten().all(|f| matches!(f, Fault::Ok));
        match result {
            Ok(()) => {
                prop_assert!(all_ok, "flow succeeded despite a fault");
                prop_assert_eq!(r.held(), plan.iter().flatten().count());
                r.engine
                    .run(FlowKind::Destroy, ctx("prop"))
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Err(e) => {
                prop_assert!(!all_ok, "flow failed without a fault: {}", e);
                if failover {
                    prop_assert!(!e.rollback_failed(), "rollback failed: {}", e);
                } else {
                    let report = r
                        .engine
                        .recover()
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(report.failed.is_empty());
                }
            }
        }
        prop_assert_eq!(r.held(), 0, "leaked resources; log: {:?}", r.log());
        prop_assert!(r.journal.open_flows().unwrap().is_empty());
        for rec in r.journal.records() {
            let stages = match rec.kind {
                FlowKind::Cleanup => 1,
                _ => stages.len(),
            };
            assert_one_write_per_stage(&r.journal, &rec, stages);
        }
        prop_assert_eq!(r.engine.limits()[0].1.inflight, 0);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, .. ProptestConfig::default() })]

    #[test]
    fn no_fault_leaks_with_failover(plan in plan()) {
        run_case(&plan, true)?;
    }

    #[test]
    fn recover_undoes_every_fault_without_failover(plan in plan()) {
        run_case(&plan, false)?;
    }
}
