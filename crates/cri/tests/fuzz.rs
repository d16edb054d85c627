//! Generated CRI requests through the conversion and validation layer, no
//! root needed: pod sandbox configs (RunPodSandbox), container configs
//! (CreateContainer), resource updates (UpdateContainerResources) and ids
//! (every call that names a sandbox or container). Nothing may panic; an
//! input error is `InvalidArgument` and nothing else; and whatever passes
//! converts to an OCI resources section without error (so it can reach
//! runc). The strategies mix well-formed values with what runc and the
//! kernel refuse: NUL bytes, `..`, over-long components and paths,
//! out-of-range numbers.
//!
//! 10 000 cases per property in CI (`PROPTEST_CASES` overrides).

use std::collections::HashMap;

use cubelet_cri::convert::{container_resources, sandbox_id, sandbox_spec};
use cubelet_cri::error::CriError;
use cubelet_cri::validate;
use cubelet_cri_api::v1 as cri;
use cubelet_runtime::spec::linux_resources;
use cubelet_runtime::stats::cgroups::CgroupSupport;
use cubelet_runtime::RuntimeError;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(10_000)
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9][a-z0-9.-]{0,20}",
        2 => "/[a-z0-9/._-]{0,40}",
        1 => "\\PC{0,30}",
        1 => Just(String::new()),
        1 => Just("a\0b".to_owned()),
        1 => Just("/a/../b".to_owned()),
        1 => Just(format!("/{}", "x".repeat(256))),
        1 => Just(format!("/{}", "x".repeat(5000))),
        1 => Just("../../etc".to_owned()),
        1 => Just("net.ipv4.ip_forward".to_owned()),
    ]
}

fn number() -> impl Strategy<Value = i64> {
    prop_oneof![
        any::<i64>(),
        -2i64..=2,
        Just(i64::MIN),
        Just(i64::MAX),
        Just(1_000),
        Just(100_000),
        Just(262_144),
        Just(262_145),
        Just(1_000_001),
        Just(64 << 20),
        -1001i64..=1001,
    ]
}

fn map() -> impl Strategy<Value = HashMap<String, String>> {
    prop::collection::hash_map(text(), text(), 0..4)
}

fn list() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(text(), 0..4)
}

fn resources() -> impl Strategy<Value = cri::LinuxContainerResources> {
    (
        (number(), number(), number(), number()),
        (number(), number()),
        (text(), text()),
        prop::collection::vec(
            (prop_oneof!["[0-9]{1,4}(KB|MB|GB)", text()], any::<u64>()),
            0..3,
        ),
        map(),
    )
        .prop_map(
            |((period, quota, shares, memory), (swap, oom), (cpus, mems), huge, unified)| {
                cri::LinuxContainerResources {
                    cpu_period: period,
                    cpu_quota: quota,
                    cpu_shares: shares,
                    memory_limit_in_bytes: memory,
                    memory_swap_limit_in_bytes: swap,
                    oom_score_adj: oom,
                    cpuset_cpus: cpus,
                    cpuset_mems: mems,
                    hugepage_limits: huge
                        .into_iter()
                        .map(|(page_size, limit)| cri::HugepageLimit { page_size, limit })
                        .collect(),
                    unified,
                }
            },
        )
}

fn sandbox_config() -> impl Strategy<Value = cri::PodSandboxConfig> {
    (
        prop::option::weighted(0.95, (text(), text(), text(), any::<u32>())),
        (text(), text()),
        prop::option::of((list(), list(), list())),
        prop::collection::vec((any::<i32>(), any::<i32>(), any::<i32>(), text()), 0..3),
        (map(), map()),
        prop::option::weighted(
            0.8,
            (
                text(),
                map(),
                any::<bool>(),
                (any::<i32>(), any::<i32>(), any::<i32>()),
            ),
        ),
    )
        .prop_map(
            |(meta, (hostname, log_dir), dns, ports, (labels, annotations), linux)| {
                cri::PodSandboxConfig {
                    metadata: meta.map(|(name, namespace, uid, attempt)| cri::PodSandboxMetadata {
                        name,
                        namespace,
                        uid,
                        attempt,
                    }),
                    hostname,
                    log_directory: log_dir,
                    dns_config: dns.map(|(servers, searches, options)| cri::DnsConfig {
                        servers,
                        searches,
                        options,
                    }),
                    port_mappings: ports
                        .into_iter()
                        .map(
                            |(protocol, container_port, host_port, host_ip)| cri::PortMapping {
                                protocol: protocol % 4,
                                container_port,
                                host_port,
                                host_ip,
                            },
                        )
                        .collect(),
                    labels,
                    annotations,
                    linux: linux.map(|(cgroup_parent, sysctls, privileged, (net, pid, ipc))| {
                        cri::LinuxPodSandboxConfig {
                            cgroup_parent,
                            sysctls,
                            security_context: Some(cri::LinuxSandboxSecurityContext {
                                privileged,
                                namespace_options: Some(cri::NamespaceOption {
                                    network: net % 5,
                                    pid: pid % 5,
                                    ipc: ipc % 5,
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }
                    }),
                    ..Default::default()
                }
            },
        )
}

fn container_config() -> impl Strategy<Value = cri::ContainerConfig> {
    (
        (text(), text(), list(), list()),
        prop::collection::vec((text(), text()), 0..3),
        prop::collection::vec((text(), text(), any::<bool>()), 0..3),
        prop::collection::vec((text(), text(), text()), 0..2),
        (map(), map(), text()),
        prop::option::weighted(0.7, resources()),
        (list(), list(), list()),
    )
        .prop_map(
            |(
                (name, image, command, args),
                envs,
                mounts,
                devices,
                (labels, annotations, log_path),
                res,
                (add, drop, masked),
            )| cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata { name, attempt: 0 }),
                image: Some(cri::ImageSpec {
                    image,
                    ..Default::default()
                }),
                command,
                args,
                envs: envs
                    .into_iter()
                    .map(|(key, value)| cri::KeyValue { key, value })
                    .collect(),
                mounts: mounts
                    .into_iter()
                    .map(|(container_path, host_path, readonly)| cri::Mount {
                        container_path,
                        host_path,
                        readonly,
                        ..Default::default()
                    })
                    .collect(),
                devices: devices
                    .into_iter()
                    .map(|(container_path, host_path, permissions)| cri::Device {
                        container_path,
                        host_path,
                        permissions,
                    })
                    .collect(),
                labels,
                annotations,
                log_path,
                linux: Some(cri::LinuxContainerConfig {
                    resources: res,
                    security_context: Some(cri::LinuxContainerSecurityContext {
                        capabilities: Some(cri::Capability {
                            add_capabilities: add,
                            drop_capabilities: drop,
                            ..Default::default()
                        }),
                        masked_paths: masked,
                        ..Default::default()
                    }),
                }),
                ..Default::default()
            },
        )
}

/// An input error must be `InvalidArgument` with a field name.
fn input_error(e: &CriError) -> Result<(), TestCaseError> {
    match e {
        CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })
            if !field.is_empty() =>
        {
            Ok(())
        }
        other => Err(TestCaseError::fail(format!(
            "input error with code {:?}: {other}",
            other.code()
        ))),
    }
}

/// Validated resources reach an OCI spec without an error: fitting them to
/// a node either refuses them as an input error (a page size the node
/// lacks) or gives a spec section.
fn converts(r: &cri::LinuxContainerResources) -> Result<(), TestCaseError> {
    let res = container_resources(Some(r));
    let fitted = match CgroupSupport::permissive().fit(&res) {
        Ok(f) => f,
        Err(RuntimeError::InvalidArgument { .. }) => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("fit: {e}"))),
    };
    linux_resources(fitted.as_ref().unwrap_or(&res))
        .map_err(|e| TestCaseError::fail(format!("linux_resources: {e}")))?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn run_pod_sandbox_configs(config in sandbox_config(), handler in text()) {
        match sandbox_spec(Some(&config), &handler) {
            Ok(spec) => {
                prop_assert!(!spec.name.is_empty() && !spec.name.contains('\0'));
                if let Some(cg) = &spec.cgroup_parent {
                    prop_assert!(cg.len() <= validate::PATH_MAX);
                    prop_assert!(!cg.split('/').any(|c| c == ".."));
                }
            }
            Err(e) => input_error(&e)?,
        }
    }

    #[test]
    fn create_container_configs(config in container_config()) {
        match validate::container_config(&config) {
            Ok(()) => {
                if let Some(r) = config.linux.as_ref().and_then(|l| l.resources.as_ref()) {
                    converts(r)?;
                }
            }
            Err(e) => input_error(&e)?,
        }
    }

    #[test]
    fn update_container_resources(r in resources()) {
        match validate::resources("linux", &r) {
            Ok(()) => converts(&r)?,
            Err(e) => input_error(&e)?,
        }
    }

    #[test]
    fn ids(id in text()) {
        if let Err(e) = sandbox_id("pod_sandbox_id", &id) {
            input_error(&e)?;
        }
    }
}
