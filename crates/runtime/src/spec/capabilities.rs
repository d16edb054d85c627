//! Capabilities: Docker's default set, `add`/`drop` (with `ALL`), and "all"
//! bounded by what the agent itself may hold.

use oci_spec::runtime::{Capabilities, Capability};

use super::model::ContainerSpec;
use crate::error::RuntimeError;

/// Docker's default capability set, granted unless dropped.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

fn parse_caps(names: &[String], field: &str) -> Result<Vec<Capability>, RuntimeError> {
    names
        .iter()
        .map(|n| {
            serde_json::from_value::<Capability>(serde_json::Value::String(n.clone())).map_err(
                |e| RuntimeError::InvalidArgument {
                    field: field.to_owned(),
                    reason: format!("{n:?}: {e}"),
                },
            )
        })
        .collect()
}

/// Every capability with its kernel number.
const CAPABILITY_BITS: [(&str, u32); 41] = [
    ("CHOWN", 0),
    ("DAC_OVERRIDE", 1),
    ("DAC_READ_SEARCH", 2),
    ("FOWNER", 3),
    ("FSETID", 4),
    ("KILL", 5),
    ("SETGID", 6),
    ("SETUID", 7),
    ("SETPCAP", 8),
    ("LINUX_IMMUTABLE", 9),
    ("NET_BIND_SERVICE", 10),
    ("NET_BROADCAST", 11),
    ("NET_ADMIN", 12),
    ("NET_RAW", 13),
    ("IPC_LOCK", 14),
    ("IPC_OWNER", 15),
    ("SYS_MODULE", 16),
    ("SYS_RAWIO", 17),
    ("SYS_CHROOT", 18),
    ("SYS_PTRACE", 19),
    ("SYS_PACCT", 20),
    ("SYS_ADMIN", 21),
    ("SYS_BOOT", 22),
    ("SYS_NICE", 23),
    ("SYS_RESOURCE", 24),
    ("SYS_TIME", 25),
    ("SYS_TTY_CONFIG", 26),
    ("MKNOD", 27),
    ("LEASE", 28),
    ("AUDIT_WRITE", 29),
    ("AUDIT_CONTROL", 30),
    ("SETFCAP", 31),
    ("MAC_OVERRIDE", 32),
    ("MAC_ADMIN", 33),
    ("SYSLOG", 34),
    ("WAKE_ALARM", 35),
    ("BLOCK_SUSPEND", 36),
    ("AUDIT_READ", 37),
    ("PERFMON", 38),
    ("BPF", 39),
    ("CHECKPOINT_RESTORE", 40),
];

/// The agent's own capability bounding set (`CapBnd` in /proc/self/status);
/// everything when it cannot be read.
fn bounding_set() -> u64 {
    static SET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_cap_bnd(&s))
            .unwrap_or(u64::MAX)
    })
}

fn parse_cap_bnd(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// "All" capabilities for privileged containers and `add: [ALL]`: those the
/// agent itself may hold, as containerd does. A node (or a container the
/// agent runs in) with a reduced bounding set cannot grant the others, and
/// asking runc for them fails the container.
fn all_caps() -> Capabilities {
    all_caps_within(bounding_set())
}

fn all_caps_within(bounding: u64) -> Capabilities {
    let mut set = Capabilities::new();
    for (name, bit) in CAPABILITY_BITS {
        if bounding & (1u64 << bit) == 0 {
            continue;
        }
        if let Ok(c) = serde_json::from_value::<Capability>(serde_json::Value::String(name.into()))
        {
            set.insert(c);
        }
    }
    set
}

/// The capability set after defaults, add and drop (`ALL` accepted in both).
pub fn effective_capabilities(spec: &ContainerSpec) -> Result<Capabilities, RuntimeError> {
    if spec.privileged {
        return Ok(all_caps());
    }
    let is_all = |v: &[String]| v.iter().any(|c| c.eq_ignore_ascii_case("ALL"));
    let mut set: Capabilities = if is_all(&spec.capabilities_add) {
        all_caps()
    } else {
        let defaults: Vec<String> = DEFAULT_CAPABILITIES
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let mut s: Capabilities = parse_caps(&defaults, "capabilities")?.into_iter().collect();
        s.extend(parse_caps(
            &spec.capabilities_add,
            "capabilities.add_capabilities",
        )?);
        s
    };
    if is_all(&spec.capabilities_drop) {
        set.clear();
        // "drop ALL, add X" keeps X.
        if !is_all(&spec.capabilities_add) {
            set.extend(parse_caps(
                &spec.capabilities_add,
                "capabilities.add_capabilities",
            )?);
        }
    } else {
        for c in parse_caps(&spec.capabilities_drop, "capabilities.drop_capabilities")? {
            set.remove(&c);
        }
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::{image, strs};

    #[test]
    fn all_caps_stay_within_the_bounding_set() {
        let status = "Name:\tx\nCapBnd:\t000001fffeffffff\nCapAmb:\t0\n";
        let bnd = parse_cap_bnd(status).unwrap();
        let caps = all_caps_within(bnd);
        assert!(!caps.contains(&Capability::SysResource));
        assert!(caps.contains(&Capability::SysAdmin));
        assert_eq!(caps.len(), 40);
        assert_eq!(all_caps_within(u64::MAX).len(), 41);
    }

    #[test]
    fn capabilities_add_drop_and_privileged() {
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            capabilities_add: strs(&["NET_ADMIN"]),
            capabilities_drop: strs(&["CAP_KILL"]),
            ..Default::default()
        };
        let caps = effective_capabilities(&s).unwrap();
        assert!(caps.contains(&Capability::NetAdmin));
        assert!(!caps.contains(&Capability::Kill));
        assert!(caps.contains(&Capability::Chown));
        s.capabilities_drop = strs(&["ALL"]);
        assert_eq!(
            effective_capabilities(&s).unwrap(),
            [Capability::NetAdmin].into_iter().collect()
        );
        s.capabilities_add = strs(&["NOT_A_CAP"]);
        assert!(effective_capabilities(&s).is_err());
        s.privileged = true;
        assert!(effective_capabilities(&s)
            .unwrap()
            .contains(&Capability::SysAdmin));
    }
}
