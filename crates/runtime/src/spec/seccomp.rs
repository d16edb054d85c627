//! Seccomp: Cubelet's `RuntimeDefault` filter and `Localhost` profiles.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompBuilder, LinuxSyscallBuilder,
};

use super::model::SeccompProfile;
use super::oci_err;
use crate::error::RuntimeError;

/// Syscalls the `RuntimeDefault` seccomp profile refuses with `EPERM`.
///
/// Cubelet's RuntimeDefault is deliberately small: allow by default, deny the
/// syscalls that no ordinary container needs and that Docker's profile also
/// refuses without extra capabilities (kernel modules, kexec, reboot, swap,
/// accounting, clock changes, keyrings, mounts, new namespaces, BPF, perf).
/// It is not Docker's full allow-list profile; `ptrace` and NUMA calls are
/// left to capabilities.
pub const RUNTIME_DEFAULT_DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "get_kernel_syms",
    "init_module",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "nfsservctl",
    "open_by_handle_at",
    "perf_event_open",
    "pivot_root",
    "query_module",
    "quotactl",
    "reboot",
    "request_key",
    "settimeofday",
    "stime",
    "swapoff",
    "swapon",
    "_sysctl",
    "sysfs",
    "umount",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vm86",
    "vm86old",
];

/// The `RuntimeDefault` seccomp filter.
pub fn runtime_default_seccomp() -> Result<LinuxSeccomp, RuntimeError> {
    let deny = LinuxSyscallBuilder::default()
        .names(
            RUNTIME_DEFAULT_DENIED_SYSCALLS
                .iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>(),
        )
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(1u32)
        .build()
        .map_err(oci_err("seccomp"))?;
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        // Without the compat ABIs the deny list could be bypassed through them.
        .architectures(vec![
            Arch::ScmpArchX86_64,
            Arch::ScmpArchX86,
            Arch::ScmpArchX32,
        ])
        .syscalls(vec![deny])
        .build()
        .map_err(oci_err("seccomp"))
}

/// The filter for `profile`: none when unconfined, Cubelet's
/// `RuntimeDefault`, or the OCI `LinuxSeccomp` JSON of a `Localhost` file.
pub(super) fn seccomp_filter(
    profile: &SeccompProfile,
) -> Result<Option<LinuxSeccomp>, RuntimeError> {
    match profile {
        SeccompProfile::Unconfined => Ok(None),
        SeccompProfile::RuntimeDefault => runtime_default_seccomp().map(Some),
        SeccompProfile::Localhost(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
                op: "read seccomp profile",
                path: path.display().to_string(),
                source,
            })?;
            let profile: LinuxSeccomp =
                serde_json::from_str(&text).map_err(|e| RuntimeError::InvalidArgument {
                    field: "seccomp.localhost_ref".to_owned(),
                    reason: format!("{}: {e}", path.display()),
                })?;
            Ok(Some(profile))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{linux_resources, HugepageLimit, Resources};

    #[test]
    fn seccomp_runtime_default_denies_and_resources_convert() {
        let sc = runtime_default_seccomp().unwrap();
        assert_eq!(sc.default_action(), LinuxSeccompAction::ScmpActAllow);
        let json = serde_json::to_string(&sc).unwrap();
        assert!(json.contains("kexec_load"), "{json}");
        let r = linux_resources(&Resources {
            cpu_shares: 512,
            cpu_quota: 50_000,
            cpu_period: 100_000,
            memory_limit: 64 << 20,
            hugepages: vec![HugepageLimit {
                page_size: "2MB".into(),
                limit: 1 << 21,
            }],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.cpu().as_ref().unwrap().shares(), Some(512));
        assert_eq!(r.memory().as_ref().unwrap().limit(), Some(64 << 20));
        assert_eq!(r.hugepage_limits().as_ref().unwrap().len(), 1);
    }
}
