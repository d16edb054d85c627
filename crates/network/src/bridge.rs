//! The `network` flow provider on a Linux bridge: one network namespace and
//! one veth pair per sandbox, addresses from [`Ipam`], NAT through nftables.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use cubelet_engine::spec::{NetworkStatus, PortMapping, UserNamespace};
use cubelet_engine::{Flow, FlowContext, LiveSandboxes, SandboxId, StepError};
use futures::TryStreamExt;
use ipnet::Ipv4Net;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVeth, LinkAttribute,
    LinkExtentMask, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::RouteAttribute;
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, LinkBridge, LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::create::{self, InFlight};
use crate::error::{netlink_errno, NetworkError};
use crate::ipam::Ipam;
use crate::lease::LeaseStore;
use crate::{netns, nft};
use tracing::Instrument;

/// Name of the pod's interface inside its namespace.
pub const POD_INTERFACE: &str = "eth0";
/// Prefix of host-side veth names.
pub const VETH_PREFIX: &str = "cb";

/// Configuration of the bridge provider (`network.bridge` in the config file,
/// plus the node's `state_dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeConfig {
    /// Bridge name (`cubelet0`); also names the lease pool and the nftables table.
    pub name: String,
    /// Pod subnet (`10.86.0.0/16`); the bridge takes its first host address.
    pub subnet: Ipv4Net,
    /// MTU of the bridge and of both veth ends.
    pub mtu: u32,
    /// Volatile state directory; namespaces are pinned under `<state_dir>/netns`.
    pub state_dir: PathBuf,
}

/// The parts of `create`, in order. Used by the failure-injection hook
/// ([`BridgeNetwork::fail_after`]) to test rollback after each of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubStep {
    /// The namespace exists and is pinned.
    NetnsCreated,
    /// The veth pair exists, host end on the bridge, peer in the namespace.
    VethCreated,
    /// An address is leased.
    LeaseTaken,
    /// Address and default route are set inside the namespace.
    AddressSet,
    /// Host-port rules are installed.
    PortsMapped,
}

/// What [`BridgeNetwork::gc`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Namespace pins removed.
    pub netns: usize,
    /// Host veths removed.
    pub veths: usize,
    /// Address leases released.
    pub leases: usize,
    /// Host-port rules removed.
    pub port_rules: usize,
}

impl GcReport {
    /// Total number of objects reclaimed.
    pub fn total(&self) -> usize {
        self.netns + self.veths + self.leases + self.port_rules
    }
}

/// The host-side veth name for a sandbox: `cb` + the id's first 11 characters.
pub fn veth_name(sandbox: &SandboxId) -> String {
    let id = sandbox.as_str();
    let cut = id.char_indices().nth(11).map_or(id.len(), |(i, _)| i);
    format!("{VETH_PREFIX}{}", &id[..cut])
}

/// The bridge network provider. See the crate documentation.
pub struct BridgeNetwork {
    config: BridgeConfig,
    ipam: Ipam,
    netns_dir: PathBuf,
    table: String,
    /// Serialises host-port checks and updates (check-then-add must not race).
    ports: tokio::sync::Mutex<()>,
    /// Sandboxes whose create is running; `gc` treats them as live.
    in_flight: InFlight,
    failpoint: Mutex<Option<SubStep>>,
}

/// Locks a std mutex whose data stays consistent even if a holder panicked
/// (every update is a single assignment).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for BridgeNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeNetwork")
            .field("config", &self.config)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl BridgeNetwork {
    /// A provider for `config`, keeping leases in `leases`. Nothing is touched
    /// until [`Flow::init`].
    pub fn new(config: BridgeConfig, leases: Arc<dyn LeaseStore>) -> Result<Self, NetworkError> {
        let name_ok = !config.name.is_empty()
            && config.name.len() <= 15
            && config
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !name_ok {
            return Err(NetworkError::InvalidConfig {
                reason: format!(
                    "bridge name {:?} must be 1-15 characters of [A-Za-z0-9._-]",
                    config.name
                ),
            });
        }
        if !(68..=65535).contains(&config.mtu) {
            return Err(NetworkError::InvalidConfig {
                reason: format!("mtu {} out of range 68-65535", config.mtu),
            });
        }
        if !config.state_dir.is_absolute() {
            return Err(NetworkError::InvalidConfig {
                reason: format!("state_dir {} must be absolute", config.state_dir.display()),
            });
        }
        let ipam = Ipam::new(config.name.clone(), config.subnet, leases)?;
        Ok(Self {
            netns_dir: config.state_dir.join("netns"),
            table: nft::table_name(&config.name),
            ipam,
            config,
            ports: tokio::sync::Mutex::new(()),
            in_flight: InFlight::default(),
            failpoint: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BridgeConfig {
        &self.config
    }

    /// The address allocator.
    pub fn ipam(&self) -> &Ipam {
        &self.ipam
    }

    /// The gateway address (held by the bridge).
    pub fn gateway(&self) -> Ipv4Addr {
        self.ipam.gateway()
    }

    /// Where the namespace of `sandbox` is pinned.
    pub fn netns_path(&self, sandbox: &SandboxId) -> PathBuf {
        self.netns_dir.join(sandbox.as_str())
    }

    /// The nftables table this provider owns (`ip` family).
    pub fn nft_table(&self) -> &str {
        &self.table
    }

    /// Test hook: make `create` fail right after `step` (then roll back as
    /// for any other failure). `None` disables it.
    #[doc(hidden)]
    pub fn fail_after(&self, step: Option<SubStep>) {
        *lock(&self.failpoint) = step;
    }

    fn check_failpoint(&self, step: SubStep, sandbox: &SandboxId) -> Result<(), NetworkError> {
        let armed = *lock(&self.failpoint);
        if armed == Some(step) {
            return Err(NetworkError::Injected {
                step,
                sandbox: sandbox.clone(),
            });
        }
        Ok(())
    }

    fn nft(&self) -> Result<PathBuf, NetworkError> {
        nft::find_nft().ok_or(NetworkError::NftMissing)
    }

    /// Prepares the node: bridge with the gateway address, forwarding, NAT
    /// rules, the pin directory, and the lease state. Idempotent. Refuses a
    /// subnet another route or interface address overlaps ([`crate::check_subnet`]).
    pub async fn setup(&self) -> Result<(), NetworkError> {
        let nft = self.nft()?;
        crate::overlap::check_subnet(&self.config.name, self.config.subnet).await?;
        let handle = host_handle()?;
        let name = &self.config.name;
        let index = match link_message(&handle, name).await? {
            Some(m) if is_bridge(&m) => m.header.index,
            Some(_) => {
                return Err(NetworkError::InvalidConfig {
                    reason: format!("link {name} exists and is not a bridge"),
                })
            }
            None => {
                let msg = LinkBridge::new(name).mtu(self.config.mtu).build();
                exists_ok(
                    handle.link().add(msg).execute().await,
                    "add bridge",
                    name.as_str(),
                )?;
                link_index(&handle, name)
                    .await?
                    .ok_or_else(|| NetworkError::LinkNotFound { name: name.clone() })?
            }
        };
        handle
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .mtu(self.config.mtu)
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| NetworkError::netlink("set up", name.as_str(), e))?;
        fix_address(&handle, index, name).await?;
        let gw = self.gateway();
        let prefix = self.config.subnet.prefix_len();
        exists_ok(
            handle
                .address()
                .add(index, IpAddr::V4(gw), prefix)
                .execute()
                .await,
            "add address",
            format!("{gw}/{prefix} on {name}"),
        )?;
        let fwd = Path::new("/proc/sys/net/ipv4/ip_forward");
        std::fs::write(fwd, b"1").map_err(|e| NetworkError::io("enable forwarding in", fwd, e))?;
        // Host ports on 127.0.0.1: locally generated traffic from a loopback
        // source may only leave through the bridge with route_localnet; the
        // postrouting rule then masquerades it to the bridge address. The
        // `localnet` chain of `ensure_base` drops what route_localnet would
        // otherwise let in: packets for 127.0.0.0/8 from anywhere but `lo`.
        let localnet = PathBuf::from(format!("/proc/sys/net/ipv4/conf/{name}/route_localnet"));
        std::fs::write(&localnet, b"1")
            .map_err(|e| NetworkError::io("enable route_localnet in", &localnet, e))?;
        nft::ensure_base(&nft, &self.table, name, self.config.subnet.trunc()).await?;
        netns::prepare_dir(&self.netns_dir)?;
        let n = self.ipam.load()?;
        tracing::info!(bridge = %name, subnet = %self.config.subnet, leases = n, "bridge network ready");
        Ok(())
    }

    /// Builds the sandbox's network and returns what it publishes. On
    /// failure, whatever was built is removed again before the error returns.
    /// A repeated call for the same sandbox returns the same network.
    pub async fn create_sandbox(
        &self,
        sandbox: &SandboxId,
        host_network: bool,
        ports: &[PortMapping],
    ) -> Result<NetworkStatus, NetworkError> {
        self.create_with(sandbox, host_network, ports, None, &|| false)
            .await
    }

    /// [`Self::create_sandbox`] for a pod with a user namespace of its own:
    /// its network namespace is owned by a new user namespace with
    /// `userns`'s mappings, whose pin the status carries.
    pub async fn create_sandbox_in_userns(
        &self,
        sandbox: &SandboxId,
        ports: &[PortMapping],
        userns: UserNamespace,
    ) -> Result<NetworkStatus, NetworkError> {
        self.create_with(sandbox, false, ports, Some(userns), &|| false)
            .await
    }

    /// [`Self::create_sandbox`], stopping (and rolling back) between
    /// sub-steps once `cancelled` returns true.
    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    async fn create_with(
        &self,
        sandbox: &SandboxId,
        host_network: bool,
        ports: &[PortMapping],
        userns: Option<UserNamespace>,
        cancelled: &(dyn Fn() -> bool + Sync),
    ) -> Result<NetworkStatus, NetworkError> {
        create::create(
            &self.in_flight,
            sandbox,
            host_network,
            cancelled,
            || Ok(()),
            |()| self.build(sandbox, ports, userns, cancelled),
            || self.teardown(sandbox, !ports.is_empty()),
        )
        .await
    }

    async fn build(
        &self,
        sandbox: &SandboxId,
        ports: &[PortMapping],
        userns: Option<UserNamespace>,
        cancelled: &(dyn Fn() -> bool + Sync),
    ) -> Result<NetworkStatus, NetworkError> {
        let checkpoint = |step: SubStep| {
            self.check_failpoint(step, sandbox)?;
            if cancelled() {
                return Err(NetworkError::Cancelled {
                    sandbox: sandbox.clone(),
                    after: Some(step),
                });
            }
            Ok(())
        };
        let pin = self.netns_path(sandbox);
        let userns_path = netns::create(pin.clone(), userns).await?;
        checkpoint(SubStep::NetnsCreated)?;

        let handle = host_handle()?;
        let bridge = link_index(&handle, &self.config.name)
            .await?
            .ok_or_else(|| NetworkError::LinkNotFound {
                name: self.config.name.clone(),
            })?;
        let host_if = veth_name(sandbox);
        let ns = std::fs::File::open(&pin).map_err(|e| NetworkError::io("open netns", &pin, e))?;
        let peer = LinkUnspec::new_with_name(POD_INTERFACE)
            .mtu(self.config.mtu)
            .setns_by_fd(ns.as_raw_fd())
            .build();
        let veth = LinkVeth::new(&host_if, POD_INTERFACE)
            .mtu(self.config.mtu)
            .controller(bridge)
            .up()
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        match handle.link().add(veth).execute().await {
            Ok(()) => {}
            // A repeated create of the same sandbox finds its own veth on the
            // bridge and carries on; anything else by that name is an error.
            Err(e) if netlink_errno(&e) == Some(libc::EEXIST) => {
                let ours = link_message(&handle, &host_if)
                    .await?
                    .is_some_and(|m| port_of(&m, bridge).is_some());
                if !ours {
                    return Err(NetworkError::netlink("add veth", host_if.as_str(), e));
                }
            }
            Err(e) => return Err(NetworkError::netlink("add veth", host_if.as_str(), e)),
        }
        drop(ns);
        // The host end is a bridge port and needs no IPv6 address. Without
        // this it would make a link-local one once the pod end comes up, and
        // its duplicate-address probes and listener reports would be
        // flooded by the bridge to every other pod. (The kernel takes the
        // mode only once the link exists, so it cannot go with the add.)
        handle
            .link()
            .set(
                LinkUnspec::new_with_name(&host_if)
                    .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
                        vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
                    )]))
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| NetworkError::netlink("set addrgenmode none", host_if.as_str(), e))?;
        checkpoint(SubStep::VethCreated)?;

        let ip = self.ipam.allocate(sandbox)?;
        checkpoint(SubStep::LeaseTaken)?;

        let gw = self.gateway();
        let prefix = self.config.subnet.prefix_len();
        netns::with_netlink(pin.clone(), move |h| configure_pod(h, ip, prefix, gw)).await?;
        checkpoint(SubStep::AddressSet)?;

        if !ports.is_empty() {
            let nft = self.nft()?;
            let _guard = self.ports.lock().await;
            nft::add_host_ports(&nft, &self.table, sandbox, ip, ports).await?;
        }
        checkpoint(SubStep::PortsMapped)?;

        Ok(NetworkStatus {
            netns_path: Some(pin),
            ips: vec![IpAddr::V4(ip)],
            interface: Some(POD_INTERFACE.into()),
            userns_path,
        })
    }

    /// Removes everything the sandbox holds: host-port rules (when it had
    /// any), the veth pair, the namespace pin and the lease. Absent parts are
    /// fine. Every part is attempted; the first error is returned. It is
    /// [`BridgeNetwork::detach`] and then [`BridgeNetwork::remove_links`],
    /// waited for in one call.
    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    pub async fn teardown(&self, sandbox: &SandboxId, had_ports: bool) -> Result<(), NetworkError> {
        let detached = self.detach(sandbox, had_ports).await;
        let removed = self.remove_links(sandbox).await;
        detached.and(removed)
    }

    /// Cuts the sandbox off the network without waiting for the kernel's
    /// slow deletions: removes its host-port rules (when it had any), sets
    /// the host end of its veth down, so that the bridge forwards nothing to
    /// or from the pod any more (its old address can go to another pod at
    /// once without two answers to an ARP), and releases its lease. Absent
    /// parts are fine. Every part is attempted; the first error is returned.
    /// [`BridgeNetwork::remove_links`] finishes the teardown.
    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    pub async fn detach(&self, sandbox: &SandboxId, had_ports: bool) -> Result<(), NetworkError> {
        let mut first: Option<NetworkError> = None;
        let mut note = |r: Result<(), NetworkError>| {
            if let Err(e) = r {
                tracing::warn!(sandbox = %sandbox, error = %cubelet_engine::chain(&e), "network detach step failed");
                first.get_or_insert(e);
            }
        };
        if had_ports {
            note(
                self.unmap_ports(|owner| owner == sandbox.as_str())
                    .await
                    .map(|_| ()),
            );
        }
        note(set_link_down(&veth_name(sandbox)).await);
        note(self.ipam.release(sandbox).map(|_| ()));
        first.map_or(Ok(()), Err)
    }

    /// The slow part of a sandbox's teardown, after
    /// [`BridgeNetwork::detach`]: deletes the host end of its veth pair (the
    /// kernel waits for RCU grace periods on both ends) and then its
    /// namespace pin. Absent parts are fine; both are attempted, the first
    /// error is returned.
    pub async fn remove_links(&self, sandbox: &SandboxId) -> Result<(), NetworkError> {
        remove_links(&veth_name(sandbox), &self.netns_path(sandbox)).await
    }

    /// Deletes the host-port rules whose owner `doomed` names. `doomed` is
    /// called only once the rules are listed (the GC relies on that) and
    /// not at all when there are none.
    async fn unmap_ports(&self, doomed: impl Fn(&str) -> bool) -> Result<usize, NetworkError> {
        let nft = self.nft()?;
        let _guard = self.ports.lock().await;
        let listed = nft::list_host_ports(&nft, &self.table).await?;
        let rules: Vec<_> = listed.into_iter().filter(|r| doomed(&r.owner)).collect();
        nft::delete_rules(&nft, &self.table, &rules).await?;
        Ok(rules.len())
    }

    /// Removes namespace pins, host veths on our bridge, leases and host-port
    /// rules that belong to no sandbox in `live`. Each kind is listed first
    /// and `live` asked afterwards (see [`LiveSandboxes`]), so a sandbox
    /// whose create starts during the pass is never reclaimed halfway;
    /// sandboxes whose create is running in this provider count as live too.
    pub async fn gc(&self, live: &dyn LiveSandboxes) -> Result<GcReport, NetworkError> {
        let mut report = GcReport::default();

        // Veths first: removing a pin lets the kernel tear the namespace
        // down, which takes the pair with it asynchronously.
        let handle = host_handle()?;
        if let Some(bridge) = link_index(&handle, &self.config.name).await? {
            // The kernel filters the dump to the bridge's ports and leaves
            // out their counters: at 250 pods the whole dump parsed into
            // ~5 MiB of messages at once. `port_of` still checks each one
            // (a kernel without dump filters sends every link).
            let mut request = handle
                .link()
                .get()
                .set_filter_mask(AddressFamily::Unspec, vec![LinkExtentMask::SkipStats]);
            request
                .message_mut()
                .attributes
                .push(LinkAttribute::Controller(bridge));
            let mut links = request.execute();
            let mut ports = Vec::new();
            while let Some(msg) = links
                .try_next()
                .await
                .map_err(|e| NetworkError::netlink("list links", "all", e))?
            {
                ports.extend(port_of(&msg, bridge));
            }
            if !ports.is_empty() {
                let Some(now) = self.in_flight.and(live) else {
                    return Ok(report);
                };
                let live_names: HashSet<String> = now.iter().map(veth_name).collect();
                for name in ports.iter().filter(|n| !live_names.contains(*n)) {
                    if delete_link(name).await? {
                        report.veths += 1;
                    }
                }
            }
        }

        report.netns = netns::remove_pins_except(&self.netns_dir, || self.in_flight.and(live))?;

        let leases = self.ipam.leases();
        if !leases.is_empty() {
            let Some(now) = self.in_flight.and(live) else {
                return Ok(report);
            };
            let owners: HashSet<SandboxId> = leases
                .into_iter()
                .map(|(_, s)| s)
                .filter(|s| !now.contains(s))
                .collect();
            for owner in owners {
                report.leases += self.ipam.release(&owner)?.len();
            }
        }

        if nft::find_nft().is_some() {
            // `doomed` is first called once the rules are listed.
            let now = std::sync::OnceLock::new();
            report.port_rules = self
                .unmap_ports(|owner| {
                    now.get_or_init(|| self.in_flight.and(live))
                        .as_ref()
                        .is_some_and(|now| {
                            SandboxId::parse(owner).is_none_or(|id| !now.contains(&id))
                        })
                })
                .await?;
        }
        Ok(report)
    }
}

/// Deletes link `name` of the host. Returns whether it existed.
async fn delete_link(name: &str) -> Result<bool, NetworkError> {
    let handle = host_handle()?;
    let Some(index) = link_index(&handle, name).await? else {
        return Ok(false);
    };
    match handle.link().del(index).execute().await {
        Ok(()) => Ok(true),
        Err(e) if netlink_errno(&e) == Some(libc::ENODEV) => Ok(false),
        Err(e) => Err(NetworkError::netlink("delete link", name, e)),
    }
}

/// Sets link `name` of the host down; a missing link is fine.
async fn set_link_down(name: &str) -> Result<(), NetworkError> {
    let handle = host_handle()?;
    let Some(index) = link_index(&handle, name).await? else {
        return Ok(());
    };
    match handle
        .link()
        .set(LinkUnspec::new_with_index(index).down().build())
        .execute()
        .await
    {
        Err(e) if netlink_errno(&e) != Some(libc::ENODEV) => {
            Err(NetworkError::netlink("set down", name, e))
        }
        _ => Ok(()),
    }
}

/// The slow part of a sandbox's teardown, after [`BridgeNetwork::detach`]:
/// deletes the host veth `veth` (the kernel waits for RCU grace periods on
/// both ends) and then the namespace pin `pin`. Absent parts are fine; both
/// are attempted, the first error is returned.
async fn remove_links(veth: &str, pin: &Path) -> Result<(), NetworkError> {
    let deleted = delete_link(veth).await.map(|_| ());
    let unpinned = netns::remove(pin).await.map(|_| ());
    deleted.and(unpinned)
}

/// The name of `msg` if it is a veth with our prefix attached to `bridge`.
fn port_of(msg: &LinkMessage, bridge: u32) -> Option<String> {
    let mut name = None;
    let mut on_bridge = false;
    let mut is_veth = false;
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::Controller(c) => on_bridge = *c == bridge,
            LinkAttribute::LinkInfo(infos) => {
                is_veth = infos
                    .iter()
                    .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            _ => {}
        }
    }
    let name = name?;
    (on_bridge && is_veth && name.starts_with(VETH_PREFIX)).then_some(name)
}

/// Makes the bridge keep its hardware address. A bridge whose address was
/// never set takes the lowest of its ports', so it changed whenever a pod's
/// veth joined or left (a warm-pool shell made in the background, say), and
/// pods that had the gateway's old address in their ARP cache could not
/// reach it for seconds. Setting the address, to the one it has, makes the
/// kernel keep it from then on. Idempotent.
async fn fix_address(handle: &Handle, index: u32, name: &str) -> Result<(), NetworkError> {
    let mac = link_message(handle, name)
        .await?
        .and_then(|m| {
            m.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::Address(mac) => Some(mac),
                _ => None,
            })
        })
        .ok_or_else(|| NetworkError::LinkNotFound {
            name: name.to_owned(),
        })?;
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).address(mac).build())
        .execute()
        .await
        .map_err(|e| NetworkError::netlink("set the address of", name, e))
}

/// True when `msg` describes a bridge.
fn is_bridge(msg: &LinkMessage) -> bool {
    msg.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Bridge))),
        _ => false,
    })
}

/// Inside the pod namespace: a quiet IPv6 start for eth0, loopback and eth0
/// up, the address, the default route.
async fn configure_pod(
    h: Handle,
    ip: Ipv4Addr,
    prefix: u8,
    gw: Ipv4Addr,
) -> Result<(), NetworkError> {
    quiet_ipv6_start(POD_INTERFACE)?;
    for name in ["lo", POD_INTERFACE] {
        netns::link_up(&h, name).await?;
    }
    let eth0 = link_index(&h, POD_INTERFACE)
        .await?
        .ok_or_else(|| NetworkError::LinkNotFound {
            name: POD_INTERFACE.into(),
        })?;
    exists_ok(
        h.address()
            .add(eth0, IpAddr::V4(ip), prefix)
            .execute()
            .await,
        "add address",
        format!("{ip}/{prefix}"),
    )?;
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .gateway(gw)
        .output_interface(eth0)
        .build();
    exists_ok(
        h.route().add(route).execute().await,
        "add default route via",
        gw.to_string(),
    )
}

/// The IPv6 settings of the pod's `interface` that make its start quiet on
/// the bridge: no duplicate-address probe for its link-local address and
/// no router solicitations. Each is a multicast frame, which the bridge
/// floods to every other pod (it has no multicast querier), so a pod's
/// start made n copies of each on a node of n pods; with these two off a
/// pod's start sends half the multicast frames it did (4 rather than 8,
/// counted on the bridge over 100 pods). The link-local address is still
/// made, from the veth's random hardware address, so a duplicate is not a
/// practical concern; nothing on the bridge sends router advertisements to
/// answer a solicitation (a pod still accepts unsolicited ones). Must run
/// on a thread inside the pod's namespace, before the link is up. A kernel
/// without IPv6 has no such settings, which is fine; that is checked only
/// when a write fails, so a pod's start makes no extra `/proc/sys` lookup
/// (the first one in a new namespace scans every namespace's entry).
fn quiet_ipv6_start(interface: &str) -> Result<(), NetworkError> {
    let conf = Path::new("/proc/sys/net/ipv6/conf");
    for (key, value) in [("accept_dad", "0"), ("router_solicitations", "0")] {
        let path = conf.join(interface).join(key);
        match std::fs::write(&path, value) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !conf.is_dir() => return Ok(()),
            Err(e) => return Err(NetworkError::io("set", &path, e)),
        }
    }
    Ok(())
}

/// The result of a netlink add that may find its object already there (a
/// repeated setup or create), which counts as done.
fn exists_ok(
    added: Result<(), rtnetlink::Error>,
    op: &'static str,
    target: impl Into<String>,
) -> Result<(), NetworkError> {
    match added {
        Err(e) if netlink_errno(&e) != Some(libc::EEXIST) => {
            Err(NetworkError::netlink(op, target, e))
        }
        _ => Ok(()),
    }
}

/// A netlink handle in the calling thread's namespace (the host's).
fn host_handle() -> Result<Handle, NetworkError> {
    let (conn, handle, _) = rtnetlink::new_connection()
        .map_err(|e| NetworkError::io("open netlink socket", "rtnetlink", e))?;
    tokio::spawn(conn.in_current_span());
    Ok(handle)
}

/// Index of link `name`, `None` if it does not exist.
async fn link_index(h: &Handle, name: &str) -> Result<Option<u32>, NetworkError> {
    Ok(link_message(h, name).await?.map(|m| m.header.index))
}

/// Link `name`, `None` if it does not exist.
async fn link_message(h: &Handle, name: &str) -> Result<Option<LinkMessage>, NetworkError> {
    let mut req = h.link().get().match_name(name.to_owned()).execute();
    match req.try_next().await {
        Ok(msg) => Ok(msg),
        Err(e) if netlink_errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(NetworkError::netlink("get link", name, e)),
    }
}

/// The first global IPv4 address on the interface of the default route, if
/// any. Best effort: host-network pods still work without it.
pub(crate) async fn host_primary_ipv4() -> Option<Ipv4Addr> {
    let h = host_handle().ok()?;
    let mut routes = h
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute();
    let mut oif = None;
    while let Ok(Some(r)) = routes.try_next().await {
        if r.header.destination_prefix_length == 0 && oif.is_none() {
            oif = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            });
        }
    }
    let oif = oif?;
    let mut addrs = h.address().get().set_link_index_filter(oif).execute();
    while let Ok(Some(a)) = addrs.try_next().await {
        for attr in &a.attributes {
            if let AddressAttribute::Address(IpAddr::V4(v4)) = attr {
                return Some(*v4);
            }
        }
    }
    None
}

#[async_trait]
impl Flow for BridgeNetwork {
    async fn init(&self) -> Result<(), StepError> {
        Ok(self.setup().await?)
    }

    /// A claimed shell ([`FlowContext::claimed`]) already has its
    /// namespace, veth and lease: only the pod's host ports are left (a
    /// failure is rolled back by the flow's failover, which tears the
    /// whole sandbox down).
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let spec = ctx.spec();
        if let Some(shell) = ctx
            .get::<NetworkStatus>()
            .filter(|n| ctx.claimed() && n.netns_path.is_some() && !spec.host_network())
        {
            if !spec.port_mappings.is_empty() {
                let ip = shell.ips.iter().find_map(|ip| match ip {
                    IpAddr::V4(v4) => Some(*v4),
                    IpAddr::V6(_) => None,
                });
                let ip = ip.ok_or_else(|| NetworkError::InvalidConfig {
                    reason: format!("shell {} has no IPv4 address", ctx.sandbox_id()),
                })?;
                let nft = self.nft()?;
                let _guard = self.ports.lock().await;
                nft::add_host_ports(&nft, &self.table, ctx.sandbox_id(), ip, &spec.port_mappings)
                    .await?;
            }
            return Ok(());
        }
        let cancelled = || ctx.cancel_token().is_cancelled();
        let status = self
            .create_with(
                ctx.sandbox_id(),
                spec.host_network(),
                &spec.port_mappings,
                spec.namespaces.userns,
                &cancelled,
            )
            .await?;
        ctx.publish(status);
        Ok(())
    }

    /// Detaches the pod from the network (host ports, link down, lease),
    /// then leaves the kernel's slow deletion of the veth pair and the
    /// namespace to the engine ([`FlowContext::defer`]): StopPodSandbox
    /// answers once the pod is cut off. The destroy flow stays open in the
    /// journal until the deletion is done, so a crash before then leaves it
    /// to recovery, which runs this teardown again; the GC reclaims orphan
    /// veths and pins in any case.
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let sandbox = ctx.sandbox_id();
        let detached = self
            .detach(sandbox, !ctx.spec().port_mappings.is_empty())
            .await;
        let veth = veth_name(sandbox);
        let pin = self.netns_path(sandbox);
        let removed = ctx
            .defer("delete the veth pair and the netns pin", async move {
                Ok(remove_links(&veth, &pin).await?)
            })
            .await;
        detached?;
        Ok(removed?)
    }

    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        Ok(self
            .teardown(ctx.sandbox_id(), !ctx.spec().port_mappings.is_empty())
            .await?)
    }

    /// A claimed shell's `create` does nothing unless the pod maps host
    /// ports, whose rules live in the node's table.
    fn confined_to_shell(&self, ctx: &FlowContext) -> bool {
        let spec = ctx.spec();
        ctx.claimed()
            && spec.port_mappings.is_empty()
            && !spec.host_network()
            && ctx
                .get::<NetworkStatus>()
                .is_some_and(|n| n.netns_path.is_some())
    }

    /// A shell's network: the namespace pinned, the veth pair on the
    /// bridge, an address leased and set, no host ports (those are the
    /// pod's).
    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let cancelled = || ctx.cancel_token().is_cancelled();
        let status = self
            .create_with(ctx.sandbox_id(), false, &[], None, &cancelled)
            .await?;
        ctx.publish(status);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::MemLeases;

    #[test]
    fn veth_names_fit_ifnamsiz() {
        let id = SandboxId::new_unchecked("0123456789abcdef".repeat(4));
        assert_eq!(veth_name(&id), "cb0123456789a");
        assert!(veth_name(&id).len() <= 15);
        assert_eq!(veth_name(&SandboxId::new_unchecked("ab")), "cbab");
    }

    #[test]
    fn bad_configs_are_rejected() {
        let leases: Arc<dyn LeaseStore> = Arc::new(MemLeases::new());
        let good = BridgeConfig {
            name: "cbt0".into(),
            subnet: "10.99.0.0/24".parse().unwrap(),
            mtu: 1500,
            state_dir: "/run/cubelet-test".into(),
        };
        BridgeNetwork::new(good.clone(), leases.clone()).unwrap();
        for bad in [
            BridgeConfig {
                name: "a-name-longer-than-15".into(),
                ..good.clone()
            },
            BridgeConfig {
                name: "a/b".into(),
                ..good.clone()
            },
            BridgeConfig {
                mtu: 10,
                ..good.clone()
            },
            BridgeConfig {
                state_dir: "rel".into(),
                ..good.clone()
            },
            BridgeConfig {
                subnet: "10.0.0.0/31".parse().unwrap(),
                ..good.clone()
            },
        ] {
            let err = BridgeNetwork::new(bad, leases.clone()).unwrap_err();
            assert_eq!(
                err.kind(),
                cubelet_engine::StepErrorKind::InvalidArgument,
                "{err}"
            );
        }
    }
}
