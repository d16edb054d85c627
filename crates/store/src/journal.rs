//! The flow journal: [`cubelet_engine::Journal`] on the store's `flows` table.
//!
//! Semantics are exactly those of [`cubelet_engine::MemJournal`]: ids start
//! at 1 and only grow, steps append in start order, a `Finished` event
//! completes the newest step of that name (or is ignored if there is none),
//! `finish` settles the flow, `open_flows` and `sandbox_history` list oldest
//! first, `forget` drops every flow of a sandbox. One difference, on purpose:
//! ids are never reused, even when the newest flows were forgotten (the last
//! id handed out is kept in the `meta` table).
//!
//! # Writes and durability
//!
//! Every call is one redb write transaction; the batched calls the engine
//! makes ([`Journal::begin_stage`], [`Journal::record`]) are one each, so a
//! flow of n stages costs n + 1 transactions. [`Journal::begin`],
//! [`Journal::begin_stage`], [`Journal::finish`] and a [`Journal::record`]
//! that settles the flow commit with [`Durability::Immediate`]: the record is
//! on disk when they return (a start marked not durable,
//! [`FlowStart::durable`], and a settle marked so, [`Settle::durable`],
//! commit as a step does). [`Journal::step`] and a `record` that does not
//! settle commit with [`Durability::None`]: the change is visible at once to
//! every reader of this process, and becomes durable with the next durable
//! commit of any kind (the flow's settling write, another flow's start, a
//! sandbox update). A crash may lose the step events since the last durable
//! commit, never more, and never leaves a torn record: redb reopens at the
//! last durable commit.
//!
//! That is enough because recovery correctness only depends on the flow's
//! start and its settling: a flow that began and did not finish is open, and
//! recovery tears it down with idempotent `destroy`/`cleanup` steps using the
//! spec recorded at the start, whichever steps did or did not run (see the
//! engine's `run_journaled`). Step events are history (which step ran, how
//! long, what failed) for operators. Making them durable would put an fsync
//! in front of every stage of every flow for no gain in safety.

use cubelet_engine::{
    folds_into, FlowId, FlowRecord, FlowStart, FlowState, Journal, JournalError, SandboxId, Settle,
    StepEntry, StepEvent, StepRecord,
};
use redb::{Durability, ReadableDatabase, ReadableMultimapTable, ReadableTable};
use std::time::SystemTime;

use crate::error::StoreError;
use crate::index::FLOWS_BY_SANDBOX;
use crate::store::{decode, encode, Store, FLOWS, FLOWS_NAME, META, META_LAST_FLOW};

fn journal_err(op: &'static str) -> impl FnOnce(StoreError) -> JournalError {
    move |e| JournalError {
        op,
        source: Box::new(e),
    }
}

/// Applies a step event to a flow record, as [`cubelet_engine::MemJournal`] does.
fn apply(rec: &mut FlowRecord, step: &str, event: StepEvent<'_>, now: SystemTime) {
    match event {
        StepEvent::Started { stage } => rec.steps.push(StepRecord {
            step: step.to_owned(),
            stage,
            started_at: now,
            duration: None,
            error: None,
        }),
        StepEvent::Finished { duration, error } => {
            if let Some(s) = rec.steps.iter_mut().rev().find(|s| s.step == step) {
                s.duration = Some(duration);
                s.error = error.map(str::to_owned);
            }
        }
    }
}

/// Settles a flow record.
fn settle(rec: &mut FlowRecord, state: FlowState, error: Option<&str>, now: SystemTime) {
    rec.state = state;
    rec.error = error.map(str::to_owned);
    rec.finished_at = Some(now);
}

impl Store {
    /// Records a new flow and the `Started` events in `started` in one
    /// transaction, durably unless `start.durable` is false.
    fn begin_flow(
        &self,
        start: FlowStart<'_>,
        started: &[StepEntry<'_>],
    ) -> Result<FlowId, StoreError> {
        let op = "journal begin";
        let mut txn = self.write(op)?;
        let durability = if start.durable {
            Durability::Immediate
        } else {
            Durability::None
        };
        txn.set_durability(durability).map_err(StoreError::db(op))?;
        let id = {
            let mut meta = txn.open_table(META).map_err(StoreError::db(op))?;
            let mut flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
            let counted = match meta.get(META_LAST_FLOW).map_err(StoreError::db(op))? {
                None => 0,
                Some(g) => g
                    .value()
                    .parse::<u64>()
                    .map_err(|_| StoreError::InvalidMeta {
                        key: META_LAST_FLOW,
                        value: g.value().to_owned(),
                    })?,
            };
            let newest = flows
                .last()
                .map_err(StoreError::db(op))?
                .map_or(0, |(k, _)| k.value());
            let id = counted.max(newest) + 1;
            // The sandbox's newest flow, which a retried cleanup replaces
            // (`folds_into`): one record per failing cleanup, not one per try.
            let mut attempts = 1;
            let mut index = txn
                .open_multimap_table(FLOWS_BY_SANDBOX)
                .map_err(StoreError::db(op))?;
            let mut prev_id = None;
            for v in index
                .get(start.sandbox_id.as_str())
                .map_err(StoreError::db(op))?
            {
                prev_id = Some(v.map_err(StoreError::db(op))?.value());
            }
            if let Some(prev_id) = prev_id {
                let prev: Option<FlowRecord> = flows
                    .get(prev_id)
                    .map_err(StoreError::db(op))?
                    .map(|g| decode(FLOWS_NAME, &prev_id.to_string(), g.value()))
                    .transpose()?;
                if let Some(prev) = prev.filter(|p| folds_into(&start, p)) {
                    attempts = prev.attempts.saturating_add(1);
                    flows.remove(prev_id).map_err(StoreError::db(op))?;
                    index
                        .remove(start.sandbox_id.as_str(), prev_id)
                        .map_err(StoreError::db(op))?;
                }
            }
            let now = SystemTime::now();
            let mut rec = FlowRecord {
                id,
                kind: start.kind,
                sandbox_id: start.sandbox_id.clone(),
                spec: start.spec.clone(),
                compensates: start.compensates,
                started_at: now,
                finished_at: None,
                state: FlowState::Running,
                error: None,
                steps: Vec::new(),
                attempts,
            };
            for e in started {
                apply(&mut rec, e.step, e.event, now);
            }
            let bytes = encode(FLOWS_NAME, &id.to_string(), &rec)?;
            flows
                .insert(id, bytes.as_slice())
                .map_err(StoreError::db(op))?;
            let last = id.to_string();
            meta.insert(META_LAST_FLOW, last.as_str())
                .map_err(StoreError::db(op))?;
            index
                .insert(start.sandbox_id.as_str(), id)
                .map_err(StoreError::db(op))?;
            id
        };
        txn.commit().map_err(StoreError::db(op))?;
        Ok(id)
    }

    /// Reads, changes and writes back one flow record in one transaction.
    fn update_flow(
        &self,
        op: &'static str,
        id: FlowId,
        durability: Durability,
        f: impl FnOnce(&mut FlowRecord),
    ) -> Result<(), StoreError> {
        let mut txn = self.write(op)?;
        txn.set_durability(durability).map_err(StoreError::db(op))?;
        {
            let mut flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
            let mut rec: FlowRecord = flows
                .get(id)
                .map_err(StoreError::db(op))?
                .map(|g| decode(FLOWS_NAME, &id.to_string(), g.value()))
                .transpose()?
                .ok_or(StoreError::FlowNotFound(id))?;
            f(&mut rec);
            let bytes = encode(FLOWS_NAME, &id.to_string(), &rec)?;
            flows
                .insert(id, bytes.as_slice())
                .map_err(StoreError::db(op))?;
        }
        txn.commit().map_err(StoreError::db(op))
    }

    /// Every flow record that `keep` accepts, oldest (lowest id) first.
    pub(crate) fn scan_flows(
        &self,
        mut keep: impl FnMut(&FlowRecord) -> bool,
    ) -> Result<Vec<FlowRecord>, StoreError> {
        let op = "journal scan";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
        let mut out = Vec::new();
        for entry in flows.iter().map_err(StoreError::db(op))? {
            let (k, v) = entry.map_err(StoreError::db(op))?;
            let rec: FlowRecord = decode(FLOWS_NAME, &k.value().to_string(), v.value())?;
            if keep(&rec) {
                out.push(rec);
            }
        }
        Ok(out)
    }

    /// The flows of one sandbox, oldest first, found by the index (each
    /// checked against it).
    fn sandbox_flows(&self, sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, StoreError> {
        let op = "journal history";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let index = txn
            .open_multimap_table(FLOWS_BY_SANDBOX)
            .map_err(StoreError::db(op))?;
        let flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
        let mut out = Vec::new();
        // Values of one key come in order: oldest (lowest id) first.
        for id in index.get(sandbox_id.as_str()).map_err(StoreError::db(op))? {
            let id = id.map_err(StoreError::db(op))?.value();
            if let Some(g) = flows.get(id).map_err(StoreError::db(op))? {
                let rec: FlowRecord = decode(FLOWS_NAME, &id.to_string(), g.value())?;
                if &rec.sandbox_id == sandbox_id {
                    out.push(rec);
                }
            }
        }
        Ok(out)
    }

    fn forget_flows(&self, sandbox_id: &SandboxId) -> Result<usize, StoreError> {
        let op = "journal forget";
        let txn = self.write(op)?;
        let removed = {
            let mut index = txn
                .open_multimap_table(FLOWS_BY_SANDBOX)
                .map_err(StoreError::db(op))?;
            let mut flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
            let mut ids = Vec::new();
            for id in index.get(sandbox_id.as_str()).map_err(StoreError::db(op))? {
                ids.push(id.map_err(StoreError::db(op))?.value());
            }
            let mut removed = 0;
            for id in ids {
                index
                    .remove(sandbox_id.as_str(), id)
                    .map_err(StoreError::db(op))?;
                let rec: Option<FlowRecord> = flows
                    .get(id)
                    .map_err(StoreError::db(op))?
                    .map(|g| decode(FLOWS_NAME, &id.to_string(), g.value()))
                    .transpose()?;
                // Checked, though an entry is only ever written with its flow.
                if rec.is_some_and(|r| &r.sandbox_id == sandbox_id) {
                    flows.remove(id).map_err(StoreError::db(op))?;
                    removed += 1;
                }
            }
            removed
        };
        txn.commit().map_err(StoreError::db(op))?;
        Ok(removed)
    }
}

impl Journal for Store {
    fn begin(&self, start: FlowStart<'_>) -> Result<FlowId, JournalError> {
        self.begin_flow(start, &[]).map_err(journal_err("begin"))
    }

    fn step(&self, id: FlowId, step: &str, event: StepEvent<'_>) -> Result<(), JournalError> {
        self.update_flow("journal step", id, Durability::None, |rec| {
            apply(rec, step, event, SystemTime::now());
        })
        .map_err(journal_err("step"))
    }

    fn finish(
        &self,
        id: FlowId,
        state: FlowState,
        error: Option<&str>,
    ) -> Result<(), JournalError> {
        self.update_flow("journal finish", id, Durability::Immediate, |rec| {
            settle(rec, state, error, SystemTime::now());
        })
        .map_err(journal_err("finish"))
    }

    fn begin_stage(
        &self,
        start: FlowStart<'_>,
        started: &[StepEntry<'_>],
    ) -> Result<FlowId, JournalError> {
        self.begin_flow(start, started)
            .map_err(journal_err("begin"))
    }

    fn record(
        &self,
        id: FlowId,
        events: &[StepEntry<'_>],
        finish: Option<Settle<'_>>,
    ) -> Result<(), JournalError> {
        let (op, what, durability) = match finish {
            Some(s) if s.durable => ("journal finish", "finish", Durability::Immediate),
            Some(_) => ("journal finish", "finish", Durability::None),
            None => ("journal step", "step", Durability::None),
        };
        self.update_flow(op, id, durability, |rec| {
            let now = SystemTime::now();
            for e in events {
                apply(rec, e.step, e.event, now);
            }
            if let Some(f) = finish {
                settle(rec, f.state, f.error, now);
            }
        })
        .map_err(journal_err(what))
    }

    fn open_flows(&self) -> Result<Vec<FlowRecord>, JournalError> {
        self.scan_flows(|r| r.state.is_open())
            .map_err(journal_err("open_flows"))
    }

    fn sandbox_history(&self, sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, JournalError> {
        self.sandbox_flows(sandbox_id)
            .map_err(journal_err("sandbox_history"))
    }

    fn forget(&self, sandbox_id: &SandboxId) -> Result<usize, JournalError> {
        self.forget_flows(sandbox_id).map_err(journal_err("forget"))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use cubelet_engine::{FlowKind, MemJournal, SandboxSpec};

    use super::*;

    fn sid(s: &str) -> SandboxId {
        SandboxId::parse(s).unwrap()
    }

    fn open_tmp() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("cubelet.redb")).unwrap();
        (dir, store)
    }

    /// Clock readings differ between two journals; everything else must not.
    fn normalise(mut recs: Vec<FlowRecord>) -> Vec<FlowRecord> {
        for r in &mut recs {
            r.started_at = UNIX_EPOCH;
            r.finished_at = r.finished_at.map(|_| UNIX_EPOCH);
            for s in &mut r.steps {
                s.started_at = UNIX_EPOCH;
            }
        }
        recs
    }

    fn start<'a>(
        kind: FlowKind,
        id: &'a SandboxId,
        spec: &'a SandboxSpec,
        compensates: Option<FlowId>,
    ) -> FlowStart<'a> {
        FlowStart {
            kind,
            sandbox_id: id,
            spec,
            compensates,
            durable: true,
        }
    }

    /// Drives one journal through a script covering every operation and
    /// returns what each observable call said.
    fn script(j: &dyn Journal) -> Vec<String> {
        let a = sid("sba");
        let b = sid("sbb");
        let spec = SandboxSpec {
            name: "web".into(),
            namespace: "ns".into(),
            ..Default::default()
        };
        let mut out = Vec::new();

        let f1 = j.begin(start(FlowKind::Create, &a, &spec, None)).unwrap();
        j.step(f1, "storage", StepEvent::Started { stage: 0 })
            .unwrap();
        j.step(f1, "network", StepEvent::Started { stage: 0 })
            .unwrap();
        let ms = Duration::from_millis(3);
        j.step(
            f1,
            "storage",
            StepEvent::Finished {
                duration: ms,
                error: None,
            },
        )
        .unwrap();
        j.step(
            f1,
            "network",
            StepEvent::Finished {
                duration: ms,
                error: Some("boom"),
            },
        )
        .unwrap();
        // A retried step: Finished completes the newest one of that name.
        j.step(f1, "network", StepEvent::Started { stage: 0 })
            .unwrap();
        j.step(
            f1,
            "network",
            StepEvent::Finished {
                duration: ms * 2,
                error: Some("again"),
            },
        )
        .unwrap();
        // Finished for a step that never started changes nothing.
        j.step(
            f1,
            "sandbox",
            StepEvent::Finished {
                duration: ms,
                error: None,
            },
        )
        .unwrap();
        j.finish(f1, FlowState::Failed, Some("network: boom"))
            .unwrap();

        let f2 = j
            .begin(start(FlowKind::Destroy, &a, &spec, Some(f1)))
            .unwrap();
        j.step(f2, "sandbox", StepEvent::Started { stage: 0 })
            .unwrap();
        j.finish(f2, FlowState::Compensated, None).unwrap();

        let f3 = j.begin(start(FlowKind::Create, &b, &spec, None)).unwrap();
        j.step(f3, "storage", StepEvent::Started { stage: 0 })
            .unwrap();
        // The newest flow belongs to b: MemJournal would hand out a forgotten
        // newest id again, the store never does (tested on its own below).
        let f4 = j
            .begin(start(FlowKind::Destroy, &b, &spec, Some(f3)))
            .unwrap();
        j.finish(f4, FlowState::Succeeded, None).unwrap();
        out.push(format!("ids {f1} {f2} {f3} {f4}"));

        // Unknown ids are errors for step and finish.
        out.push(format!(
            "step unknown err={}",
            j.step(99, "x", StepEvent::Started { stage: 0 }).is_err()
        ));
        out.push(format!(
            "finish unknown err={}",
            j.finish(99, FlowState::Succeeded, None).is_err()
        ));

        let ids = |v: Vec<FlowRecord>| {
            v.iter()
                .map(|r| r.id.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        out.push(format!("open {}", ids(j.open_flows().unwrap())));
        out.push(format!("history a {}", ids(j.sandbox_history(&a).unwrap())));
        out.push(format!("history b {}", ids(j.sandbox_history(&b).unwrap())));
        out.push(format!("{:?}", normalise(j.sandbox_history(&a).unwrap())));
        out.push(format!("{:?}", normalise(j.open_flows().unwrap())));

        out.push(format!("forget a {}", j.forget(&a).unwrap()));
        out.push(format!("forget a again {}", j.forget(&a).unwrap()));
        out.push(format!("history a {}", ids(j.sandbox_history(&a).unwrap())));
        out.push(format!("open {}", ids(j.open_flows().unwrap())));
        let f5 = j
            .begin(start(FlowKind::Cleanup, &b, &spec, Some(f3)))
            .unwrap();
        out.push(format!("next id {f5}"));
        out.push(format!("{:?}", normalise(j.sandbox_history(&b).unwrap())));

        // The batched writes the engine makes: a first stage of two steps, a
        // boundary write, a settling write; unknown ids are errors.
        let entry = |step, event| StepEntry { step, event };
        let started = |stage| StepEvent::Started { stage };
        let f6 = j
            .begin_stage(
                start(FlowKind::Create, &a, &spec, None),
                &[entry("storage", started(0)), entry("network", started(0))],
            )
            .unwrap();
        let done = |error| StepEvent::Finished {
            duration: ms,
            error,
        };
        j.record(
            f6,
            &[
                entry("network", done(None)),
                entry("storage", done(Some("slow"))),
                entry("sandbox", started(1)),
            ],
            None,
        )
        .unwrap();
        out.push(format!("open {}", ids(j.open_flows().unwrap())));
        let settle = Settle {
            state: FlowState::Failed,
            error: Some("sandbox: no"),
            durable: true,
        };
        j.record(f6, &[entry("sandbox", done(Some("no")))], Some(settle))
            .unwrap();
        out.push(format!("{:?}", normalise(j.sandbox_history(&a).unwrap())));
        out.push(format!(
            "record unknown err={}",
            j.record(99, &[], Some(settle)).is_err()
        ));
        out.push(format!("open {}", ids(j.open_flows().unwrap())));
        out
    }

    #[test]
    fn journal_matches_mem_journal() {
        let (_dir, store) = open_tmp();
        let mem = MemJournal::new();
        let want = script(&mem);
        let got = script(&store);
        assert_eq!(got, want);
        // Sanity: the script did exercise what it claims.
        assert_eq!(want[0], "ids 1 2 3 4");
        assert_eq!(want[3], "open 1,3");
        assert_eq!(want[4], "history a 1,2");
        assert!(want.contains(&"forget a 2".to_owned()), "{want:?}");
        assert_eq!(
            normalise(store.list_flows().unwrap()),
            normalise(mem.records())
        );
    }

    /// A cleanup that fails on every GC pass keeps one record, with its
    /// attempt count and last error, in both journals; a different flow in
    /// between, a compensation or a success ends the folding.
    #[test]
    fn a_repeatedly_failing_cleanup_keeps_one_record() {
        let (_dir, store) = open_tmp();
        let mem = MemJournal::new();
        for j in [&store as &dyn Journal, &mem] {
            let a = sid("sba");
            let spec = SandboxSpec::default();
            let create = j.begin(start(FlowKind::Create, &a, &spec, None)).unwrap();
            j.finish(create, FlowState::Succeeded, None).unwrap();
            for n in 1..=5 {
                let f = j.begin(start(FlowKind::Cleanup, &a, &spec, None)).unwrap();
                j.finish(f, FlowState::Failed, Some(&format!("busy {n}")))
                    .unwrap();
            }
            let history = j.sandbox_history(&a).unwrap();
            assert_eq!(history.len(), 2, "{history:?}");
            assert_eq!(history[0].kind, FlowKind::Create);
            assert_eq!(history[0].attempts, 1);
            assert_eq!(history[1].attempts, 5);
            assert_eq!(history[1].error.as_deref(), Some("busy 5"));
            // Still open for recovery: one open flow, not five.
            assert_eq!(j.open_flows().unwrap().len(), 1);
            // A success takes the failures' place too, with their count.
            let f = j.begin(start(FlowKind::Cleanup, &a, &spec, None)).unwrap();
            j.finish(f, FlowState::Succeeded, None).unwrap();
            let history = j.sandbox_history(&a).unwrap();
            assert_eq!(history.len(), 2);
            assert_eq!(
                (history[1].state, history[1].attempts),
                (FlowState::Succeeded, 6)
            );
            // After a success a new cleanup is a record of its own, and so
            // is one after a different flow.
            let f = j.begin(start(FlowKind::Cleanup, &a, &spec, None)).unwrap();
            j.finish(f, FlowState::Failed, Some("x")).unwrap();
            let d = j.begin(start(FlowKind::Destroy, &a, &spec, None)).unwrap();
            j.finish(d, FlowState::Succeeded, None).unwrap();
            let f = j.begin(start(FlowKind::Cleanup, &a, &spec, None)).unwrap();
            j.finish(f, FlowState::Failed, Some("y")).unwrap();
            let kinds: Vec<_> = j
                .sandbox_history(&a)
                .unwrap()
                .iter()
                .map(|r| (r.kind, r.attempts))
                .collect();
            assert_eq!(
                kinds,
                [
                    (FlowKind::Create, 1),
                    (FlowKind::Cleanup, 6),
                    (FlowKind::Cleanup, 1),
                    (FlowKind::Destroy, 1),
                    (FlowKind::Cleanup, 1),
                ]
            );
        }
    }

    #[test]
    fn records_written_before_attempts_existed_read_as_one() {
        let mut v = serde_json::to_value(FlowRecord {
            id: 1,
            kind: FlowKind::Cleanup,
            sandbox_id: sid("sba"),
            spec: SandboxSpec::default(),
            compensates: None,
            started_at: UNIX_EPOCH,
            finished_at: None,
            state: FlowState::Running,
            error: None,
            steps: Vec::new(),
            attempts: 3,
        })
        .unwrap();
        v.as_object_mut().unwrap().remove("attempts");
        let old: FlowRecord = serde_json::from_value(v).unwrap();
        assert_eq!(old.attempts, 1);
    }

    #[test]
    fn step_history_is_recorded_in_order() {
        let (_dir, store) = open_tmp();
        let a = sid("sba");
        let spec = SandboxSpec::default();
        let id = store
            .begin(start(FlowKind::Create, &a, &spec, None))
            .unwrap();
        store
            .step(id, "storage", StepEvent::Started { stage: 0 })
            .unwrap();
        store
            .step(id, "network", StepEvent::Started { stage: 0 })
            .unwrap();
        store
            .step(
                id,
                "network",
                StepEvent::Finished {
                    duration: Duration::from_millis(5),
                    error: Some("x"),
                },
            )
            .unwrap();
        let rec = store.sandbox_history(&a).unwrap().remove(0);
        let names: Vec<_> = rec.steps.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(names, ["storage", "network"]);
        assert_eq!(rec.steps[0].duration, None);
        assert_eq!(rec.steps[1].duration, Some(Duration::from_millis(5)));
        assert_eq!(rec.steps[1].error.as_deref(), Some("x"));
        assert_eq!(rec.state, FlowState::Running);
    }

    #[test]
    fn ids_are_never_reused_after_forget_or_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let a = sid("sba");
        let spec = SandboxSpec::default();
        let last = {
            let store = Store::open(&path).unwrap();
            let f1 = store
                .begin(start(FlowKind::Create, &a, &spec, None))
                .unwrap();
            let f2 = store
                .begin(start(FlowKind::Destroy, &a, &spec, Some(f1)))
                .unwrap();
            assert_eq!((f1, f2), (1, 2));
            assert_eq!(store.forget(&a).unwrap(), 2);
            let f3 = store
                .begin(start(FlowKind::Create, &a, &spec, None))
                .unwrap();
            assert_eq!(f3, 3, "forgotten ids are not handed out again");
            f3
        };
        let store = Store::open(&path).unwrap();
        let next = store
            .begin(start(FlowKind::Create, &a, &spec, None))
            .unwrap();
        assert_eq!(next, last + 1);
    }

    #[test]
    fn reopen_keeps_flows_and_steps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let a = sid("sba");
        let spec = SandboxSpec {
            name: "p".into(),
            ..Default::default()
        };
        let before = {
            let store = Store::open(&path).unwrap();
            let f1 = store
                .begin(start(FlowKind::Create, &a, &spec, None))
                .unwrap();
            store
                .step(f1, "storage", StepEvent::Started { stage: 0 })
                .unwrap();
            store.finish(f1, FlowState::Failed, Some("e")).unwrap();
            let f2 = store
                .begin(start(FlowKind::Destroy, &a, &spec, Some(f1)))
                .unwrap();
            store.finish(f2, FlowState::Succeeded, None).unwrap();
            store.list_flows().unwrap()
        };
        let store = Store::open(&path).unwrap();
        assert_eq!(store.list_flows().unwrap(), before);
        let open = store.open_flows().unwrap();
        assert_eq!(open.len(), 1);
        assert_eq!(open[0].state, FlowState::Failed);
        assert_eq!(open[0].steps.len(), 1);
        assert_eq!(open[0].spec, spec);
    }

    #[test]
    fn journal_errors_keep_the_store_error_as_source() {
        let (_dir, store) = open_tmp();
        let err = store.finish(42, FlowState::Succeeded, None).unwrap_err();
        assert_eq!(err.op, "finish");
        let inner = err.source.downcast_ref::<StoreError>().unwrap();
        assert!(matches!(inner, StoreError::FlowNotFound(42)), "{inner}");
    }

    /// Not a timing assertion: prints what the journal writes of a create
    /// flow of two stages (storage and network, then sandbox) cost, written
    /// one event at a time (as the engine used to) and batched per stage.
    #[test]
    fn per_event_and_per_stage_flow_cost_is_printed() {
        use std::time::Instant;
        let (_dir, store) = open_tmp();
        let a = sid("sba");
        let spec = SandboxSpec::default();
        let n = 50;
        let done = StepEvent::Finished {
            duration: Duration::from_millis(1),
            error: None,
        };
        let entry = |step, event| StepEntry { step, event };
        let (mut per_event, mut per_stage) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let t = Instant::now();
            let id = store
                .begin(start(FlowKind::Create, &a, &spec, None))
                .unwrap();
            for (step, stage) in [("storage", 0), ("network", 0), ("sandbox", 1)] {
                store.step(id, step, StepEvent::Started { stage }).unwrap();
                store.step(id, step, done).unwrap();
            }
            store.finish(id, FlowState::Succeeded, None).unwrap();
            per_event.push(t.elapsed());

            let t = Instant::now();
            let started = |stage| StepEvent::Started { stage };
            let id = store
                .begin_stage(
                    start(FlowKind::Create, &a, &spec, None),
                    &[entry("storage", started(0)), entry("network", started(0))],
                )
                .unwrap();
            store
                .record(
                    id,
                    &[
                        entry("storage", done),
                        entry("network", done),
                        entry("sandbox", started(1)),
                    ],
                    None,
                )
                .unwrap();
            let settle = Settle {
                state: FlowState::Succeeded,
                error: None,
                durable: true,
            };
            store
                .record(id, &[entry("sandbox", done)], Some(settle))
                .unwrap();
            per_stage.push(t.elapsed());
        }
        for (name, mut v) in [
            ("per event (8 transactions)", per_event),
            ("per stage (3 transactions)", per_stage),
        ] {
            v.sort();
            println!(
                "journal of a 2-stage create, {name}, over {n} flows: p50 {:?}, p90 {:?}",
                v[n / 2],
                v[n * 9 / 10]
            );
        }
    }

    /// Not a timing assertion: prints what a durable begin+finish costs on
    /// this disk, and what a non-durable step costs, for the record.
    #[test]
    fn durable_begin_finish_cost_is_printed() {
        use std::time::Instant;
        let (_dir, store) = open_tmp();
        let a = sid("sba");
        let spec = SandboxSpec::default();
        let n = 100;
        let (mut begin, mut step, mut finish) = (Vec::new(), Vec::new(), Vec::new());
        let mut last = 0;
        for _ in 0..n {
            let t = Instant::now();
            let id = store
                .begin(start(FlowKind::Create, &a, &spec, None))
                .unwrap();
            begin.push(t.elapsed());
            let t = Instant::now();
            store
                .step(id, "storage", StepEvent::Started { stage: 0 })
                .unwrap();
            step.push(t.elapsed());
            let t = Instant::now();
            store.finish(id, FlowState::Succeeded, None).unwrap();
            finish.push(t.elapsed());
            assert!(id > last);
            last = id;
        }
        let total: Vec<Duration> = (0..n).map(|i| begin[i] + step[i] + finish[i]).collect();
        for (name, mut v) in [
            ("begin", begin),
            ("step", step),
            ("finish", finish),
            ("begin+step+finish", total),
        ] {
            v.sort();
            println!(
                "journal {name} over {n} flows: p50 {:?}, p90 {:?}, max {:?}",
                v[n / 2],
                v[n * 9 / 10],
                v[n - 1]
            );
        }
    }
}
