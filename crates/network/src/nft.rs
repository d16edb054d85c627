//! nftables rules through the `nft` binary: masquerade and forwarding for the
//! bridge subnet, DNAT rules for host ports, and the loopback guard.
//!
//! The bridge has `route_localnet` on (host ports on 127.0.0.1 need it), so
//! the guard drops, before any DNAT, every packet that arrives on an
//! interface other than `lo` for 127.0.0.0/8: a pod crafting packets to
//! the node's 127.0.0.1 (CVE-2020-8558) gets no answer, and a host port on
//! 127.0.0.1 is reachable from the node only, never from a pod or an L2
//! neighbour. Replies to the node's own connections to such a host port
//! still arrive addressed to the bridge (they are un-NATed later), so they
//! pass.
//!
//! Everything lives in one table per bridge (`cubelet_<bridge>`), so
//! configurations (and tests) with different bridges never touch each other's
//! rules. Host-port rules carry a comment `cubelet:<sandbox>:<proto>:<port>`
//! from which ownership is recovered after a restart.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use cubelet_engine::spec::PortMapping;
use cubelet_engine::SandboxId;
use ipnet::Ipv4Net;
use tokio::io::AsyncWriteExt;

use crate::error::NetworkError;

const COMMENT_PREFIX: &str = "cubelet:";

/// Finds the `nft` binary in `PATH` or the usual sbin directories.
pub(crate) fn find_nft() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join("nft"))
        .find(|p| p.is_file())
}

/// The nftables table (family `ip`) for bridge `bridge`.
pub fn table_name(bridge: &str) -> String {
    let clean: String = bridge
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("cubelet_{clean}")
}

/// Runs `nft -f -` with `script` on stdin; returns stdout.
async fn run(
    nft: &Path,
    op: &'static str,
    args: &[&str],
    script: &str,
) -> Result<String, NetworkError> {
    let mut child = tokio::process::Command::new(nft)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| NetworkError::io("run", nft, e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(|e| NetworkError::io("write to", nft, e))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| NetworkError::io("wait for", nft, e))?;
    if !out.status.success() {
        return Err(NetworkError::Nft {
            op,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Installs (or refreshes) the base chains: masquerade for traffic leaving
/// the subnet and for pod-to-host-port-to-pod (hairpin) traffic, forwarding
/// to and from the bridge, the loopback guard (priority -150: after
/// conntrack, before DNAT), and the jumps into the host-port chain. Host-port rules already present are kept, so a restart
/// does not cut running pods off.
pub(crate) async fn ensure_base(
    nft: &Path,
    table: &str,
    bridge: &str,
    subnet: Ipv4Net,
) -> Result<(), NetworkError> {
    let t = format!("ip {table}");
    let script = format!(
        "add table {t}\n\
         add chain {t} postrouting {{ type nat hook postrouting priority 100; policy accept; }}\n\
         flush chain {t} postrouting\n\
         add rule {t} postrouting ip saddr {subnet} ip daddr != {subnet} masquerade\n\
         add rule {t} postrouting ip saddr {subnet} ip daddr {subnet} ct status dnat masquerade\n\
         add rule {t} postrouting ip saddr 127.0.0.0/8 ct status dnat masquerade\n\
         add chain {t} forward {{ type filter hook forward priority 0; policy accept; }}\n\
         flush chain {t} forward\n\
         add rule {t} forward iifname \"{bridge}\" accept\n\
         add rule {t} forward oifname \"{bridge}\" accept\n\
         add chain {t} localnet {{ type filter hook prerouting priority -150; policy accept; }}\n\
         flush chain {t} localnet\n\
         add rule {t} localnet iifname != \"lo\" ip daddr 127.0.0.0/8 drop\n\
         add chain {t} hostports\n\
         add chain {t} prerouting {{ type nat hook prerouting priority -100; policy accept; }}\n\
         flush chain {t} prerouting\n\
         add rule {t} prerouting fib daddr type local jump hostports\n\
         add chain {t} output {{ type nat hook output priority -100; policy accept; }}\n\
         flush chain {t} output\n\
         add rule {t} output fib daddr type local jump hostports\n"
    );
    run(nft, "install base rules", &["-f", "-"], &script)
        .await
        .map(|_| ())
}

/// One host-port rule as found in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostPortRule {
    pub(crate) owner: String,
    pub(crate) protocol: String,
    pub(crate) host_port: u16,
    pub(crate) handle: u64,
}

/// Parses `nft -a list chain` output for our tagged rules.
pub(crate) fn parse_rules(listing: &str) -> Vec<HostPortRule> {
    listing
        .lines()
        .filter_map(|line| {
            let start = line.find(&format!("comment \"{COMMENT_PREFIX}"))?;
            let tag = line[start + "comment \"".len()..].split('"').next()?;
            let mut parts = tag.strip_prefix(COMMENT_PREFIX)?.split(':');
            let owner = parts.next()?.to_owned();
            let protocol = parts.next()?.to_owned();
            let host_port = parts.next()?.parse().ok()?;
            let handle = line.rsplit("# handle ").next()?.trim().parse().ok()?;
            Some(HostPortRule {
                owner,
                protocol,
                host_port,
                handle,
            })
        })
        .collect()
}

/// Lists our host-port rules. A missing table or chain means none.
pub(crate) async fn list_host_ports(
    nft: &Path,
    table: &str,
) -> Result<Vec<HostPortRule>, NetworkError> {
    match run(
        nft,
        "list host ports",
        &["-a", "list", "chain", "ip", table, "hostports"],
        "",
    )
    .await
    {
        Ok(out) => Ok(parse_rules(&out)),
        Err(NetworkError::Nft { stderr, .. }) if stderr.contains("No such file or directory") => {
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// Adds DNAT rules forwarding each mapping to `pod_ip`, after checking that no
/// other sandbox holds the same protocol and host port.
pub(crate) async fn add_host_ports(
    nft: &Path,
    table: &str,
    sandbox: &SandboxId,
    pod_ip: Ipv4Addr,
    mappings: &[PortMapping],
) -> Result<(), NetworkError> {
    let existing = list_host_ports(nft, table).await?;
    let mut script = String::new();
    for m in mappings {
        let proto = m.protocol.as_str();
        if let Some(r) = existing.iter().find(|r| {
            r.protocol == proto && r.host_port == m.host_port && r.owner != sandbox.as_str()
        }) {
            return Err(NetworkError::PortConflict {
                protocol: proto,
                host_port: m.host_port,
                owner: r.owner.clone(),
            });
        }
        if existing.iter().any(|r| {
            r.protocol == proto && r.host_port == m.host_port && r.owner == sandbox.as_str()
        }) {
            continue; // already installed by an earlier attempt
        }
        let daddr = match m.host_ip {
            None => String::new(),
            Some(IpAddr::V4(ip)) if ip.is_unspecified() => String::new(),
            Some(IpAddr::V4(ip)) => format!("ip daddr {ip} "),
            Some(ip @ IpAddr::V6(_)) => {
                return Err(NetworkError::UnsupportedPortMapping { host_ip: ip })
            }
        };
        script.push_str(&format!(
            "add rule ip {table} hostports {daddr}{proto} dport {hp} dnat to {pod_ip}:{cp} comment \"{COMMENT_PREFIX}{sandbox}:{proto}:{hp}\"\n",
            hp = m.host_port,
            cp = m.container_port,
        ));
    }
    if script.is_empty() {
        return Ok(());
    }
    run(nft, "add host ports", &["-f", "-"], &script)
        .await
        .map(|_| ())
}

/// Deletes the given rules (by handle).
pub(crate) async fn delete_rules(
    nft: &Path,
    table: &str,
    rules: &[HostPortRule],
) -> Result<(), NetworkError> {
    if rules.is_empty() {
        return Ok(());
    }
    let script: String = rules
        .iter()
        .map(|r| format!("delete rule ip {table} hostports handle {}\n", r.handle))
        .collect();
    run(nft, "delete host ports", &["-f", "-"], &script)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tagged_rules_only() {
        let listing = "table ip cubelet_cbt0 {\n\tchain hostports { # handle 3\n\
            \t\ttcp dport 8080 dnat to 10.1.0.2:80 comment \"cubelet:abc:tcp:8080\" # handle 7\n\
            \t\tudp dport 53 dnat to 10.1.0.3:53 # handle 8\n\
            \t\tip daddr 1.2.3.4 udp dport 5353 dnat to 10.1.0.3:53 comment \"cubelet:d-e:udp:5353\" # handle 12\n\
            \t}\n}\n";
        let rules = parse_rules(listing);
        assert_eq!(
            rules,
            vec![
                HostPortRule {
                    owner: "abc".into(),
                    protocol: "tcp".into(),
                    host_port: 8080,
                    handle: 7
                },
                HostPortRule {
                    owner: "d-e".into(),
                    protocol: "udp".into(),
                    host_port: 5353,
                    handle: 12
                },
            ]
        );
    }

    #[test]
    fn table_names_are_identifiers() {
        assert_eq!(table_name("cubelet0"), "cubelet_cubelet0");
        assert_eq!(table_name("br-x.1"), "cubelet_br_x_1");
    }
}
