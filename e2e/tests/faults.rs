//! The fault matrices, over CRI with the real providers.
//!
//! 1. Every step of every flow fails in turn: each provider (storage,
//!    network, sandbox — the sandbox step twice: with a pause container and
//!    with pinned namespaces and no infra process) × each flow (create,
//!    destroy, cleanup) × each phase (before the step did anything, during
//!    it — the step stopped part-way, its future dropped as a cancellation
//!    would — and after it did all of it), by the daemon's test failpoints.
//!    A failed create is an error and leaves
//!    nothing (rolled back); a destroy or cleanup that fails once is an error
//!    and the retry kubelet would make succeeds. After each case the CRI
//!    state is as expected and the leak audit (netns and pod namespace pins, veths, mounts,
//!    sandbox directories, containerd objects, shims, CRI records) is 0.
//! 2. kill -9 at each step boundary of create and destroy (a failpoint
//!    holds the flow after the step), then restart: a pod whose create never
//!    returned is gone without a trace; a pod the client was told exists is
//!    still listed and can be stopped and removed; nothing leaks.
//!
//! Both matrices run the `create` cases of every provider once more with a
//! pod that claims a ready warm-pool shell and stays inside it (no infra
//! process, its log directory made first as kubelet does), whose journal
//! start is buffered; each such case checks that the pool counted a hit.
//!
//! Without the private containerd it prints SKIP and passes.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{
    PodSandboxConfig, RemovePodSandboxRequest, RunPodSandboxRequest, StopPodSandboxRequest,
};
use cubelet_e2e::{eventually, leaks, metric, pid_per_container, with_daemon, Daemon, DaemonOpts};

const PROVIDERS: [&str; 3] = ["storage", "network", "sandbox"];
const PHASES: [&str; 3] = ["before", "during", "after"];

async fn restart_with(d: &Daemon, failpoints: &str) -> anyhow::Result<()> {
    d.stop().await?;
    if failpoints.is_empty() {
        d.start_with_env(&[]).await
    } else {
        d.start_with_env(&[("CUBELET_TEST_FAILPOINTS", failpoints)])
            .await
    }
}

/// The pod of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pod {
    /// The default pod: a pod-level PID namespace, so a pause container.
    Pause,
    /// A pid-per-container pod: pinned namespaces, no infra process.
    Infraless,
    /// An infraless pod with its log directory made, as kubelet makes it,
    /// that claims a ready shell: a claim confined to its shell.
    Claim,
}

impl Pod {
    /// The case's suffix and the pod name's prefix letter.
    fn tag(self) -> (&'static str, &'static str) {
        match self {
            Pod::Pause => ("", ""),
            Pod::Infraless => (" (no infra)", "i"),
            Pod::Claim => (" (confined claim)", "c"),
        }
    }
}

/// The pod config of a case.
fn pod(d: &Daemon, name: &str, kind: Pod) -> PodSandboxConfig {
    let cfg = d.pod_config(name);
    match kind {
        Pod::Pause => cfg,
        Pod::Infraless | Pod::Claim => pid_per_container(cfg),
    }
}

/// For a [`Pod::Claim`] case, before its RunPodSandbox: makes the pod's
/// log directory and waits for a ready shell; returns the pool's hits so
/// far, for [`claimed`].
async fn ready_to_claim(d: &Daemon, cfg: &PodSandboxConfig, kind: Pod) -> anyhow::Result<f64> {
    if kind != Pod::Claim {
        return Ok(0.0);
    }
    std::fs::create_dir_all(&cfg.log_directory)?;
    eventually("a ready shell", Duration::from_secs(30), || async {
        Ok(metric(d.metrics, "cubelet_pool_ready").await? >= 1.0)
    })
    .await?;
    metric(d.metrics, "cubelet_pool_hits_total").await
}

/// For a [`Pod::Claim`] case, after its RunPodSandbox began: the pool
/// counted its hit.
async fn claimed(d: &Daemon, case: &str, kind: Pod, hits: f64) -> anyhow::Result<()> {
    if kind == Pod::Claim {
        let now = metric(d.metrics, "cubelet_pool_hits_total").await?;
        ensure!(
            now == hits + 1.0,
            "{case}: no shell claimed ({hits} → {now} hits)"
        );
    }
    Ok(())
}

async fn run(d: &Daemon, name: &str, kind: Pod) -> Result<String, tonic::Status> {
    d.runtime
        .clone()
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(pod(d, name, kind)),
            runtime_handler: String::new(),
        })
        .await
        .map(|r| r.into_inner().pod_sandbox_id)
}

async fn stop(d: &Daemon, id: &str) -> Result<(), tonic::Status> {
    d.runtime
        .clone()
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        })
        .await
        .map(drop)
}

async fn remove(d: &Daemon, id: &str) -> Result<(), tonic::Status> {
    d.runtime
        .clone()
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        })
        .await
        .map(drop)
}

/// Nothing of any pod is left, waiting a moment for the GC.
async fn clean(d: &Daemon, case: &str) -> anyhow::Result<()> {
    let mut left = Vec::new();
    for _ in 0..60 {
        left = leaks(d).await?;
        if left.is_empty() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!("{case}: left\n  {}", left.join("\n  "))
}

/// One case of the step-failure matrix.
async fn step_fails(
    d: &Daemon,
    provider: &str,
    flow: &str,
    phase: &str,
    kind: Pod,
) -> anyhow::Result<()> {
    let point = format!("{provider}.{flow}@{phase}");
    let once = if flow == "create" { "fail" } else { "fail:1" };
    restart_with(d, &format!("{point}={once}")).await?;
    let (suffix, letter) = kind.tag();
    let case = format!("{point}{suffix}");
    let name = format!("f{letter}-{provider}-{flow}-{phase}");
    match flow {
        "create" => {
            let hits = ready_to_claim(d, &pod(d, &name, kind), kind).await?;
            let r = run(d, &name, kind).await;
            claimed(d, &case, kind, hits).await?;
            ensure!(r.is_err(), "{case}: RunPodSandbox succeeded");
            ensure!(
                d.pod_ids().await?.is_empty(),
                "{case}: a failed create is listed"
            );
        }
        "destroy" => {
            let id = run(d, &name, kind).await.context("RunPodSandbox")?;
            ensure!(
                stop(d, &id).await.is_err(),
                "{case}: StopPodSandbox succeeded"
            );
            stop(d, &id)
                .await
                .with_context(|| format!("{case}: the StopPodSandbox retry"))?;
            remove(d, &id).await.context("RemovePodSandbox")?;
        }
        _ => {
            let id = run(d, &name, kind).await.context("RunPodSandbox")?;
            stop(d, &id).await.context("StopPodSandbox")?;
            ensure!(
                remove(d, &id).await.is_err(),
                "{case}: RemovePodSandbox succeeded"
            );
            remove(d, &id)
                .await
                .with_context(|| format!("{case}: the RemovePodSandbox retry"))?;
            ensure!(
                !d.pod_ids().await?.contains(&id),
                "{case}: removed pod still listed"
            );
        }
    }
    clean(d, &case).await
}

/// One case of the kill -9 matrix: the flow is held after `provider`'s step.
async fn killed_after(d: &Daemon, provider: &str, flow: &str, kind: Pod) -> anyhow::Result<()> {
    let (suffix, letter) = kind.tag();
    let case = format!("kill -9 after {provider}.{flow}{suffix}");
    let hold = format!("{provider}.{flow}=sleep:300s");
    let name = format!("k{letter}-{provider}-{flow}");
    let told = if flow == "destroy" {
        restart_with(d, &hold).await?;
        Some(run(d, &name, kind).await.context("RunPodSandbox")?)
    } else {
        restart_with(d, &hold).await?;
        None
    };
    let config = pod(d, &name, kind);
    let hits = ready_to_claim(d, &config, kind).await?;
    let call = {
        let mut rt = d.runtime.clone();
        let id = told.clone();
        tokio::spawn(async move {
            match id {
                Some(id) => rt
                    .stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: id })
                    .await
                    .map(drop),
                None => rt
                    .run_pod_sandbox(RunPodSandboxRequest {
                        config: Some(config),
                        runtime_handler: String::new(),
                    })
                    .await
                    .map(drop),
            }
        })
    };
    // The steps before the hold take well under this.
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        !call.is_finished(),
        "{case}: the call returned before the kill"
    );
    claimed(d, &case, kind, hits).await?;
    d.kill9().await?;
    let _ = call.await;
    restart_with(d, "").await?;
    match told {
        Some(id) => {
            ensure!(
                d.pod_ids().await?.contains(&id),
                "{case}: a pod the client was told exists is lost"
            );
            stop(d, &id).await.context("StopPodSandbox after restart")?;
            remove(d, &id)
                .await
                .context("RemovePodSandbox after restart")?;
        }
        None => {
            // Recovery undid the create; the GC drops its record.
            eventually(
                &format!("{case}: record gone"),
                Duration::from_secs(60),
                || async { Ok(d.pod_ids().await?.is_empty()) },
            )
            .await?;
        }
    }
    clean(d, &case).await
}

async fn matrix(d: &Daemon) -> anyhow::Result<()> {
    d.pull("127.0.0.1:5000/busybox:test").await?;
    let mut failed = Vec::new();
    // Every provider with the default (pause) pod; the sandbox step again
    // with a pod that gets pinned namespaces instead of an infra process;
    // and, for `create`, every provider with a confined claim.
    let cases = PROVIDERS
        .iter()
        .map(|p| (*p, Pod::Pause))
        .chain([("sandbox", Pod::Infraless)])
        .collect::<Vec<_>>();
    let claims = PROVIDERS
        .iter()
        .map(|p| (*p, Pod::Claim))
        .collect::<Vec<_>>();
    let flows = |flow| {
        let extra = if flow == "create" { &claims[..] } else { &[] };
        cases.iter().chain(extra).copied().collect::<Vec<_>>()
    };
    let (mut failures, mut kills) = (0, 0);
    for flow in ["create", "destroy", "cleanup"] {
        for (provider, kind) in flows(flow) {
            for phase in PHASES {
                failures += 1;
                if let Err(e) = step_fails(d, provider, flow, phase, kind).await {
                    failed.push(format!("{e:#}"));
                    d.remove_all().await.ok();
                }
            }
        }
    }
    for flow in ["create", "destroy"] {
        for (provider, kind) in flows(flow) {
            kills += 1;
            if let Err(e) = killed_after(d, provider, flow, kind).await {
                failed.push(format!("{e:#}"));
                restart_with(d, "").await.ok();
                d.remove_all().await.ok();
            }
        }
    }
    restart_with(d, "").await?;
    println!(
        "fault matrix: {failures} step failures, {kills} kill -9 points, {} failed",
        failed.len()
    );
    ensure!(failed.is_empty(), "{}", failed.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_fault_and_kill_leaves_nothing() {
    let opts = DaemonOpts {
        index: 25,
        extra_config: Some("gc: { interval: 1s }\n".to_owned()),
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(900), |d| Box::pin(matrix(d))).await;
}
