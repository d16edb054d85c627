//! Mutated CRI requests over the real socket: a few hundred RunPodSandbox,
//! CreateContainer, UpdateContainerResources, ExecSync, status, stop and
//! remove calls built from valid requests with one or two fields broken
//! (NUL bytes, `..`, over-long strings, out-of-range numbers, unknown ids,
//! unknown enum values). Afterwards a pod made beforehand is intact (ready,
//! its container running and answering exec), the daemon is healthy, no
//! answer was `Unknown` or `Internal`, and after removing everything the
//! leak audit is 0. The generator is a fixed-seed xorshift, so a failure
//! replays; `CUBELET_FUZZ_SEED` and `CUBELET_FUZZ_ROUNDS` change it.
//!
//! No request names a registry other than the local one and no port
//! mapping has a host port, so nothing leaves the machine.
//!
//! Without the private containerd it prints SKIP and passes.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{
    ContainerConfig, ContainerStatusRequest, CreateContainerRequest, ExecSyncRequest, KeyValue,
    LinuxContainerConfig, LinuxContainerResources, LinuxPodSandboxConfig, Mount, PodSandboxConfig,
    PodSandboxStatusRequest, RemoveContainerRequest, RunPodSandboxRequest, StopContainerRequest,
    StopPodSandboxRequest, UpdateContainerResourcesRequest,
};
use cubelet_e2e::{container_config, http_status, with_daemon, Daemon, DaemonOpts};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

/// xorshift64*: small, fast, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
    fn text(&mut self) -> String {
        match self.below(10) {
            0 => "a\0b".to_owned(),
            1 => "/a/../../b".to_owned(),
            2 => "x".repeat(300),
            3 => format!("/{}", "y".repeat(5000)),
            4 => String::new(),
            5 => "..".to_owned(),
            6 => "名前-ü".to_owned(),
            7 => format!("fz{}", self.next() % 1000),
            8 => "/tmp".to_owned(),
            _ => format!("v{}\n{}", self.next() % 10, self.next() % 10),
        }
    }
    fn number(&mut self) -> i64 {
        match self.below(8) {
            0 => i64::MIN,
            1 => i64::MAX,
            2 => -1,
            3 => 0,
            4 => 1,
            5 => 1_000_000_000,
            6 => -(self.below(2000) as i64),
            _ => self.next() as i64,
        }
    }
}

fn pod(d: &Daemon, rng: &mut Rng, n: usize) -> PodSandboxConfig {
    let mut cfg = d.pod_config(&format!("fuzz-{n}"));
    match rng.below(9) {
        0 => cfg
            .metadata
            .as_mut()
            .map(|m| m.name = rng.text())
            .unwrap_or(()),
        1 => cfg
            .metadata
            .as_mut()
            .map(|m| m.uid = rng.text())
            .unwrap_or(()),
        2 => cfg.hostname = rng.text(),
        3 => cfg.log_directory = rng.text(),
        4 => {
            cfg.labels.insert(rng.text(), rng.text());
        }
        5 => {
            let linux = cfg.linux.get_or_insert_with(LinuxPodSandboxConfig::default);
            linux.cgroup_parent = rng.text();
        }
        6 => {
            let linux = cfg.linux.get_or_insert_with(LinuxPodSandboxConfig::default);
            linux.sysctls.insert(rng.text(), rng.text());
        }
        7 => cfg.metadata = None,
        _ => {
            cfg.annotations.insert("k".into(), rng.text());
        }
    }
    // Never a host port: a DNAT of a real port of this machine is not a test's to make.
    cfg.port_mappings.clear();
    cfg
}

fn resources(rng: &mut Rng) -> LinuxContainerResources {
    let mut r = LinuxContainerResources::default();
    for _ in 0..=rng.below(2) {
        match rng.below(9) {
            0 => r.cpu_shares = rng.number(),
            1 => r.cpu_quota = rng.number(),
            2 => r.cpu_period = rng.number(),
            3 => r.memory_limit_in_bytes = rng.number(),
            4 => r.memory_swap_limit_in_bytes = rng.number(),
            5 => r.oom_score_adj = rng.number(),
            6 => r.cpuset_cpus = rng.text(),
            7 => {
                r.unified.insert(rng.text(), rng.text());
            }
            _ => r.cpuset_mems = rng.text(),
        }
    }
    r
}

fn container(rng: &mut Rng, n: usize) -> ContainerConfig {
    let mut c = container_config(&format!("fz{n}"), BUSYBOX, &["sleep", "3600"]);
    match rng.below(10) {
        0 => c
            .metadata
            .as_mut()
            .map(|m| m.name = rng.text())
            .unwrap_or(()),
        1 => c.args.push(rng.text()),
        2 => c.envs.push(KeyValue {
            key: rng.text(),
            value: rng.text(),
        }),
        3 => c.working_dir = rng.text(),
        4 => c.log_path = rng.text(),
        5 => c.mounts.push(Mount {
            container_path: rng.text(),
            host_path: rng.text(),
            propagation: (rng.next() % 5) as i32,
            ..Default::default()
        }),
        6 => {
            c.linux = Some(LinuxContainerConfig {
                resources: Some(resources(rng)),
                ..Default::default()
            })
        }
        7 => {
            // Another image of the local registry only: never a remote one.
            c.image
                .as_mut()
                .map(|i| i.image = format!("127.0.0.1:5000/{}", rng.text()))
                .unwrap_or(())
        }
        8 => {
            c.labels.insert(rng.text(), rng.text());
        }
        _ => c.command = vec![rng.text()],
    }
    c
}

async fn barrage(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let cfg = d.pod_config("keeper");
    let keeper = d.run_pod(&cfg, "").await?;
    let keeper_c = d
        .start_in(
            &keeper,
            &cfg,
            container_config("keep", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;

    let seed = std::env::var("CUBELET_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_cafe_u64);
    let rounds: usize = std::env::var("CUBELET_FUZZ_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut rng = Rng(seed | 1);
    let mut rt = d.runtime.clone();
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    let mut bad = Vec::new();
    for n in 0..rounds {
        let kind = rng.below(7);
        let result: Result<(), tonic::Status> = match kind {
            0 => rt
                .run_pod_sandbox(RunPodSandboxRequest {
                    config: Some(pod(d, &mut rng, n)),
                    runtime_handler: if rng.chance(8) {
                        rng.text()
                    } else {
                        String::new()
                    },
                })
                .await
                .map(drop),
            1 | 2 => rt
                .create_container(CreateContainerRequest {
                    pod_sandbox_id: if rng.chance(6) {
                        rng.text()
                    } else {
                        keeper.clone()
                    },
                    config: Some(container(&mut rng, n)),
                    sandbox_config: Some(cfg.clone()),
                })
                .await
                .map(drop),
            3 => rt
                .update_container_resources(UpdateContainerResourcesRequest {
                    container_id: if rng.chance(6) {
                        rng.text()
                    } else {
                        keeper_c.clone()
                    },
                    linux: Some(resources(&mut rng)),
                    ..Default::default()
                })
                .await
                .map(drop),
            4 => rt
                .exec_sync(ExecSyncRequest {
                    container_id: if rng.chance(3) {
                        rng.text()
                    } else {
                        keeper_c.clone()
                    },
                    cmd: vec![rng.text()],
                    timeout: 2,
                })
                .await
                .map(drop),
            5 => rt
                .pod_sandbox_status(PodSandboxStatusRequest {
                    pod_sandbox_id: rng.text(),
                    verbose: rng.chance(2),
                })
                .await
                .map(drop),
            _ => match rng.below(4) {
                0 => rt
                    .stop_container(StopContainerRequest {
                        container_id: rng.text(),
                        timeout: rng.number(),
                    })
                    .await
                    .map(drop),
                1 => rt
                    .remove_container(RemoveContainerRequest {
                        container_id: rng.text(),
                    })
                    .await
                    .map(drop),
                2 => rt
                    .stop_pod_sandbox(StopPodSandboxRequest {
                        pod_sandbox_id: rng.text(),
                    })
                    .await
                    .map(drop),
                _ => rt
                    .container_status(ContainerStatusRequest {
                        container_id: rng.text(),
                        verbose: false,
                    })
                    .await
                    .map(drop),
            },
        };
        let code = match &result {
            Ok(()) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        *codes.entry(format!("{code:?}")).or_default() += 1;
        if let Err(s) = &result {
            if matches!(s.code(), tonic::Code::Unknown | tonic::Code::Internal) {
                bad.push(format!(
                    "request {n} (kind {kind}): {:?}: {}",
                    s.code(),
                    s.message()
                ));
            }
        }
    }
    println!("fuzz over the socket: {rounds} requests, codes {codes:?}");
    ensure!(
        bad.is_empty(),
        "answers that blame the runtime:\n{}",
        bad.join("\n")
    );

    // The pod made beforehand is whole, and the daemon healthy.
    ensure!(http_status(d.metrics, "/readyz").await? == 200, "not ready");
    let status = rt
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: keeper.clone(),
            verbose: false,
        })
        .await?
        .into_inner()
        .status
        .context("keeper status")?;
    ensure!(status.state == 0, "the keeper pod is not ready: {status:?}");
    let c = d.container_status(&keeper_c).await?;
    ensure!(c.state == 1, "the keeper container is not running: {c:?}");
    let out = rt
        .exec_sync(ExecSyncRequest {
            container_id: keeper_c.clone(),
            cmd: vec!["echo".into(), "alive".into()],
            timeout: 10,
        })
        .await?
        .into_inner();
    ensure!(out.stdout == b"alive\n", "exec in the keeper: {out:?}");

    // Everything goes; the audit (with_daemon) then finds nothing.
    tokio::time::timeout(Duration::from_secs(120), d.remove_all())
        .await
        .context("cleanup timed out")??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_leave_the_node_whole() {
    with_daemon(
        DaemonOpts {
            index: 23,
            ..Default::default()
        },
        Duration::from_secs(600),
        |d| Box::pin(barrage(d)),
    )
    .await;
}
