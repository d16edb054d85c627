//! The small files a pod gets bind-mounted into `/etc`: `hostname`, `hosts`
//! and `resolv.conf`. Rendering is pure; writing rewrites the file in place
//! so that a bind mount of it keeps seeing the new content.

use std::fs;
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use cubelet_engine::spec::DnsConfig;
use nix::fcntl::OFlag;

use crate::error::StorageError;
use crate::paths::SandboxPaths;

/// Mode of the files written here.
const FILE_MODE: u32 = 0o644;

/// Checks a value that ends up as one token of a line in `/etc/hosts` or
/// `resolv.conf`: not empty, no whitespace or control characters (which
/// would let a request inject lines), no `/`.
fn check_token(field: &'static str, value: &str) -> Result<(), StorageError> {
    let refuse = |reason| StorageError::InvalidArgument {
        field,
        value: value.to_owned(),
        reason,
    };
    if value.is_empty() {
        return Err(refuse("must not be empty"));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(refuse("must not contain whitespace or control characters"));
    }
    if value.contains('/') {
        return Err(refuse("must not contain `/`"));
    }
    Ok(())
}

/// Checks the pod's hostname before it is written anywhere.
pub fn validate_hostname(hostname: &str) -> Result<(), StorageError> {
    check_token("hostname", hostname)?;
    if hostname.len() > 253 {
        return Err(StorageError::InvalidArgument {
            field: "hostname",
            value: hostname.to_owned(),
            reason: "must be at most 253 characters",
        });
    }
    Ok(())
}

/// Checks every entry of the pod's DNS settings before they are written.
pub fn validate_dns(dns: &DnsConfig) -> Result<(), StorageError> {
    for server in &dns.servers {
        check_token("dns.servers", server)?;
    }
    for search in &dns.searches {
        check_token("dns.searches", search)?;
    }
    for option in &dns.options {
        check_token("dns.options", option)?;
    }
    Ok(())
}

/// Content of the pod's `hostname` file.
pub fn render_hostname(hostname: &str) -> String {
    format!("{hostname}\n")
}

/// Content of the pod's `hosts` file: the loopback names, then the hostname
/// on each pod address, or on `127.0.1.1` while no address is known (the
/// storage step runs beside the network step, before the pod has an IP).
pub fn render_hosts(hostname: &str, ips: &[IpAddr]) -> String {
    let mut out = String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    if ips.is_empty() {
        out.push_str(&format!("127.0.1.1\t{hostname}\n"));
    }
    for ip in ips {
        out.push_str(&format!("{ip}\t{hostname}\n"));
    }
    out
}

/// Content of the pod's `resolv.conf` for explicit DNS settings: one
/// `nameserver` line per server, one `search` line and one `options` line
/// (each left out when empty). Empty settings render as an empty string,
/// which the provider treats as "use the node's resolv.conf".
pub fn render_resolv_conf(dns: &DnsConfig) -> String {
    let mut out = String::new();
    for server in &dns.servers {
        out.push_str(&format!("nameserver {server}\n"));
    }
    if !dns.searches.is_empty() {
        out.push_str(&format!("search {}\n", dns.searches.join(" ")));
    }
    if !dns.options.is_empty() {
        out.push_str(&format!("options {}\n", dns.options.join(" ")));
    }
    out
}

/// Writes `content` to `path` in place (truncate, write), never following
/// a symlink at `path`, creating the file with mode 0644. Not synced: the
/// files serve the sandbox's containers while it lives, the page cache
/// keeps them across an agent's crash, and a node's crash ends the
/// sandbox (kubelet and containerd's CRI write theirs without a sync
/// too). The three fdatasyncs (about 0.12 ms each on the development VM)
/// cost as much as the rest of the storage step.
pub(crate) fn write_file(path: &Path, content: &[u8]) -> Result<(), StorageError> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(path)
        .map_err(|e| StorageError::io("open", path, e))?;
    file.write_all(content)
        .map_err(|e| StorageError::io("write", path, e))
}

/// Rewrites `<dir>/hosts` for `hostname` and the pod's addresses. The
/// storage step writes it without addresses; the caller calls this again
/// once the network step has published the pod IPs. `dir` is the sandbox
/// directory ([`SandboxPaths::dir`]).
pub fn write_hosts(dir: &Path, hostname: &str, ips: &[IpAddr]) -> Result<(), StorageError> {
    validate_hostname(hostname)?;
    write_file(&dir.join("hosts"), render_hosts(hostname, ips).as_bytes())
}

/// Writes the pod's `resolv.conf`: rendered from `dns` when given and not
/// empty, else a copy of `host_resolv_conf`.
pub(crate) fn write_resolv_conf(
    paths: &SandboxPaths,
    dns: Option<&DnsConfig>,
    host_resolv_conf: &Path,
) -> Result<(), StorageError> {
    let rendered = dns.map(render_resolv_conf).unwrap_or_default();
    let content = if rendered.is_empty() {
        match fs::read(host_resolv_conf) {
            Ok(c) => c,
            // A node without resolv.conf gives its pods an empty one, as
            // the glibc resolver then falls back to localhost.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StorageError::io("read", host_resolv_conf, e)),
        }
    } else {
        rendered.into_bytes()
    };
    write_file(&paths.resolv_conf, &content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_without_ips_uses_loopback_alias() {
        let s = render_hosts("web-0", &[]);
        assert_eq!(
            s,
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tweb-0\n"
        );
    }

    #[test]
    fn hosts_with_ips_lists_each() {
        let ips: Vec<IpAddr> = vec!["10.86.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        let s = render_hosts("web-0", &ips);
        assert!(s.contains("10.86.0.5\tweb-0\n"));
        assert!(s.contains("fd00::5\tweb-0\n"));
        assert!(!s.contains("127.0.1.1"));
        assert!(s.starts_with("127.0.0.1\tlocalhost\n"));
    }

    #[test]
    fn resolv_conf_from_dns() {
        let dns = DnsConfig {
            servers: vec!["10.96.0.10".into(), "10.96.0.11".into()],
            searches: vec!["ns.svc.cluster.local".into(), "svc.cluster.local".into()],
            options: vec!["ndots:5".into(), "edns0".into()],
        };
        assert_eq!(
            render_resolv_conf(&dns),
            "nameserver 10.96.0.10\nnameserver 10.96.0.11\n\
             search ns.svc.cluster.local svc.cluster.local\noptions ndots:5 edns0\n"
        );
    }

    #[test]
    fn resolv_conf_leaves_out_empty_lines() {
        let dns = DnsConfig {
            servers: vec!["1.1.1.1".into()],
            ..Default::default()
        };
        assert_eq!(render_resolv_conf(&dns), "nameserver 1.1.1.1\n");
        assert_eq!(render_resolv_conf(&DnsConfig::default()), "");
    }

    #[test]
    fn injection_is_refused() {
        let dns = DnsConfig {
            servers: vec!["1.1.1.1\nnameserver 6.6.6.6".into()],
            ..Default::default()
        };
        assert!(matches!(
            validate_dns(&dns),
            Err(StorageError::InvalidArgument {
                field: "dns.servers",
                ..
            })
        ));
        let dns = DnsConfig {
            options: vec!["".into()],
            ..Default::default()
        };
        assert!(validate_dns(&dns).is_err());
        assert!(validate_hostname("a b").is_err());
        assert!(validate_hostname("").is_err());
        assert!(validate_hostname("../x").is_err());
        assert!(validate_hostname(&"a".repeat(254)).is_err());
        validate_hostname("web-0.example").unwrap();
    }

    #[test]
    fn write_hosts_rewrites_in_place() {
        let dir = tempfile::tempdir().unwrap();
        write_hosts(dir.path(), "h", &[]).unwrap();
        let before = fs::metadata(dir.path().join("hosts")).unwrap();
        write_hosts(dir.path(), "h", &["10.0.0.2".parse().unwrap()]).unwrap();
        let after = fs::metadata(dir.path().join("hosts")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            before.ino(),
            after.ino(),
            "a bind mount of the file must see the update"
        );
        let s = fs::read_to_string(dir.path().join("hosts")).unwrap();
        assert!(s.ends_with("10.0.0.2\th\n"), "{s}");
    }

    #[test]
    fn write_file_does_not_follow_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("hosts")).unwrap();
        assert!(write_hosts(dir.path(), "h", &[]).is_err());
        assert_eq!(fs::read_to_string(&target).unwrap(), "keep");
    }
}
