//! Black-box tests of the pinned pod namespaces (sandboxes without an infra
//! process): pin, join, unpin, GC. They need root. Each runs on a thread of
//! its own that has unshared a mount namespace (with `/` made private), so
//! the pins they make never reach the host's mount table; the IPC and UTS
//! namespaces they pin are new ones, so the host's are never touched.

#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashSet;
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use cubelet_engine::spec::SandboxProcess;
use cubelet_engine::SandboxId;
use cubelet_runtime::sandbox::podns::{is_pinned, pins_alive, PinRequest, PodNamespaces};

/// Runs `body` with a pin directory in a private mount namespace, on a
/// current-thread runtime. Prints a note and passes when not root.
fn isolated<F, Fut>(body: F)
where
    F: FnOnce(PodNamespaces) -> Fut + Send + 'static,
    Fut: Future<Output = Result<()>>,
{
    if !cubelet_testkit::is_root("this test (pinned namespaces)") {
        return;
    }
    let res = std::thread::spawn(move || -> Result<()> {
        cubelet_testkit::enter_private(cubelet_testkit::Namespaces::Mount)
            .context("enter a private mount namespace")?;
        let tmp = tempfile::Builder::new()
            .prefix("cubelet-podns-test")
            .tempdir()?;
        let pods = PodNamespaces::new(tmp.path().join("podns"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Everything mounted under tmp dies with this mount namespace.
        rt.block_on(body(pods))
    })
    .join();
    match res {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("test failed: {e:?}"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn run(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| args.join(" "))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ino(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

/// nsfs mounts under `dir` in this thread's mount namespace.
fn ns_mounts(dir: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
    let dir = dir.to_string_lossy();
    info.lines()
        .filter(|l| l.contains(" nsfs ") && l.contains(dir.as_ref()))
        .count()
}

fn sid(n: u32) -> SandboxId {
    SandboxId::parse(&format!("{n:064x}")).unwrap()
}

fn process(pins: &cubelet_runtime::sandbox::podns::Pins) -> SandboxProcess {
    SandboxProcess {
        pid: None,
        runtime_handler: "runc".into(),
        ipc_path: pins.ipc.clone(),
        uts_path: pins.uts.clone(),
        pins_dir: Some(pins.dir.clone()),
    }
}

#[test]
fn pins_hold_new_ipc_and_uts_namespaces_with_the_hostname() {
    isolated(|pods| async move {
        pods.prepare()?;
        pods.prepare()?;
        let id = sid(1);
        let req = PinRequest {
            ipc: true,
            hostname: Some("web-0".into()),
        };
        let pins = pods.create(&id, &req).await?;
        let (ipc, uts) = (pins.ipc.clone().unwrap(), pins.uts.clone().unwrap());
        assert_eq!(pins.dir, pods.sandbox_dir(&id));
        assert_eq!(ipc, pods.sandbox_dir(&id).join("ipc"));
        assert!(is_pinned(&ipc) && is_pinned(&uts));
        assert!(pins_alive(&process(&pins)));
        // New namespaces, not the caller's (the maker thread left them).
        assert_ne!(ino(&ipc), ino(Path::new("/proc/thread-self/ns/ipc")));
        assert_ne!(ino(&uts), ino(Path::new("/proc/thread-self/ns/uts")));
        // The hostname is set inside, the node's is not changed.
        let nsuts = format!("--uts={}", uts.display());
        assert_eq!(run(&["nsenter", &nsuts, "hostname"])?.trim(), "web-0");
        assert_ne!(run(&["hostname"])?.trim(), "web-0");
        // A SysV segment made by one process in the IPC namespace is seen
        // by another there, and not by the node.
        let nsipc = format!("--ipc={}", ipc.display());
        let made = run(&["nsenter", &nsipc, "ipcmk", "-M", "4096"])?;
        let shm_id = made
            .split_whitespace()
            .last()
            .context("ipcmk printed no id")?
            .to_owned();
        let seen = run(&["nsenter", &nsipc, "ipcs", "-m"])?;
        assert!(seen.contains(&format!(" {shm_id} ")), "{seen}");
        let node = run(&["ipcs", "-m", "-i", &shm_id]);
        assert!(
            node.map_or(true, |o| !o.contains("4096")),
            "the node sees the pod's segment"
        );

        // Creating again keeps the same namespaces.
        let again = pods.create(&id, &req).await?;
        assert_eq!(again, pins);
        assert_eq!(ino(&ipc), ino(again.ipc.as_deref().unwrap()));

        assert!(pods.remove(&id).await?);
        assert!(!pods.sandbox_dir(&id).exists());
        assert_eq!(ns_mounts(pods.dir()), 0);
        assert!(!pins_alive(&process(&pins)));
        assert!(!pods.remove(&id).await?, "removing twice is fine");
        Ok(())
    });
}

#[test]
fn claimed_shells_get_their_hostnames_from_one_thread_that_stays_home() {
    isolated(|pods| async move {
        pods.prepare()?;
        // Two shells, made before their pods were known.
        let shell = PinRequest {
            ipc: true,
            hostname: Some("shell".into()),
        };
        let (a, b) = (sid(11), sid(12));
        let pins_a = pods.create(&a, &shell).await?;
        let pins_b = pods.create(&b, &shell).await?;
        let node = run(&["hostname"])?;
        // The UTS namespace of every thread named `cubelet-uts` (only this
        // test sets hostnames, so only it starts one).
        let workers = || -> Vec<u64> {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .map(|t| t.unwrap().path())
                .filter(|t| {
                    std::fs::read_to_string(t.join("comm"))
                        .unwrap_or_default()
                        .trim()
                        == "cubelet-uts"
                })
                .map(|t| ino(&t.join("ns/uts")))
                .collect()
        };
        for (id, name) in [(&a, "web-0"), (&b, "web-1"), (&a, "web-0b")] {
            pods.set_hostname(id, name).await?;
        }
        let uts = |pins: &cubelet_runtime::sandbox::podns::Pins| {
            format!("--uts={}", pins.uts.as_ref().unwrap().display())
        };
        assert_eq!(
            run(&["nsenter", &uts(&pins_a), "hostname"])?.trim(),
            "web-0b"
        );
        assert_eq!(
            run(&["nsenter", &uts(&pins_b), "hostname"])?.trim(),
            "web-1"
        );
        // The node's name is untouched, and the three claims shared one
        // thread, which is back in its own UTS namespace.
        assert_eq!(run(&["hostname"])?, node);
        let home = ino(Path::new("/proc/thread-self/ns/uts"));
        assert_eq!(workers(), [home]);
        // A pin that is gone is an error naming it; the thread carries on.
        let gone = sid(13);
        let err = pods.set_hostname(&gone, "x").await.unwrap_err().to_string();
        assert!(err.contains(&gone.to_string()), "{err}");
        pods.set_hostname(&b, "web-1b").await?;
        assert_eq!(
            run(&["nsenter", &uts(&pins_b), "hostname"])?.trim(),
            "web-1b"
        );
        for id in [&a, &b] {
            assert!(pods.remove(id).await?);
        }
        assert_eq!(ns_mounts(pods.dir()), 0);
        Ok(())
    });
}

#[test]
fn a_pod_sharing_the_nodes_namespaces_has_a_directory_and_no_pins() {
    isolated(|pods| async move {
        pods.prepare()?;
        let id = sid(2);
        let pins = pods.create(&id, &PinRequest::default()).await?;
        assert_eq!((pins.ipc.clone(), pins.uts.clone()), (None, None));
        assert!(pins.dir.is_dir());
        assert!(pins_alive(&process(&pins)), "alive while its directory is");
        assert_eq!(ns_mounts(pods.dir()), 0);
        // IPC only (host network: the node's UTS namespace).
        let ipc_only = pods
            .create(
                &sid(3),
                &PinRequest {
                    ipc: true,
                    hostname: None,
                },
            )
            .await?;
        assert!(ipc_only.ipc.as_deref().is_some_and(is_pinned));
        assert_eq!(ipc_only.uts, None);
        assert!(pods.remove(&id).await?);
        assert!(!pins_alive(&process(&pins)));
        assert!(pods.remove(&sid(3)).await?);
        assert_eq!(ns_mounts(pods.dir()), 0);
        Ok(())
    });
}

#[test]
fn a_failed_create_leaves_nothing() {
    isolated(|pods| async move {
        pods.prepare()?;
        let id = sid(4);
        // No valid hostname is this long: sethostname fails after unshare.
        let bad = PinRequest {
            ipc: true,
            hostname: Some("h".repeat(100)),
        };
        let e = pods.create(&id, &bad).await.unwrap_err();
        assert!(e.to_string().contains("hostname"), "{e}");
        assert!(!pods.sandbox_dir(&id).exists());
        assert_eq!(ns_mounts(pods.dir()), 0);
        Ok(())
    });
}

#[test]
fn a_removal_waits_for_a_creation_whose_caller_gave_up() {
    isolated(|pods| async move {
        pods.prepare()?;
        let req = PinRequest {
            ipc: true,
            hostname: Some("h".into()),
        };
        for n in 20..40 {
            let id = sid(n);
            // The create is dropped as soon as it has to wait for its thread
            // (as a flow cut short or cancelled would drop it); the rollback
            // that follows must not leave what that thread makes afterwards.
            tokio::select! {
                biased;
                _ = tokio::task::yield_now() => {}
                _ = pods.create(&id, &req) => {}
            }
            pods.remove(&id).await?;
            assert!(!pods.sandbox_dir(&id).exists(), "pins of {n} left");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(std::fs::read_dir(pods.dir())?.count(), 0);
        assert_eq!(ns_mounts(pods.dir()), 0);
        Ok(())
    });
}

#[test]
fn the_gc_removes_pins_of_unknown_sandboxes_only() {
    isolated(|pods| async move {
        pods.prepare()?;
        let req = PinRequest {
            ipc: true,
            hostname: Some("h".into()),
        };
        let ids: Vec<_> = (10..14).map(sid).collect();
        let made = futures::future::join_all(ids.iter().map(|id| pods.create(id, &req))).await;
        for m in made {
            m?;
        }
        assert_eq!(ns_mounts(pods.dir()), 8);
        // A directory not named by a sandbox id in Cubelet's format is not
        // Cubelet's: it is left alone.
        std::fs::create_dir(pods.dir().join("stray"))?;
        assert_eq!(pods.remove_except(|| None)?, 0, "an unreadable store: none");
        let keep: HashSet<SandboxId> = ids[..2].iter().cloned().collect();
        assert_eq!(pods.remove_except(|| Some(keep.clone()))?, 2);
        assert_eq!(ns_mounts(pods.dir()), 4);
        let mut left: Vec<PathBuf> = std::fs::read_dir(pods.dir())?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        left.sort();
        let mut want: Vec<PathBuf> = ids[..2].iter().map(|i| pods.sandbox_dir(i)).collect();
        want.push(pods.dir().join("stray"));
        want.sort();
        assert_eq!(left, want);
        assert_eq!(pods.remove_except(|| Some(HashSet::new()))?, 2);
        assert_eq!(ns_mounts(pods.dir()), 0);
        std::fs::remove_dir(pods.dir().join("stray"))?;
        Ok(())
    });
}
