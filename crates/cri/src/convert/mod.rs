//! Validation of CRI requests and conversion to and from the pod service's,
//! engine's and store's runtime-neutral types. CRI wire types do not leave
//! this crate.

mod container;
mod status;

pub use container::container_request;
pub use status::{container, container_matches, container_state, container_status};

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cubelet_cri_api::v1 as cri;
use cubelet_engine::spec::{
    DnsConfig, IdMapping, NamespaceMode, NamespaceOptions, PortMapping, Protocol, UserNamespace,
};
use cubelet_engine::{SandboxId, SandboxSpec};
use cubelet_pod::{SandboxRecord, SandboxState};
use cubelet_runtime::spec::{HugepageLimit, ResolvedUser, Resources, SupplementalGroupsPolicy};

use crate::error::{CriError, CriResult};

/// Parses a sandbox or container id from a request field.
pub fn sandbox_id(field: &str, id: &str) -> CriResult<SandboxId> {
    if id.is_empty() {
        return Err(CriError::invalid(field, "must not be empty"));
    }
    SandboxId::parse(id).ok_or_else(|| {
        CriError::invalid(
            field,
            format!("{id:?} is not a valid id (1-64 of [0-9a-z_-])"),
        )
    })
}

/// Checks that `path` is absolute, within the kernel's path limits
/// ([`crate::validate::path_limits`]) and has no `.`/`..` components.
pub fn clean_absolute(field: &str, path: &str) -> CriResult<PathBuf> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(CriError::invalid(
            field,
            format!("{path:?} is not an absolute path"),
        ));
    }
    crate::validate::path_limits(field, path)?;
    // `Path::components` drops inner `.` components, so look at the text.
    if path.split('/').any(|c| c == "." || c == "..") {
        return Err(CriError::invalid(
            field,
            format!("{path:?} must not contain '.' or '..'"),
        ));
    }
    Ok(p.to_path_buf())
}

/// Checks that a relative path stays below its base (no absolute, no `..`)
/// and within the kernel's path limits.
pub fn clean_relative(field: &str, path: &str) -> CriResult<PathBuf> {
    let p = Path::new(path);
    crate::validate::path_limits(field, path)?;
    if path.is_empty() || p.is_absolute() {
        return Err(CriError::invalid(
            field,
            format!("{path:?} must be a non-empty relative path"),
        ));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(CriError::invalid(
            field,
            format!("{path:?} must not contain '..'"),
        ));
    }
    Ok(p.to_path_buf())
}

fn non_empty<'a>(field: &str, v: &'a str) -> CriResult<&'a str> {
    if v.is_empty() {
        Err(CriError::invalid(field, "must not be empty"))
    } else {
        Ok(v)
    }
}

/// A DNS-1123-ish check for names that end up in file names and hostnames.
fn safe_name(field: &str, v: &str) -> CriResult<()> {
    non_empty(field, v)?;
    if v.len() > 253 || v.contains(['/', '\0']) || v == "." || v == ".." {
        return Err(CriError::invalid(
            field,
            format!("{v:?} is not a valid name"),
        ));
    }
    Ok(())
}

fn mode(m: i32) -> NamespaceMode {
    match cri::NamespaceMode::try_from(m).unwrap_or(cri::NamespaceMode::Pod) {
        cri::NamespaceMode::Pod => NamespaceMode::Pod,
        cri::NamespaceMode::Container => NamespaceMode::Container,
        cri::NamespaceMode::Node => NamespaceMode::Node,
        cri::NamespaceMode::Target => NamespaceMode::Target,
    }
}

/// Converts CRI `LinuxContainerResources` (checked by
/// [`crate::validate::resources`]) to the runtime's [`Resources`]; `None`
/// means no limits.
pub fn container_resources(r: Option<&cri::LinuxContainerResources>) -> Resources {
    let Some(r) = r else {
        return Resources::default();
    };
    Resources {
        cpu_shares: u64::try_from(r.cpu_shares).unwrap_or(0),
        cpu_quota: r.cpu_quota,
        cpu_period: u64::try_from(r.cpu_period).unwrap_or(0),
        cpuset_cpus: r.cpuset_cpus.clone(),
        cpuset_mems: r.cpuset_mems.clone(),
        memory_limit: r.memory_limit_in_bytes,
        memory_swap_limit: r.memory_swap_limit_in_bytes,
        unified: r
            .unified
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        hugepages: r
            .hugepage_limits
            .iter()
            .map(|h| HugepageLimit {
                page_size: h.page_size.clone(),
                limit: h.limit,
            })
            .collect(),
        oom_score_adj: i32::try_from(r.oom_score_adj).unwrap_or(0),
    }
}

/// Converts CRI `UserNamespace` options: `NODE` (or none) is the node's
/// user namespace (`None`); `POD` needs exactly one uid and one gid mapping,
/// each mapping container id 0 and fitting in 32 bits. `CONTAINER` and
/// `TARGET` are refused, as the CRI says.
pub fn user_namespace(
    field: &str,
    u: Option<&cri::UserNamespace>,
) -> CriResult<Option<UserNamespace>> {
    let Some(u) = u else {
        return Ok(None);
    };
    match cri::NamespaceMode::try_from(u.mode) {
        Ok(cri::NamespaceMode::Node) => {
            if !u.uids.is_empty() || !u.gids.is_empty() {
                return Err(CriError::invalid(
                    field,
                    "mappings are only for mode POD (NODE uses the node's)",
                ));
            }
            Ok(None)
        }
        Ok(cri::NamespaceMode::Pod) => {
            let one = |what: &str, maps: &[cri::IdMapping]| -> CriResult<IdMapping> {
                let [m] = maps else {
                    return Err(CriError::invalid(
                        format!("{field}.{what}"),
                        format!("exactly one mapping is supported, got {}", maps.len()),
                    ));
                };
                if m.container_id != 0 {
                    return Err(CriError::invalid(
                        format!("{field}.{what}"),
                        format!(
                            "container id 0 must be mapped (the mapping starts at {})",
                            m.container_id
                        ),
                    ));
                }
                if m.length == 0 || m.host_id.checked_add(m.length - 1).is_none() {
                    return Err(CriError::invalid(
                        format!("{field}.{what}"),
                        format!(
                            "length {} from host id {} is empty or past 2^32",
                            m.length, m.host_id
                        ),
                    ));
                }
                Ok(IdMapping {
                    container_id: m.container_id,
                    host_id: m.host_id,
                    length: m.length,
                })
            };
            Ok(Some(UserNamespace {
                uids: one("uids", &u.uids)?,
                gids: one("gids", &u.gids)?,
            }))
        }
        Ok(other) => Err(CriError::invalid(
            format!("{field}.mode"),
            format!(
                "{} is not supported for user namespaces (only NODE and POD)",
                other.as_str_name()
            ),
        )),
        Err(_) => Err(CriError::invalid(
            format!("{field}.mode"),
            format!("unknown mode {}", u.mode),
        )),
    }
}

/// The runtime's supplemental-groups policy of a container's security
/// context (checked by [`crate::validate::container_config`]).
pub fn supplemental_groups_policy(
    sc: Option<&cri::LinuxContainerSecurityContext>,
) -> SupplementalGroupsPolicy {
    match sc.map(|s| cri::SupplementalGroupsPolicy::try_from(s.supplemental_groups_policy)) {
        Some(Ok(cri::SupplementalGroupsPolicy::Strict)) => SupplementalGroupsPolicy::Strict,
        _ => SupplementalGroupsPolicy::Merge,
    }
}

/// ContainerStatus `user`: the uid, primary gid and every group the
/// container's first process got, as the runtime resolved them
/// (`ContainerRuntime::process_user`).
pub fn container_user(user: Option<&ResolvedUser>) -> Option<cri::ContainerUser> {
    let user = user?;
    Some(cri::ContainerUser {
        linux: Some(cri::LinuxContainerUser {
            uid: i64::from(user.uid),
            gid: i64::from(user.gid),
            supplemental_groups: user.additional_gids.iter().map(|g| i64::from(*g)).collect(),
        }),
    })
}

/// Validates a `PodSandboxConfig` and converts it to a [`SandboxSpec`].
pub fn sandbox_spec(
    config: Option<&cri::PodSandboxConfig>,
    runtime_handler: &str,
) -> CriResult<SandboxSpec> {
    let config = config.ok_or_else(|| CriError::invalid("config", "missing"))?;
    let meta = config
        .metadata
        .as_ref()
        .ok_or_else(|| CriError::invalid("config.metadata", "missing"))?;
    safe_name("config.metadata.name", &meta.name)?;
    safe_name("config.metadata.namespace", &meta.namespace)?;
    non_empty("config.metadata.uid", &meta.uid)?;
    crate::validate::no_nul("config.metadata.uid", &meta.uid)?;
    crate::validate::sandbox_config(config)?;
    if !config.hostname.is_empty() {
        safe_name("config.hostname", &config.hostname)?;
        if config.hostname.len() > 64 {
            return Err(CriError::invalid(
                "config.hostname",
                "longer than 64 characters",
            ));
        }
    }
    let log_directory = if config.log_directory.is_empty() {
        None
    } else {
        Some(clean_absolute(
            "config.log_directory",
            &config.log_directory,
        )?)
    };
    let dns = config.dns_config.as_ref().map(|d| DnsConfig {
        servers: d.servers.clone(),
        searches: d.searches.clone(),
        options: d.options.clone(),
    });
    if let Some(d) = &dns {
        for (i, s) in d.servers.iter().enumerate() {
            s.parse::<IpAddr>().map_err(|_| {
                CriError::invalid(
                    format!("config.dns_config.servers[{i}]"),
                    format!("{s:?} is not an IP address"),
                )
            })?;
        }
        for (field, list) in [("searches", &d.searches), ("options", &d.options)] {
            if let Some((i, bad)) = list
                .iter()
                .enumerate()
                .find(|(_, v)| v.contains(['\n', '\r']))
            {
                return Err(CriError::invalid(
                    format!("config.dns_config.{field}[{i}]"),
                    format!("{bad:?} contains a line break"),
                ));
            }
        }
    }
    let mut port_mappings = Vec::with_capacity(config.port_mappings.len());
    for (i, pm) in config.port_mappings.iter().enumerate() {
        let field = |f: &str| format!("config.port_mappings[{i}].{f}");
        let protocol = match cri::Protocol::try_from(pm.protocol) {
            Ok(cri::Protocol::Tcp) => Protocol::Tcp,
            Ok(cri::Protocol::Udp) => Protocol::Udp,
            Ok(cri::Protocol::Sctp) => Protocol::Sctp,
            Err(_) => {
                return Err(CriError::invalid(
                    field("protocol"),
                    format!("unknown protocol {}", pm.protocol),
                ))
            }
        };
        let port = |name: &str, v: i32| {
            u16::try_from(v).ok().filter(|p| *p != 0).ok_or_else(|| {
                CriError::invalid(field(name), format!("{v} is not a port (1-65535)"))
            })
        };
        let container_port = port("container_port", pm.container_port)?;
        // host_port 0 means "no host port": nothing to map.
        if pm.host_port == 0 {
            continue;
        }
        let host_port = port("host_port", pm.host_port)?;
        let host_ip = if pm.host_ip.is_empty() {
            None
        } else {
            Some(pm.host_ip.parse::<IpAddr>().map_err(|_| {
                CriError::invalid(
                    field("host_ip"),
                    format!("{:?} is not an IP address", pm.host_ip),
                )
            })?)
        };
        port_mappings.push(PortMapping {
            protocol,
            container_port,
            host_port,
            host_ip,
        });
    }
    let linux = config.linux.as_ref();
    let sc = linux.and_then(|l| l.security_context.as_ref());
    let ns = sc.and_then(|s| s.namespace_options.as_ref());
    let userns_field = "config.linux.security_context.namespace_options.userns_options";
    let namespaces = NamespaceOptions {
        network: ns.map_or(NamespaceMode::Pod, |n| mode(n.network)),
        pid: ns.map_or(NamespaceMode::Pod, |n| mode(n.pid)),
        ipc: ns.map_or(NamespaceMode::Pod, |n| mode(n.ipc)),
        target_id: ns.map(|n| n.target_id.clone()).filter(|t| !t.is_empty()),
        userns: user_namespace(userns_field, ns.and_then(|n| n.userns_options.as_ref()))?,
    };
    if namespaces.userns.is_some() {
        // As Kubernetes' own validation: a pod in its own user namespace
        // shares no namespace with the node (its netns must be one that its
        // user namespace owns).
        for (what, m) in [
            ("network", namespaces.network),
            ("pid", namespaces.pid),
            ("ipc", namespaces.ipc),
        ] {
            if m == NamespaceMode::Node {
                return Err(CriError::invalid(
                    userns_field,
                    format!("a pod user namespace cannot go with the node's {what} namespace"),
                ));
            }
        }
    }
    let cgroup_parent = linux
        .map(|l| l.cgroup_parent.clone())
        .filter(|c| !c.is_empty());
    if let Some(cg) = &cgroup_parent {
        if cg.split('/').any(|c| c == "..") || cg.contains('\0') {
            return Err(CriError::invalid(
                "config.linux.cgroup_parent",
                format!("{cg:?} must not contain '..'"),
            ));
        }
    }
    Ok(SandboxSpec {
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        attempt: meta.attempt,
        hostname: config.hostname.clone(),
        log_directory,
        dns,
        port_mappings,
        namespaces,
        labels: to_btree(&config.labels),
        annotations: to_btree(&config.annotations),
        cgroup_parent,
        runtime_handler: runtime_handler.to_owned(),
        sysctls: linux.map(|l| to_btree(&l.sysctls)).unwrap_or_default(),
        privileged: sc.is_some_and(|s| s.privileged),
    })
}

fn to_btree(m: &HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn to_hash(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// Nanoseconds since the epoch, as CRI timestamps are.
pub fn nanos(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// The CRI state of a stored sandbox.
pub fn sandbox_state(state: SandboxState) -> cri::PodSandboxState {
    match state {
        SandboxState::Ready => cri::PodSandboxState::SandboxReady,
        _ => cri::PodSandboxState::SandboxNotready,
    }
}

fn metadata(spec: &SandboxSpec) -> cri::PodSandboxMetadata {
    cri::PodSandboxMetadata {
        name: spec.name.clone(),
        uid: spec.uid.clone(),
        namespace: spec.namespace.clone(),
        attempt: spec.attempt,
    }
}

fn cri_mode(m: NamespaceMode) -> i32 {
    (match m {
        NamespaceMode::Pod => cri::NamespaceMode::Pod,
        NamespaceMode::Container => cri::NamespaceMode::Container,
        NamespaceMode::Node => cri::NamespaceMode::Node,
        NamespaceMode::Target => cri::NamespaceMode::Target,
    }) as i32
}

/// A stored sandbox as a CRI `PodSandbox` (list item).
pub fn pod_sandbox(rec: &SandboxRecord) -> cri::PodSandbox {
    cri::PodSandbox {
        id: rec.id.to_string(),
        metadata: Some(metadata(&rec.spec)),
        state: sandbox_state(rec.state) as i32,
        created_at: nanos(rec.created_at),
        labels: to_hash(&rec.spec.labels),
        annotations: to_hash(&rec.spec.annotations),
        runtime_handler: rec.spec.runtime_handler.clone(),
    }
}

/// A stored sandbox as a CRI `PodSandboxStatus`. `host_ip` is reported for
/// host-network pods.
pub fn pod_sandbox_status(rec: &SandboxRecord) -> cri::PodSandboxStatus {
    let ips = rec
        .network
        .as_ref()
        .map(|n| n.ips.clone())
        .unwrap_or_default();
    let network = Some(cri::PodSandboxNetworkStatus {
        ip: ips.first().map(ToString::to_string).unwrap_or_default(),
        additional_ips: ips
            .iter()
            .skip(1)
            .map(|ip| cri::PodIp { ip: ip.to_string() })
            .collect(),
    });
    let ns = &rec.spec.namespaces;
    cri::PodSandboxStatus {
        id: rec.id.to_string(),
        metadata: Some(metadata(&rec.spec)),
        state: sandbox_state(rec.state) as i32,
        created_at: nanos(rec.created_at),
        network,
        linux: Some(cri::LinuxPodSandboxStatus {
            namespaces: Some(cri::Namespace {
                options: Some(cri::NamespaceOption {
                    network: cri_mode(ns.network),
                    pid: cri_mode(ns.pid),
                    ipc: cri_mode(ns.ipc),
                    target_id: ns.target_id.clone().unwrap_or_default(),
                    userns_options: None,
                }),
            }),
        }),
        labels: to_hash(&rec.spec.labels),
        annotations: to_hash(&rec.spec.annotations),
        runtime_handler: rec.spec.runtime_handler.clone(),
    }
}

/// True when every selector label is present with the same value.
pub fn labels_match(selector: &HashMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Applies a `PodSandboxFilter` to a stored sandbox. The id filter matches a
/// prefix, as crictl and containerd allow truncated ids.
pub fn sandbox_matches(filter: &cri::PodSandboxFilter, rec: &SandboxRecord) -> bool {
    if !filter.id.is_empty() && !rec.id.as_str().starts_with(&filter.id) {
        return false;
    }
    if let Some(state) = &filter.state {
        if sandbox_state(rec.state) as i32 != state.state {
            return false;
        }
    }
    labels_match(&filter.label_selector, &rec.spec.labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: "web".into(),
                uid: "u1".into(),
                namespace: "default".into(),
                attempt: 1,
            }),
            hostname: "web-0".into(),
            log_directory: "/var/log/pods/default_web_u1".into(),
            dns_config: Some(cri::DnsConfig {
                servers: vec!["10.96.0.10".into()],
                searches: vec!["default.svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            port_mappings: vec![cri::PortMapping {
                protocol: cri::Protocol::Udp as i32,
                container_port: 53,
                host_port: 5353,
                host_ip: "127.0.0.1".into(),
            }],
            labels: [("app".to_string(), "web".to_string())].into(),
            annotations: HashMap::new(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: "/kubepods/besteffort/podu1".into(),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            windows: None,
        }
    }

    #[test]
    fn converts_a_full_config() {
        let s = sandbox_spec(Some(&config()), "runc").unwrap();
        assert_eq!(
            (
                s.name.as_str(),
                s.namespace.as_str(),
                s.uid.as_str(),
                s.attempt
            ),
            ("web", "default", "u1", 1)
        );
        assert_eq!(
            s.log_directory.as_deref(),
            Some(Path::new("/var/log/pods/default_web_u1"))
        );
        assert_eq!(s.dns.as_ref().unwrap().options, vec!["ndots:5"]);
        assert_eq!(s.port_mappings[0].protocol, Protocol::Udp);
        assert_eq!(
            s.port_mappings[0].host_ip,
            Some("127.0.0.1".parse().unwrap())
        );
        assert!(s.host_network());
        assert_eq!(s.namespaces.pid, NamespaceMode::Container);
        assert_eq!(
            s.cgroup_parent.as_deref(),
            Some("/kubepods/besteffort/podu1")
        );
        assert_eq!(s.runtime_handler, "runc");
    }

    #[test]
    fn bad_inputs_name_the_field() {
        type Mutate = Box<dyn Fn(&mut cri::PodSandboxConfig)>;
        let cases: Vec<(Mutate, &str)> = vec![
            (Box::new(|c| c.metadata = None), "config.metadata"),
            (
                Box::new(|c| c.metadata.as_mut().unwrap().name.clear()),
                "config.metadata.name",
            ),
            (
                Box::new(|c| c.metadata.as_mut().unwrap().namespace = "a/b".into()),
                "config.metadata.namespace",
            ),
            (
                Box::new(|c| c.metadata.as_mut().unwrap().uid.clear()),
                "config.metadata.uid",
            ),
            (
                Box::new(|c| c.log_directory = "relative/logs".into()),
                "config.log_directory",
            ),
            (
                Box::new(|c| c.log_directory = "/var/log/../../etc".into()),
                "config.log_directory",
            ),
            (
                Box::new(|c| c.dns_config.as_mut().unwrap().servers[0] = "dns".into()),
                "config.dns_config.servers[0]",
            ),
            (
                Box::new(|c| c.port_mappings[0].container_port = 70000),
                "config.port_mappings[0].container_port",
            ),
            (
                Box::new(|c| c.port_mappings[0].host_ip = "nope".into()),
                "config.port_mappings[0].host_ip",
            ),
            (
                Box::new(|c| c.linux.as_mut().unwrap().cgroup_parent = "/a/../../b".into()),
                "config.linux.cgroup_parent",
            ),
        ];
        for (mutate, field) in cases {
            let mut c = config();
            mutate(&mut c);
            let e = sandbox_spec(Some(&c), "").unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.to_string().starts_with(&format!("invalid {field}:")),
                "{field}: {e}"
            );
        }
        assert!(sandbox_spec(None, "")
            .unwrap_err()
            .to_string()
            .starts_with("invalid config:"));
    }

    #[test]
    fn ids_and_paths() {
        assert!(sandbox_id("pod_sandbox_id", "").is_err());
        assert!(sandbox_id("pod_sandbox_id", "../x").is_err());
        assert!(sandbox_id("pod_sandbox_id", "abc").is_ok());
        assert!(clean_absolute("f", "/a/b").is_ok());
        assert!(clean_absolute("f", "/a/./b").is_err());
        assert!(clean_relative("f", "c/0.log").is_ok());
        assert!(clean_relative("f", "../0.log").is_err());
        assert!(clean_relative("f", "/0.log").is_err());
    }

    #[test]
    fn user_namespaces_node_or_pod_with_one_mapping_each() {
        let f = "userns";
        let map = |container_id, host_id, length| cri::IdMapping {
            host_id,
            container_id,
            length,
        };
        let pod = |uids: Vec<cri::IdMapping>, gids: Vec<cri::IdMapping>| cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids,
            gids,
        };
        assert_eq!(user_namespace(f, None).unwrap(), None);
        let node = cri::UserNamespace {
            mode: cri::NamespaceMode::Node as i32,
            ..Default::default()
        };
        assert_eq!(user_namespace(f, Some(&node)).unwrap(), None);
        let ok = user_namespace(
            f,
            Some(&pod(vec![map(0, 1000, 100000)], vec![map(0, 2000, 100000)])),
        )
        .unwrap()
        .unwrap();
        assert_eq!(ok.uids.host_id, 1000);
        assert_eq!(ok.gids.host_id, 2000);
        let field = |r: CriResult<Option<UserNamespace>>| match r {
            Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })) => field,
            other => panic!("not refused: {other:?}"),
        };
        // critest: more than one mapping, container id 0 not mapped.
        let two = vec![map(0, 1000, 100000), map(0, 2000, 100000)];
        assert_eq!(
            field(user_namespace(f, Some(&pod(two.clone(), two)))),
            "userns.uids"
        );
        let shifted = vec![map(1, 1000, 100000)];
        assert_eq!(
            field(user_namespace(f, Some(&pod(shifted.clone(), shifted)))),
            "userns.uids"
        );
        let ok_uids = vec![map(0, 1000, 10)];
        assert_eq!(
            field(user_namespace(f, Some(&pod(ok_uids.clone(), Vec::new())))),
            "userns.gids"
        );
        let past = vec![map(0, u32::MAX, 2)];
        assert_eq!(
            field(user_namespace(f, Some(&pod(past.clone(), past)))),
            "userns.uids"
        );
        let empty = vec![map(0, 1000, 0)];
        assert_eq!(
            field(user_namespace(f, Some(&pod(empty.clone(), empty)))),
            "userns.uids"
        );
        // critest: CONTAINER and TARGET are refused; NODE takes no mappings.
        for mode in [cri::NamespaceMode::Container, cri::NamespaceMode::Target] {
            let u = cri::UserNamespace {
                mode: mode as i32,
                ..Default::default()
            };
            assert_eq!(field(user_namespace(f, Some(&u))), "userns.mode");
        }
        let node_maps = cri::UserNamespace {
            mode: cri::NamespaceMode::Node as i32,
            uids: ok_uids.clone(),
            gids: ok_uids,
        };
        assert_eq!(field(user_namespace(f, Some(&node_maps))), "userns");
    }

    #[test]
    fn a_pod_user_namespace_shares_nothing_with_the_node() {
        let mut c = config();
        let m = cri::IdMapping {
            host_id: 65536,
            container_id: 0,
            length: 65536,
        };
        let userns = cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids: vec![m],
            gids: vec![m],
        };
        c.linux = Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    userns_options: Some(userns.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let spec = sandbox_spec(Some(&c), "runc").unwrap();
        assert_eq!(spec.namespaces.userns.map(|u| u.uids.host_id), Some(65536));
        for set in [
            |n: &mut cri::NamespaceOption| n.network = cri::NamespaceMode::Node as i32,
            |n: &mut cri::NamespaceOption| n.pid = cri::NamespaceMode::Node as i32,
            |n: &mut cri::NamespaceOption| n.ipc = cri::NamespaceMode::Node as i32,
        ] {
            let mut c = c.clone();
            let ns = c
                .linux
                .as_mut()
                .and_then(|l| l.security_context.as_mut())
                .and_then(|s| s.namespace_options.as_mut())
                .unwrap();
            set(ns);
            assert!(matches!(
                sandbox_spec(Some(&c), "runc"),
                Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { .. }))
            ));
        }
    }

    #[test]
    fn container_user_and_groups_policy() {
        assert_eq!(container_user(None), None);
        let u = container_user(Some(&ResolvedUser {
            uid: 1000,
            gid: 1000,
            additional_gids: vec![1000, 50000, 1234],
        }))
        .unwrap()
        .linux
        .unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.supplemental_groups, vec![1000, 50000, 1234]);
        assert_eq!(
            supplemental_groups_policy(Some(&cri::LinuxContainerSecurityContext {
                supplemental_groups_policy: cri::SupplementalGroupsPolicy::Strict as i32,
                ..Default::default()
            })),
            SupplementalGroupsPolicy::Strict
        );
        assert_eq!(
            supplemental_groups_policy(None),
            SupplementalGroupsPolicy::Merge
        );
    }
}
