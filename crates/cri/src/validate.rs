//! Input rules checked at the edge, before any state changes: what runc and
//! the kernel would refuse (or choke on) is `InvalidArgument` naming the
//! field, never an `Internal` error from deep inside a flow.
//!
//! Each rule is listed in the "Input validation" table of docs/validation.md; the
//! property test `tests/fuzz.rs` feeds generated requests through here.

use cubelet_cri_api::v1 as cri;

use crate::error::{CriError, CriResult};

/// Longest path the kernel takes (`PATH_MAX`, with its NUL).
pub const PATH_MAX: usize = 4095;
/// Longest path component (`NAME_MAX`).
pub const NAME_MAX: usize = 255;
/// Smallest and largest CFS shares the kernel accepts (v1; v2 maps them).
pub const CPU_SHARES: std::ops::RangeInclusive<i64> = 2..=262_144;
/// CFS period range the kernel accepts, in microseconds.
pub const CPU_PERIOD: std::ops::RangeInclusive<i64> = 1_000..=1_000_000;
/// Smallest CFS quota the kernel accepts, in microseconds.
pub const CPU_QUOTA_MIN: i64 = 1_000;
/// Largest CFS quota the kernel accepts, in microseconds (`MAX_BW`:
/// 2^44 - 1).
pub const CPU_QUOTA_MAX: i64 = (1 << 44) - 1;
/// `oom_score_adj` range.
pub const OOM_SCORE_ADJ: std::ops::RangeInclusive<i64> = -1000..=1000;
/// Longest label or annotation value (kubelet's annotations stay far below).
pub const VALUE_MAX: usize = 64 * 1024;

/// No NUL byte in `v` (it would cut the string short in every C API).
pub fn no_nul(field: &str, v: &str) -> CriResult<()> {
    if v.contains('\0') {
        return Err(CriError::invalid(field, "contains a NUL byte"));
    }
    Ok(())
}

/// A path the kernel can take: at most [`PATH_MAX`] bytes, each component
/// at most [`NAME_MAX`], no NUL byte.
pub fn path_limits(field: &str, path: &str) -> CriResult<()> {
    no_nul(field, path)?;
    if path.len() > PATH_MAX {
        return Err(CriError::invalid(
            field,
            format!("{} bytes long; paths are at most {PATH_MAX}", path.len()),
        ));
    }
    if let Some(c) = path.split('/').find(|c| c.len() > NAME_MAX) {
        return Err(CriError::invalid(
            field,
            format!("a component is {} bytes long; at most {NAME_MAX}", c.len()),
        ));
    }
    Ok(())
}

/// Labels or annotations: keys non-empty, no NUL, values bounded.
pub fn string_map(field: &str, m: &std::collections::HashMap<String, String>) -> CriResult<()> {
    for (k, v) in m {
        if k.is_empty() {
            return Err(CriError::invalid(field, "a key is empty"));
        }
        no_nul(&format!("{field}[{k:?}]"), k)?;
        no_nul(&format!("{field}[{k:?}]"), v)?;
        if v.len() > VALUE_MAX {
            return Err(CriError::invalid(
                format!("{field}[{k:?}]"),
                format!("value is {} bytes long; at most {VALUE_MAX}", v.len()),
            ));
        }
    }
    Ok(())
}

/// A cgroup path: relative components below the hierarchy root, without
/// control characters (cgroupfs refuses a name with a line break).
pub fn cgroup_parent(field: &str, cg: &str) -> CriResult<()> {
    path_limits(field, cg)?;
    if cg.chars().any(char::is_control) {
        return Err(CriError::invalid(
            field,
            format!("{cg:?} contains a control character"),
        ));
    }
    if cg.split('/').any(|c| c == "..") {
        return Err(CriError::invalid(
            field,
            format!("{cg:?} must not contain '..'"),
        ));
    }
    Ok(())
}

/// A sysctl the kernel could have: `[a-z0-9_]` words joined by `.` or `/`,
/// its value on one line.
pub fn sysctl(field: &str, name: &str, value: &str) -> CriResult<()> {
    let field = format!("{field}[{name:?}]");
    let word_ok = |w: &str| {
        !w.is_empty()
            && w.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-".contains(&b))
    };
    if name.len() > NAME_MAX || !name.split(['.', '/']).all(word_ok) {
        return Err(CriError::invalid(field, "is not a sysctl name"));
    }
    if value.contains(['\0', '\n']) || value.len() > 4096 {
        return Err(CriError::invalid(
            field,
            "value must be one line of at most 4096 bytes",
        ));
    }
    Ok(())
}

/// The pod namespace a sysctl belongs to (`net`, `ipc`, `uts`), as runc
/// decides it: only these can be set in a container.
pub fn sysctl_namespace(name: &str) -> Option<&'static str> {
    const IPC: &[&str] = &[
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
    ];
    let name = name.replace('/', ".");
    if name.starts_with("net.") {
        Some("net")
    } else if name.starts_with("fs.mqueue.") || IPC.contains(&name.as_str()) {
        Some("ipc")
    } else if name == "kernel.hostname" || name == "kernel.domainname" {
        Some("uts")
    } else {
        None
    }
}

/// A cpuset list: `N`, `N-M`, comma-separated, ascending ranges.
fn cpuset(field: &str, v: &str) -> CriResult<()> {
    let bad = || CriError::invalid(field, format!("{v:?} is not a cpu/node list"));
    for part in v.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let a: u32 = a.parse().map_err(|_| bad())?;
        let b: u32 = b.parse().map_err(|_| bad())?;
        if a > b {
            return Err(bad());
        }
    }
    Ok(())
}

/// A command to exec: at least its program, which is not empty and within
/// the path limits, and no NUL byte in any argument.
pub fn exec_cmd(field: &str, cmd: &[String]) -> CriResult<()> {
    match cmd.first() {
        None => return Err(CriError::invalid(field, "must not be empty")),
        Some(p) if p.is_empty() => {
            return Err(CriError::invalid(
                format!("{field}[0]"),
                "the program is empty",
            ))
        }
        // The program is looked up as a path: the kernel's limits hold.
        Some(p) => path_limits(&format!("{field}[0]"), p)?,
    }
    for (i, a) in cmd.iter().enumerate() {
        no_nul(&format!("{field}[{i}]"), a)?;
    }
    Ok(())
}

/// `LinuxContainerResources`, as CreateContainer and UpdateContainerResources
/// send them (fields under `prefix`).
pub fn resources(prefix: &str, r: &cri::LinuxContainerResources) -> CriResult<()> {
    let field = |f: &str| format!("{prefix}.{f}");
    if r.cpu_shares != 0 && !CPU_SHARES.contains(&r.cpu_shares) {
        return Err(CriError::invalid(
            field("cpu_shares"),
            format!("{} is outside {CPU_SHARES:?} (0 = unset)", r.cpu_shares),
        ));
    }
    if r.cpu_period != 0 && !CPU_PERIOD.contains(&r.cpu_period) {
        return Err(CriError::invalid(
            field("cpu_period"),
            format!("{} µs is outside {CPU_PERIOD:?} (0 = unset)", r.cpu_period),
        ));
    }
    if r.cpu_quota != 0
        && r.cpu_quota != -1
        && !(CPU_QUOTA_MIN..=CPU_QUOTA_MAX).contains(&r.cpu_quota)
    {
        return Err(CriError::invalid(
            field("cpu_quota"),
            format!(
                "{} µs is outside {CPU_QUOTA_MIN}..={CPU_QUOTA_MAX} (0 = unset, -1 = unlimited)",
                r.cpu_quota
            ),
        ));
    }
    if r.memory_limit_in_bytes < 0 {
        return Err(CriError::invalid(
            field("memory_limit_in_bytes"),
            format!("{} is negative (0 = unset)", r.memory_limit_in_bytes),
        ));
    }
    let swap = r.memory_swap_limit_in_bytes;
    if swap > 0 && r.memory_limit_in_bytes == 0 {
        // The kernel wants memory+swap at least the memory limit, which is
        // then unlimited.
        return Err(CriError::invalid(
            field("memory_swap_limit_in_bytes"),
            format!("{swap}: a memory+swap limit needs memory_limit_in_bytes"),
        ));
    }
    if swap < -1 || (swap > 0 && swap < r.memory_limit_in_bytes) {
        return Err(CriError::invalid(
            field("memory_swap_limit_in_bytes"),
            format!(
                "{swap}: memory plus swap must be at least the memory limit {} (0 = unset, -1 = unlimited)",
                r.memory_limit_in_bytes
            ),
        ));
    }
    if !OOM_SCORE_ADJ.contains(&r.oom_score_adj) {
        return Err(CriError::invalid(
            field("oom_score_adj"),
            format!("{} is outside {OOM_SCORE_ADJ:?}", r.oom_score_adj),
        ));
    }
    if !r.cpuset_cpus.is_empty() {
        cpuset(&field("cpuset_cpus"), &r.cpuset_cpus)?;
    }
    if !r.cpuset_mems.is_empty() {
        cpuset(&field("cpuset_mems"), &r.cpuset_mems)?;
    }
    for (i, h) in r.hugepage_limits.iter().enumerate() {
        let size = h
            .page_size
            .strip_suffix("KB")
            .or_else(|| h.page_size.strip_suffix("MB"))
            .or_else(|| h.page_size.strip_suffix("GB"));
        if !size.is_some_and(|n| {
            !n.is_empty() && n.len() <= 10 && n.bytes().all(|b| b.is_ascii_digit())
        }) {
            return Err(CriError::invalid(
                format!("{prefix}.hugepage_limits[{i}].page_size"),
                format!("{:?} is not a page size like 2MB or 1GB", h.page_size),
            ));
        }
    }
    for (k, v) in &r.unified {
        let key_ok = k.len() <= NAME_MAX
            && k.split_once('.').is_some_and(|(c, f)| {
                !c.is_empty()
                    && !f.is_empty()
                    && k.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._".contains(&b))
            });
        if !key_ok {
            return Err(CriError::invalid(
                format!("{prefix}.unified[{k:?}]"),
                "is not a cgroup v2 file name",
            ));
        }
        if v.contains(['\0', '\n']) {
            return Err(CriError::invalid(
                format!("{prefix}.unified[{k:?}]"),
                "value must be one line",
            ));
        }
    }
    Ok(())
}

/// The fields of a `ContainerConfig` the create path does not check on its
/// way (names, paths and the image are checked where they are converted).
pub fn container_config(config: &cri::ContainerConfig) -> CriResult<()> {
    for (i, a) in config.command.iter().enumerate() {
        no_nul(&format!("config.command[{i}]"), a)?;
    }
    for (i, a) in config.args.iter().enumerate() {
        no_nul(&format!("config.args[{i}]"), a)?;
    }
    for (i, kv) in config.envs.iter().enumerate() {
        let field = format!("config.envs[{i}].key");
        if kv.key.is_empty() || kv.key.contains('=') {
            return Err(CriError::invalid(
                field,
                format!("{:?} is not a variable name", kv.key),
            ));
        }
        no_nul(&field, &kv.key)?;
        no_nul(&format!("config.envs[{i}].value"), &kv.value)?;
    }
    if let Some(image) = &config.image {
        no_nul("config.image.image", &image.image)?;
    }
    string_map("config.labels", &config.labels)?;
    string_map("config.annotations", &config.annotations)?;
    path_limits("config.log_path", &config.log_path)?;
    path_limits("config.working_dir", &config.working_dir)?;
    let mut seen = std::collections::HashSet::new();
    for (i, m) in config.mounts.iter().enumerate() {
        path_limits(&format!("config.mounts[{i}].host_path"), &m.host_path)?;
        let field = format!("config.mounts[{i}].container_path");
        path_limits(&field, &m.container_path)?;
        if !seen.insert(m.container_path.trim_end_matches('/')) {
            return Err(CriError::invalid(
                field,
                format!("{:?} is mounted twice", m.container_path),
            ));
        }
        recursive_read_only(i, m)?;
    }
    for (i, d) in config.devices.iter().enumerate() {
        path_limits(&format!("config.devices[{i}].host_path"), &d.host_path)?;
        path_limits(
            &format!("config.devices[{i}].container_path"),
            &d.container_path,
        )?;
        if !d.permissions.bytes().all(|b| b"rwm".contains(&b)) {
            return Err(CriError::invalid(
                format!("config.devices[{i}].permissions"),
                format!("{:?}: only r, w and m", d.permissions),
            ));
        }
    }
    if let Some(linux) = &config.linux {
        if let Some(r) = &linux.resources {
            resources("config.linux.resources", r)?;
        }
        if let Some(sc) = &linux.security_context {
            let field = "config.linux.security_context";
            if let Some(caps) = &sc.capabilities {
                for c in caps.add_capabilities.iter().chain(&caps.drop_capabilities) {
                    let ok = !c.is_empty()
                        && c.len() <= 64
                        && c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                    if !ok {
                        return Err(CriError::invalid(
                            format!("{field}.capabilities"),
                            format!("{c:?} is not a capability name"),
                        ));
                    }
                }
            }
            no_nul(&format!("{field}.run_as_username"), &sc.run_as_username)?;
            if cri::SupplementalGroupsPolicy::try_from(sc.supplemental_groups_policy).is_err() {
                return Err(CriError::invalid(
                    format!("{field}.supplemental_groups_policy"),
                    format!("unknown policy {}", sc.supplemental_groups_policy),
                ));
            }
            for (i, p) in sc.masked_paths.iter().chain(&sc.readonly_paths).enumerate() {
                path_limits(&format!("{field}.masked_paths/readonly_paths[{i}]"), p)?;
            }
        }
    }
    Ok(())
}

/// A recursive read-only mount must be read-only and private, as the CRI
/// says (and containerd refuses): a mount that receives from the host
/// (`rslave`) or propagates both ways could get writable mounts below it.
pub fn recursive_read_only(i: usize, m: &cri::Mount) -> CriResult<()> {
    if !m.recursive_read_only {
        return Ok(());
    }
    let field = format!("config.mounts[{i}].recursive_read_only");
    if !m.readonly {
        return Err(CriError::invalid(field, "needs readonly: true"));
    }
    if m.propagation != cri::MountPropagation::PropagationPrivate as i32 {
        return Err(CriError::invalid(
            field,
            "needs propagation PROPAGATION_PRIVATE (a mount that receives mounts from the host cannot stay read-only below)",
        ));
    }
    Ok(())
}

/// A container's `namespace_options.userns_options`, when it sends them
/// (kubelet copies the pod's), must be the pod's: every container of a pod
/// runs in its one user namespace.
pub fn container_userns(
    config: Option<&cri::ContainerConfig>,
    pod: &cubelet_engine::spec::NamespaceOptions,
) -> CriResult<()> {
    let field = "config.linux.security_context.namespace_options.userns_options";
    let sent = config
        .and_then(|c| c.linux.as_ref())
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .and_then(|s| s.namespace_options.as_ref())
        .and_then(|n| n.userns_options.as_ref());
    for (i, m) in config.iter().flat_map(|c| c.mounts.iter()).enumerate() {
        mount_mappings(i, m, pod)?;
    }
    let Some(sent) = sent else {
        return Ok(());
    };
    if crate::convert::user_namespace(field, Some(sent))? != pod.userns {
        return Err(CriError::invalid(
            field,
            "differs from the pod sandbox's user namespace",
        ));
    }
    Ok(())
}

/// A mount's `uid_mappings`/`gid_mappings` (kubelet sends the pod's on
/// every mount of a pod with a user namespace) must be the pod's: the mount
/// is idmapped through the pod's user namespace.
fn mount_mappings(
    i: usize,
    m: &cri::Mount,
    pod: &cubelet_engine::spec::NamespaceOptions,
) -> CriResult<()> {
    if m.uid_mappings.is_empty() && m.gid_mappings.is_empty() {
        return Ok(());
    }
    let field = format!("config.mounts[{i}].uid_mappings");
    let Some(userns) = &pod.userns else {
        return Err(CriError::invalid(
            field,
            "set, but the pod sandbox has no user namespace",
        ));
    };
    let same = |maps: &[cri::IdMapping], want: &cubelet_engine::spec::IdMapping| {
        matches!(maps, [m] if m.container_id == want.container_id
            && m.host_id == want.host_id
            && m.length == want.length)
    };
    if !same(&m.uid_mappings, &userns.uids) || !same(&m.gid_mappings, &userns.gids) {
        return Err(CriError::invalid(
            field,
            "must be the pod sandbox's user namespace mappings",
        ));
    }
    Ok(())
}

/// The fields of a `PodSandboxConfig` the sandbox conversion does not check
/// on its way.
pub fn sandbox_config(config: &cri::PodSandboxConfig) -> CriResult<()> {
    string_map("config.labels", &config.labels)?;
    string_map("config.annotations", &config.annotations)?;
    path_limits("config.log_directory", &config.log_directory)?;
    if let Some(d) = &config.dns_config {
        for (i, s) in d.searches.iter().chain(&d.options).enumerate() {
            no_nul(&format!("config.dns_config.searches/options[{i}]"), s)?;
        }
    }
    if let Some(linux) = &config.linux {
        if !linux.cgroup_parent.is_empty() {
            cgroup_parent("config.linux.cgroup_parent", &linux.cgroup_parent)?;
        }
        let ns = linux
            .security_context
            .as_ref()
            .and_then(|s| s.namespace_options.as_ref());
        let node = cri::NamespaceMode::Node as i32;
        for (k, v) in &linux.sysctls {
            sysctl("config.linux.sysctls", k, v)?;
            let field = format!("config.linux.sysctls[{k:?}]");
            let shared = match sysctl_namespace(k) {
                None => {
                    return Err(CriError::invalid(
                        field,
                        "is not a namespaced sysctl (net.*, fs.mqueue.*, the IPC kernel.* ones, kernel.hostname/domainname); runc sets no other",
                    ))
                }
                Some("net") => ns.is_some_and(|n| n.network == node),
                Some("ipc") => ns.is_some_and(|n| n.ipc == node),
                Some(_) => false,
            };
            if shared {
                return Err(CriError::invalid(
                    field,
                    "the pod shares that namespace with the node",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: CriResult<()>) -> Option<String> {
        r.err().map(|e| match e {
            CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. }) => field,
            other => panic!("not InvalidArgument: {other}"),
        })
    }

    #[test]
    fn paths_within_the_kernels_limits() {
        assert_eq!(code(path_limits("p", "/a/b")), None);
        assert_eq!(
            code(path_limits("p", &format!("/{}", "a".repeat(255)))),
            None
        );
        assert!(code(path_limits("p", &format!("/{}", "a".repeat(256)))).is_some());
        assert!(code(path_limits("p", &"/a".repeat(2100))).is_some());
        assert!(code(path_limits("p", "/a\0b")).is_some());
    }

    #[test]
    fn a_5000_character_cgroup_parent_is_refused() {
        let cg = format!("/{}", "x".repeat(5000));
        assert_eq!(
            code(cgroup_parent("config.linux.cgroup_parent", &cg)).as_deref(),
            Some("config.linux.cgroup_parent")
        );
        assert_eq!(code(cgroup_parent("c", "/kubepods/burstable/pod1")), None);
        assert!(code(cgroup_parent("c", "/a/../b")).is_some());
        assert!(code(cgroup_parent("c", "/a\nb")).is_some());
    }

    #[test]
    fn resources_runc_refuses() {
        let ok = cri::LinuxContainerResources {
            cpu_shares: 2,
            cpu_period: 100_000,
            cpu_quota: 20_000,
            memory_limit_in_bytes: 64 << 20,
            memory_swap_limit_in_bytes: 64 << 20,
            oom_score_adj: -997,
            cpuset_cpus: "0-1,3".into(),
            hugepage_limits: vec![cri::HugepageLimit {
                page_size: "2MB".into(),
                limit: 0,
            }],
            ..Default::default()
        };
        assert_eq!(code(resources("r", &ok)), None);
        type Mutation = Box<dyn Fn(&mut cri::LinuxContainerResources)>;
        let bad: Vec<(&str, Mutation)> = vec![
            ("r.cpu_shares", Box::new(|r| r.cpu_shares = 1)),
            ("r.cpu_shares", Box::new(|r| r.cpu_shares = 300_000)),
            ("r.cpu_period", Box::new(|r| r.cpu_period = 10)),
            ("r.cpu_quota", Box::new(|r| r.cpu_quota = 10)),
            ("r.cpu_quota", Box::new(|r| r.cpu_quota = i64::MAX)),
            (
                "r.memory_limit_in_bytes",
                Box::new(|r| r.memory_limit_in_bytes = -5),
            ),
            (
                "r.memory_swap_limit_in_bytes",
                Box::new(|r| r.memory_swap_limit_in_bytes = 1),
            ),
            ("r.oom_score_adj", Box::new(|r| r.oom_score_adj = 1001)),
            ("r.cpuset_cpus", Box::new(|r| r.cpuset_cpus = "3-1".into())),
            ("r.cpuset_mems", Box::new(|r| r.cpuset_mems = "a".into())),
            (
                "r.hugepage_limits[0].page_size",
                Box::new(|r| r.hugepage_limits[0].page_size = "2XB".into()),
            ),
            (
                "r.unified[\"../x\"]",
                Box::new(|r| {
                    r.unified.insert("../x".into(), "1".into());
                }),
            ),
        ];
        for (field, mutate) in bad {
            let mut r = ok.clone();
            mutate(&mut r);
            assert_eq!(code(resources("r", &r)).as_deref(), Some(field), "{r:?}");
        }
        // -1 means unlimited for quota and swap.
        let mut r = ok.clone();
        r.cpu_quota = -1;
        r.memory_swap_limit_in_bytes = -1;
        assert_eq!(code(resources("r", &r)), None);
    }

    #[test]
    fn container_configs() {
        let mut c = cri::ContainerConfig {
            command: vec!["sh".into()],
            mounts: vec![
                cri::Mount {
                    container_path: "/data".into(),
                    host_path: "/srv/a".into(),
                    ..Default::default()
                },
                cri::Mount {
                    container_path: "/data/".into(),
                    host_path: "/srv/b".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            code(container_config(&c)).as_deref(),
            Some("config.mounts[1].container_path")
        );
        c.mounts.pop();
        assert_eq!(code(container_config(&c)), None);
        c.envs.push(cri::KeyValue {
            key: "A=B".into(),
            value: String::new(),
        });
        assert_eq!(
            code(container_config(&c)).as_deref(),
            Some("config.envs[0].key")
        );
        c.envs.clear();
        c.args.push("a\0b".into());
        assert_eq!(
            code(container_config(&c)).as_deref(),
            Some("config.args[0]")
        );
    }

    #[test]
    fn sysctl_names_and_values() {
        assert_eq!(code(sysctl("s", "net.ipv4.ip_forward", "1")), None);
        assert_eq!(code(sysctl("s", "kernel/shm_rmid_forced", "1")), None);
        assert!(code(sysctl("s", "net..x", "1")).is_some());
        assert!(code(sysctl("s", "NET.x", "1")).is_some());
        assert!(code(sysctl("s", "net.x", "1\n2")).is_some());
        assert_eq!(sysctl_namespace("net.ipv4.ip_forward"), Some("net"));
        assert_eq!(sysctl_namespace("kernel/shm_rmid_forced"), Some("ipc"));
        assert_eq!(sysctl_namespace("fs.mqueue.msg_max"), Some("ipc"));
        assert_eq!(sysctl_namespace("kernel.panic"), None);
        let mut c = cri::PodSandboxConfig::default();
        let linux = c.linux.get_or_insert_with(Default::default);
        linux.sysctls.insert("kernel.panic".into(), "1".into());
        assert!(code(sandbox_config(&c)).is_some());
        let linux = c.linux.get_or_insert_with(Default::default);
        linux.sysctls.clear();
        linux
            .sysctls
            .insert("net.ipv4.ip_forward".into(), "1".into());
        assert_eq!(code(sandbox_config(&c)), None);
        let linux = c.linux.get_or_insert_with(Default::default);
        linux.security_context = Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                network: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(code(sandbox_config(&c)).is_some());
    }

    #[test]
    fn recursive_read_only_needs_readonly_and_private_propagation() {
        let rro = |readonly, propagation: cri::MountPropagation| cri::ContainerConfig {
            mounts: vec![cri::Mount {
                container_path: "/mnt".into(),
                host_path: "/srv".into(),
                readonly,
                recursive_read_only: true,
                propagation: propagation as i32,
                ..Default::default()
            }],
            ..Default::default()
        };
        let field = Some("config.mounts[0].recursive_read_only");
        use cri::MountPropagation as P;
        assert_eq!(
            code(container_config(&rro(true, P::PropagationPrivate))),
            None
        );
        assert_eq!(
            code(container_config(&rro(false, P::PropagationPrivate))).as_deref(),
            field
        );
        for p in [P::PropagationHostToContainer, P::PropagationBidirectional] {
            assert_eq!(code(container_config(&rro(true, p))).as_deref(), field);
        }
    }

    #[test]
    fn supplemental_groups_policy_must_be_known() {
        let with = |policy: i32| cri::ContainerConfig {
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    supplemental_groups_policy: policy,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(code(container_config(&with(0))), None);
        assert_eq!(code(container_config(&with(1))), None);
        assert_eq!(
            code(container_config(&with(7))).as_deref(),
            Some("config.linux.security_context.supplemental_groups_policy")
        );
    }

    #[test]
    fn a_containers_user_namespace_must_be_the_pods() {
        use cubelet_engine::spec::{IdMapping, NamespaceOptions, UserNamespace};
        let map = |host_id| cri::IdMapping {
            host_id,
            container_id: 0,
            length: 65536,
        };
        let with = |userns: Option<cri::UserNamespace>| cri::ContainerConfig {
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        userns_options: userns,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let pod_map = IdMapping {
            container_id: 0,
            host_id: 65536,
            length: 65536,
        };
        let pod = NamespaceOptions {
            userns: Some(UserNamespace {
                uids: pod_map,
                gids: pod_map,
            }),
            ..Default::default()
        };
        let pod_mode = |host_id| cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids: vec![map(host_id)],
            gids: vec![map(host_id)],
        };
        container_userns(Some(&with(None)), &pod).unwrap();
        container_userns(Some(&with(Some(pod_mode(65536)))), &pod).unwrap();
        let field = Some("config.linux.security_context.namespace_options.userns_options");
        assert_eq!(
            code(container_userns(Some(&with(Some(pod_mode(131072)))), &pod)).as_deref(),
            field
        );
        let node = cri::UserNamespace {
            mode: cri::NamespaceMode::Node as i32,
            ..Default::default()
        };
        assert_eq!(
            code(container_userns(Some(&with(Some(node.clone()))), &pod)).as_deref(),
            field
        );
        container_userns(Some(&with(Some(node))), &NamespaceOptions::default()).unwrap();
        // Mount mappings: the pod's, or none.
        let mount = |host_id: Option<u32>| cri::ContainerConfig {
            mounts: vec![cri::Mount {
                container_path: "/v".into(),
                host_path: "/srv/v".into(),
                uid_mappings: host_id.map(map).into_iter().collect(),
                gid_mappings: host_id.map(map).into_iter().collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        container_userns(Some(&mount(None)), &pod).unwrap();
        container_userns(Some(&mount(Some(65536))), &pod).unwrap();
        let field = Some("config.mounts[0].uid_mappings");
        assert_eq!(
            code(container_userns(Some(&mount(Some(1))), &pod)).as_deref(),
            field
        );
        assert_eq!(
            code(container_userns(
                Some(&mount(Some(65536))),
                &NamespaceOptions::default()
            ))
            .as_deref(),
            field
        );
    }
}
