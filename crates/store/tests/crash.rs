//! Crash safety: a child process writes sandboxes, leases and journal flows in
//! a loop and is killed with SIGKILL at an arbitrary point; the parent then
//! reopens the store and checks that everything the child had reported as
//! committed is there, that every record decodes, that flow ids only grow,
//! and that new writes work. Repeated a few times on the same file. Every
//! other flow is written as the engine writes it (`begin_stage`, buffered
//! `record`, settling `record`: durable, or buffered and followed by the
//! durable `Ready` write as the pod service has it), the rest one record at
//! a time.
//!
//! The child is this same test binary, re-executed with `--exact` and an
//! environment variable; it reports each commit on stdout *after* the call
//! returned, so a reported write must survive the kill.

// Test code: a failed unwrap is a failed test, with the error printed.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, SystemTime};

use cubelet_engine::{
    FlowId, FlowKind, FlowStart, FlowState, Journal, SandboxId, SandboxSpec, Settle, StepEntry,
    StepEvent,
};
use cubelet_store::{ContainerRecord, IpLease, SandboxRecord, SandboxState, ShellRecord, Store};

const TEST_NAME: &str = "kill9_mid_write_leaves_a_consistent_store";
const CHILD_ENV: &str = "CUBELET_STORE_TEST_CHILD";
const PATH_ENV: &str = "CUBELET_STORE_TEST_PATH";
const ROUND_ENV: &str = "CUBELET_STORE_TEST_ROUND";
const ROUNDS: u32 = 4;
/// Hang guard only (the child normally reports many lines per second).
const NO_PROGRESS_LIMIT: Duration = Duration::from_secs(120);
const POOL: &str = "test-pool";

#[test]
fn kill9_mid_write_leaves_a_consistent_store() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
    } else {
        parent();
    }
}

fn sid(s: &str) -> SandboxId {
    SandboxId::parse(s).unwrap()
}

fn spec_for(id: &str) -> SandboxSpec {
    SandboxSpec {
        name: format!("pod-{id}"),
        namespace: "test".into(),
        uid: format!("uid-{id}"),
        ..Default::default()
    }
}

fn lease_ip(round: u32, i: u32) -> std::net::IpAddr {
    std::net::Ipv4Addr::new(10, round as u8, (i / 256) as u8, (i % 256) as u8).into()
}

/// The writer. Prints one line per committed operation, after it returned.
fn child() {
    let path = std::env::var_os(PATH_ENV).expect("parent sets the store path");
    let round: u32 = std::env::var(ROUND_ENV).unwrap().parse().unwrap();
    let store = Store::open(Path::new(&path)).unwrap();
    println!("OPENED");
    // Bounded, so a parent that failed to kill us cannot leave us running for ever.
    for i in 0..20_000u32 {
        let id = format!("r{round}-{i}");
        let sb = sid(&id);
        let spec = spec_for(&id);

        let batched = i % 2 == 1;
        let rec = SandboxRecord::new(sb.clone(), spec.clone());
        if batched {
            // As the pod service records a new sandbox: buffered, made
            // durable by the flow's first journal write right after.
            store.put_sandbox_buffered(&rec).unwrap();
        } else {
            store.put_sandbox(&rec).unwrap();
            println!("SANDBOX {id}");
        }

        let start = create_start(&sb, &spec, true);
        let started = StepEntry {
            step: "storage",
            event: StepEvent::Started { stage: 0 },
        };
        let finished = StepEntry {
            step: "storage",
            event: StepEvent::Finished {
                duration: Duration::from_millis(1),
                error: None,
            },
        };
        let fid = if batched {
            let fid = store.begin_stage(start, &[started]).unwrap();
            println!("SANDBOX {id}");
            println!("BEGUN {fid} {id} batched");
            fid
        } else {
            let fid = store.begin(start).unwrap();
            println!("BEGUN {fid} {id}");
            store.step(fid, started.step, started.event).unwrap();
            fid
        };
        store
            .add_lease(&IpLease {
                ip: lease_ip(round, i),
                sandbox_id: sb.clone(),
                pool: POOL.into(),
                allocated_at: SystemTime::now(),
            })
            .unwrap();
        println!("LEASED {} {id}", lease_ip(round, i));
        if batched {
            store.record(fid, &[finished], None).unwrap();
        } else {
            store.step(fid, finished.step, finished.event).unwrap();
        }
        store
            .put_container(&ContainerRecord::new(
                format!("c-{id}"),
                sb.clone(),
                "app",
                0,
                "busybox",
            ))
            .unwrap();

        if i % 3 != 2 {
            // Every other batched flow is settled as the pod service settles
            // a create: buffered, made durable by the `Ready` write after it,
            // so it is reported only once that write returned.
            let durable = !(batched && i % 4 == 1);
            if batched {
                let settle = Settle {
                    state: FlowState::Succeeded,
                    error: None,
                    durable,
                };
                store.record(fid, &[], Some(settle)).unwrap();
            } else {
                store.finish(fid, FlowState::Succeeded, None).unwrap();
            }
            if durable {
                println!("FINISHED {fid}");
            }
            store
                .update_sandbox(&sb, |r| r.state = SandboxState::Ready)
                .unwrap();
            if !durable {
                println!("FINISHED {fid}");
            }
        }
        if i % 5 == 4 {
            // Announced before acting: a kill in the middle leaves either.
            println!("FORGETTING {id}");
            store.delete_container(&format!("c-{id}")).unwrap();
            store.release_leases_of(&sb).unwrap();
            store.delete_sandbox(&sb).unwrap();
            store.forget(&sb).unwrap();
        }
    }
}

/// Kills the child if the test fails before it does.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Default)]
struct Reported {
    sandboxes: BTreeSet<String>,
    begun: BTreeMap<u64, String>,
    batched: BTreeSet<u64>,
    finished: BTreeSet<u64>,
    leases: BTreeMap<String, String>,
    forgotten: BTreeSet<String>,
}

fn parent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node").join("cubelet.redb");
    let exe = std::env::current_exe().unwrap();
    let mut seen = Reported::default();
    let mut max_id = 0u64;

    for round in 0..ROUNDS {
        let kill_after = 3 + round as usize * 17;
        let mut child = KillOnDrop(
            Command::new(&exe)
                .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, "1")
                .env(PATH_ENV, &path)
                .env(ROUND_ENV, round.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
        let stdout = child.0.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });

        // Read until enough flows have begun, kill, then drain what the child
        // had written before it died.
        let mut begun_this_round = Vec::new();
        let mut killed = false;
        loop {
            let line = match rx.recv_timeout(NO_PROGRESS_LIMIT) {
                Ok(line) => line,
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("round {round}: child made no progress"),
            };
            record(&line, &mut seen, &mut begun_this_round);
            if !killed && begun_this_round.len() >= kill_after {
                child.0.kill().unwrap();
                killed = true;
            }
        }
        reader.join().unwrap();
        let status = child.0.wait().unwrap();
        assert!(killed, "round {round}: child exited on its own: {status}");
        assert_eq!(status.signal(), Some(9), "round {round}: {status}");

        // Ids of this round grow in the order they were handed out, and are
        // above every id seen before (including the parent's own writes).
        for id in &begun_this_round {
            assert!(
                *id > max_id,
                "round {round}: flow id {id} not above {max_id}"
            );
            max_id = *id;
        }

        let store = Store::open(&path).unwrap();
        check(&store, &seen, round);

        // New writes work and continue the id sequence.
        let id = format!("p{round}");
        let sb = sid(&id);
        let spec = spec_for(&id);
        store
            .put_sandbox(&SandboxRecord::new(sb.clone(), spec.clone()))
            .unwrap();
        let fid = store.begin(create_start(&sb, &spec, true)).unwrap();
        let newest = store
            .list_flows()
            .unwrap()
            .iter()
            .map(|f| f.id)
            .max()
            .unwrap();
        assert_eq!(fid, newest);
        assert!(
            fid > max_id,
            "round {round}: new flow id {fid} not above {max_id}"
        );
        max_id = fid;
        store.finish(fid, FlowState::Succeeded, None).unwrap();
        seen.sandboxes.insert(id.clone());
        seen.begun.insert(fid, id);
        seen.finished.insert(fid);
        println!(
            "round {round}: killed after {} begun flows; store holds {:?}",
            begun_this_round.len(),
            store.verify().unwrap()
        );
        drop(store);
    }
}

fn record(line: &str, seen: &mut Reported, begun_this_round: &mut Vec<u64>) {
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next(), parts.next()) {
        (Some("SANDBOX"), Some(id), None) => {
            seen.sandboxes.insert(id.to_owned());
        }
        (Some("BEGUN"), Some(fid), Some(id)) => {
            let fid: u64 = fid.parse().unwrap();
            seen.begun.insert(fid, id.to_owned());
            if parts.next() == Some("batched") {
                seen.batched.insert(fid);
            }
            begun_this_round.push(fid);
        }
        (Some("FINISHED"), Some(fid), None) => {
            seen.finished.insert(fid.parse().unwrap());
        }
        (Some("LEASED"), Some(ip), Some(id)) => {
            seen.leases.insert(ip.to_owned(), id.to_owned());
        }
        (Some("FORGETTING"), Some(id), None) => {
            seen.forgotten.insert(id.to_owned());
        }
        // libtest's own lines, OPENED.
        _ => {}
    }
}

fn check(store: &Store, seen: &Reported, round: u32) {
    // Every record of every table decodes.
    store.verify().unwrap();

    let flows: BTreeMap<u64, _> = store
        .list_flows()
        .unwrap()
        .into_iter()
        .map(|f| (f.id, f))
        .collect();
    for (fid, id) in &seen.begun {
        if seen.forgotten.contains(id) {
            continue;
        }
        let flow = flows
            .get(fid)
            .unwrap_or_else(|| panic!("round {round}: begun flow {fid} of {id} lost"));
        assert_eq!(flow.sandbox_id.as_str(), id);
        assert_eq!(flow.spec, spec_for(id));
        // The first write of a batched flow carries its first step; a
        // settled flow also keeps the buffered events written before it.
        if seen.batched.contains(fid) {
            assert_eq!(flow.steps.first().map(|s| s.step.as_str()), Some("storage"));
        }
        if seen.finished.contains(fid) {
            assert_eq!(
                flow.state,
                FlowState::Succeeded,
                "round {round}: flow {fid}"
            );
            assert!(flow.finished_at.is_some());
            // The parent's own flows (`p<round>`) have no steps.
            if !id.starts_with('p') {
                assert_eq!(flow.steps.len(), 1, "round {round}: flow {fid}");
                assert_eq!(flow.steps[0].duration, Some(Duration::from_millis(1)));
            }
        } else {
            // Killed before or after its finish committed: either is fine.
            assert!(
                matches!(flow.state, FlowState::Running | FlowState::Succeeded),
                "round {round}: flow {fid} is {:?}",
                flow.state
            );
        }
    }
    // A sandbox the store has as ready never comes with an open flow: the
    // `Ready` write is durable and makes a buffered settling write before
    // it durable too.
    for rec in store.list_sandboxes().unwrap() {
        if rec.state == SandboxState::Ready {
            for flow in flows.values().filter(|f| f.sandbox_id == rec.id) {
                assert_eq!(
                    flow.state,
                    FlowState::Succeeded,
                    "round {round}: ready sandbox {} has flow {} {:?}",
                    rec.id,
                    flow.id,
                    flow.state
                );
            }
        }
    }
    // Open flows are exactly the unfinished ones, and every one is recoverable.
    for flow in store.open_flows().unwrap() {
        assert!(
            !seen.finished.contains(&flow.id),
            "round {round}: finished flow {} open",
            flow.id
        );
        assert_eq!(flow.state, FlowState::Running);
    }

    for id in &seen.sandboxes {
        if seen.forgotten.contains(id) {
            continue;
        }
        let rec = store
            .get_sandbox(&sid(id))
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: sandbox {id} lost"));
        assert_eq!(rec.spec, spec_for(id));
        // Found through the indexes as well.
        let s = spec_for(id);
        let by_pod = store
            .find_sandbox_by_pod(&s.namespace, &s.name, &s.uid, s.attempt)
            .unwrap();
        assert_eq!(by_pod.as_ref(), Some(&rec), "round {round}: sandbox {id}");
        let history = store.sandbox_history(&sid(id)).unwrap();
        assert!(
            history.iter().all(|f| f.sandbox_id.as_str() == id),
            "round {round}: history of {id}"
        );
    }
    // Every container is found under its sandbox.
    for c in store.list_containers().unwrap() {
        let of = store.list_containers_of(&c.sandbox_id).unwrap();
        assert!(of.contains(&c), "round {round}: container {}", c.id);
    }
    let leases: BTreeMap<String, IpLease> = store
        .list_leases(POOL)
        .unwrap()
        .into_iter()
        .map(|l| (l.ip.to_string(), l))
        .collect();
    for (ip, id) in &seen.leases {
        if seen.forgotten.contains(id) {
            continue;
        }
        let lease = leases
            .get(ip)
            .unwrap_or_else(|| panic!("round {round}: lease {ip} lost"));
        assert_eq!(lease.sandbox_id.as_str(), id);
    }
    // Every container points at a sandbox that exists or is being forgotten.
    for c in store.list_containers().unwrap() {
        let id = c.sandbox_id.as_str();
        assert!(
            store.get_sandbox(&c.sandbox_id).unwrap().is_some() || seen.forgotten.contains(id),
            "round {round}: container {} of missing sandbox {id}",
            c.id
        );
    }
}

const SETTLE_TEST: &str = "a_buffered_settle_survives_a_kill_only_behind_a_durable_write";
const SETTLE_CHILD_ENV: &str = "CUBELET_STORE_TEST_SETTLE_CHILD";

/// What RunPodSandbox's journal relies on, with a kill -9 at a known point:
/// a create settled by a buffered write is open again after a crash that
/// comes before the next durable commit (recovery undoes it), and settled
/// for good once the durable `Ready` write that follows has returned.
#[test]
fn a_buffered_settle_survives_a_kill_only_behind_a_durable_write() {
    killed_before_and_after_ready(
        SETTLE_TEST,
        SETTLE_CHILD_ENV,
        settle_child,
        |store, ready| {
            let flows = store.list_flows().unwrap();
            let sandbox = store.get_sandbox(&sid("s1")).unwrap().unwrap();
            assert_eq!(flows.len(), 1, "{flows:?}");
            if ready {
                assert_eq!(flows[0].state, FlowState::Succeeded);
                assert_eq!(sandbox.state, SandboxState::Ready);
            } else {
                assert_eq!(flows[0].state, FlowState::Running, "the settle was lost");
                assert_ne!(sandbox.state, SandboxState::Ready);
                assert_eq!(store.open_flows().unwrap().len(), 1, "recovery sees it");
            }
        },
    );
}

/// A test with a kill -9 at a known point, before and after the durable
/// `Ready` write: as the child (`env` set), runs `child` with whether it is
/// to write `Ready`; as the parent, runs the child both ways, kills it once
/// it has written and calls `check` with its store, reopened, and whether
/// `Ready` was written.
fn killed_before_and_after_ready(
    test: &str,
    env: &str,
    child: fn(bool),
    check: impl Fn(&Store, bool),
) {
    if let Some(mode) = std::env::var_os(env) {
        child(mode == "ready");
        return;
    }
    for ready in [false, true] {
        let mode = if ready { "ready" } else { "before-ready" };
        let (_dir, path) = killed_after_writes(test, env, mode);
        check(&Store::open(&path).unwrap(), ready);
    }
}

/// Runs this binary's test `test` as a child with `env` set to `mode`,
/// waits until it says its records are written, kills it with SIGKILL and
/// returns its store's directory and path.
fn killed_after_writes(test: &str, env: &str, mode: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cubelet.redb");
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env, mode)
            .env(PATH_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let stdout = BufReader::new(child.0.stdout.take().unwrap());
    // libtest's "test <name> ... " may stand before it on its line.
    let done = stdout
        .lines()
        .map_while(Result::ok)
        .any(|l| l.ends_with("WRITTEN"));
    assert!(done, "the child wrote its records ({mode})");
    child.0.kill().unwrap();
    let status = child.0.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status}");
    (dir, path)
}

/// The child of [`a_buffered_settle_survives_a_kill_only_behind_a_durable_write`]:
/// records a sandbox and its create as the pod service does, settles the
/// flow with a buffered write, writes the durable `Ready` record if
/// `ready`, says so and waits to be killed.
fn settle_child(ready: bool) {
    let (store, sb, spec) = child_store();
    store
        .put_sandbox_buffered(&SandboxRecord::new(sb.clone(), spec.clone()))
        .unwrap();
    let start = create_start(&sb, &spec, true);
    let fid = store.begin_stage(start, &[]).unwrap();
    settled_then_written(&store, fid, &sb, ready);
}

const CLAIM_TEST: &str = "a_claimed_create_started_buffered_is_lost_with_its_claim_before_ready";
const CLAIM_CHILD_ENV: &str = "CUBELET_STORE_TEST_CLAIM_CHILD";

/// What a claimed `create` confined to its shell relies on (the engine's
/// buffered first write), with a kill -9 at a known point: the claim, the
/// flow's start and its step events, all buffered, are lost together by a
/// crash before the durable `Ready` write, which leaves the shell's record
/// as it was (the restart destroys the shell whole) and no sandbox and no
/// flow; after the `Ready` write the sandbox, its settled flow and no shell
/// are there.
#[test]
fn a_claimed_create_started_buffered_is_lost_with_its_claim_before_ready() {
    killed_before_and_after_ready(CLAIM_TEST, CLAIM_CHILD_ENV, claim_child, |store, ready| {
        let shells: Vec<SandboxId> = store
            .list_shells()
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        let flows = store.list_flows().unwrap();
        let sandbox = store.get_sandbox(&sid("s1")).unwrap();
        if ready {
            assert!(shells.is_empty(), "{shells:?}");
            assert_eq!(sandbox.unwrap().state, SandboxState::Ready);
            assert_eq!(flows.len(), 1, "{flows:?}");
            assert_eq!(flows[0].state, FlowState::Succeeded);
        } else {
            assert_eq!(shells, vec![sid("s1")], "the shell's record is back");
            assert!(sandbox.is_none(), "the claim was lost: {sandbox:?}");
            assert!(flows.is_empty(), "the start was lost: {flows:?}");
            assert!(store.open_flows().unwrap().is_empty());
        }
    });
}

/// The child of [`a_claimed_create_started_buffered_is_lost_with_its_claim_before_ready`]:
/// records a shell durably, then claims it and runs its create as the pod
/// service and the engine do for a pod confined to the shell (claim,
/// start, the stage between, the settle: all buffered), writes the durable
/// `Ready` record if `ready`, says so and waits to be killed.
fn claim_child(ready: bool) {
    let (store, sb, spec) = child_store();
    store.put_shell(&ShellRecord::new(sb.clone())).unwrap();
    store
        .claim_shell(&SandboxRecord::new(sb.clone(), spec.clone()))
        .unwrap();
    let start = create_start(&sb, &spec, false);
    let started = [StepEntry {
        step: "storage",
        event: StepEvent::Started { stage: 0 },
    }];
    let fid = store.begin_stage(start, &started).unwrap();
    let finished = [StepEntry {
        step: "storage",
        event: StepEvent::Finished {
            duration: Duration::from_millis(1),
            error: None,
        },
    }];
    store.record(fid, &finished, None).unwrap();
    settled_then_written(&store, fid, &sb, ready);
}

/// A child's store (at the parent's path), sandbox id and spec.
fn child_store() -> (Store, SandboxId, SandboxSpec) {
    let path = std::env::var_os(PATH_ENV).expect("parent sets the store path");
    let store = Store::open(Path::new(&path)).unwrap();
    (store, sid("s1"), spec_for("s1"))
}

/// A child's last writes: flow `fid` settled as succeeded, buffered (as
/// the engine settles a create whose caller commits), then the durable
/// `Ready` record of `sb` if `ready`; then it says so and waits to be
/// killed.
fn settled_then_written(store: &Store, fid: FlowId, sb: &SandboxId, ready: bool) {
    let settle = Settle {
        state: FlowState::Succeeded,
        error: None,
        durable: false,
    };
    store.record(fid, &[], Some(settle)).unwrap();
    if ready {
        store
            .update_sandbox(sb, |r| r.state = SandboxState::Ready)
            .unwrap();
    }
    println!("WRITTEN");
    std::thread::sleep(Duration::from_secs(60));
}

/// The start of a `create` flow of `sb`, durable or buffered.
fn create_start<'a>(sb: &'a SandboxId, spec: &'a SandboxSpec, durable: bool) -> FlowStart<'a> {
    FlowStart {
        kind: FlowKind::Create,
        sandbox_id: sb,
        spec,
        compensates: None,
        durable,
    }
}
