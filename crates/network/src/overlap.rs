//! The start-up check that the bridge subnet is free on the node: no route
//! of the main table and no interface address may overlap it, except those
//! on Cubelet's own bridge. Another runtime's pods on an overlapping subnet
//! (containerd's and podman's default is 10.88.0.0/16) would otherwise make
//! the host route one of the two pod networks the wrong way, silently.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::LinkAttribute;
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteType};
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::error::NetworkError;

/// The kernel's main routing table (`RT_TABLE_MAIN`).
const MAIN_TABLE: u32 = 254;

/// Something on the node that holds part of the IPv4 space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Occupant {
    /// The network it covers (truncated to its prefix).
    pub(crate) net: Ipv4Net,
    /// `route` or `address`.
    pub(crate) kind: OccupantKind,
    /// The interface index it is on, if any.
    pub(crate) index: Option<u32>,
    /// The interface name, or the index as text when it has none.
    pub(crate) dev: String,
    /// For an address: the address itself with its prefix.
    pub(crate) addr: Option<Ipv4Net>,
}

/// What an [`Occupant`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OccupantKind {
    /// A route of the main table.
    Route,
    /// An address on an interface.
    Address,
}

impl std::fmt::Display for Occupant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            OccupantKind::Route => write!(f, "route {} dev {}", self.net, self.dev),
            OccupantKind::Address => {
                write!(
                    f,
                    "address {} on {}",
                    self.addr.unwrap_or(self.net),
                    self.dev
                )
            }
        }
    }
}

/// Whether two networks share an address.
pub(crate) fn overlaps(a: Ipv4Net, b: Ipv4Net) -> bool {
    let (a, b) = (a.trunc(), b.trunc());
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The first occupant (routes before addresses) overlapping `subnet` that
/// is not on the interface `own` (Cubelet's bridge, when it exists).
/// Default routes (prefix 0) cover everything and are not conflicts.
pub(crate) fn find_overlap(
    subnet: Ipv4Net,
    own: Option<u32>,
    occupants: &[Occupant],
) -> Option<&Occupant> {
    let conflicting = |o: &&Occupant| {
        o.net.prefix_len() > 0 && (own.is_none() || o.index != own) && overlaps(subnet, o.net)
    };
    occupants
        .iter()
        .filter(|o| o.kind == OccupantKind::Route)
        .find(conflicting)
        .or_else(|| {
            occupants
                .iter()
                .filter(|o| o.kind == OccupantKind::Address)
                .find(conflicting)
        })
}

/// Refuses `subnet` for bridge `bridge` when a route of the main table or
/// an interface address that is not on `bridge` overlaps it, naming both.
pub async fn check_subnet(bridge: &str, subnet: Ipv4Net) -> Result<(), NetworkError> {
    let (conn, handle, _) = rtnetlink::new_connection()
        .map_err(|e| NetworkError::io("open netlink socket", "rtnetlink", e))?;
    let conn = tokio::spawn(conn);
    let result = check_with(&handle, bridge, subnet).await;
    conn.abort();
    result
}

async fn check_with(h: &Handle, bridge: &str, subnet: Ipv4Net) -> Result<(), NetworkError> {
    let names = link_names(h).await?;
    let own = names
        .iter()
        .find(|(_, name)| name == bridge)
        .map(|(i, _)| *i);
    let dev = |index: Option<u32>| {
        index.map_or_else(
            || "?".to_owned(),
            |i| {
                names
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or_else(|| i.to_string(), |(_, n)| n.clone())
            },
        )
    };
    let mut occupants = Vec::new();
    let mut routes = h
        .route()
        .get(RouteMessageBuilder::<std::net::Ipv4Addr>::new().build())
        .execute();
    while let Some(r) = routes
        .try_next()
        .await
        .map_err(|e| NetworkError::netlink("list routes", "ipv4", e))?
    {
        let table = r
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(r.header.table));
        if table != MAIN_TABLE || r.header.kind != RouteType::Unicast {
            continue;
        }
        let dst = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(*v4),
            _ => None,
        });
        let Some(dst) = dst else { continue };
        let Ok(net) = Ipv4Net::new(dst, r.header.destination_prefix_length) else {
            continue;
        };
        let index = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        });
        occupants.push(Occupant {
            net: net.trunc(),
            kind: OccupantKind::Route,
            index,
            dev: dev(index),
            addr: None,
        });
    }
    let mut addrs = h.address().get().execute();
    while let Some(a) = addrs
        .try_next()
        .await
        .map_err(|e| NetworkError::netlink("list addresses", "ipv4", e))?
    {
        if a.header.family != AddressFamily::Inet {
            continue;
        }
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Local(IpAddr::V4(v4)) | AddressAttribute::Address(IpAddr::V4(v4)) => {
                Some(*v4)
            }
            _ => None,
        });
        let Some(ip) = ip else { continue };
        let Ok(addr) = Ipv4Net::new(ip, a.header.prefix_len) else {
            continue;
        };
        let index = Some(a.header.index);
        occupants.push(Occupant {
            net: addr.trunc(),
            kind: OccupantKind::Address,
            index,
            dev: dev(index),
            addr: Some(addr),
        });
    }
    match find_overlap(subnet, own, &occupants) {
        Some(o) => Err(NetworkError::SubnetOverlap {
            subnet,
            other: o.to_string(),
        }),
        None => Ok(()),
    }
}

/// Every link's index and name.
async fn link_names(h: &Handle) -> Result<Vec<(u32, String)>, NetworkError> {
    let mut out = Vec::new();
    let mut links = h.link().get().execute();
    while let Some(m) = links
        .try_next()
        .await
        .map_err(|e| NetworkError::netlink("list links", "all", e))?
    {
        let name = m.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        if let Some(name) = name {
            out.push((m.header.index, name));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(net: &str, index: u32, dev: &str) -> Occupant {
        Occupant {
            net: net.parse().unwrap(),
            kind: OccupantKind::Route,
            index: Some(index),
            dev: dev.into(),
            addr: None,
        }
    }

    fn address(addr: &str, index: u32, dev: &str) -> Occupant {
        let addr: Ipv4Net = addr.parse().unwrap();
        Occupant {
            net: addr.trunc(),
            kind: OccupantKind::Address,
            index: Some(index),
            dev: dev.into(),
            addr: Some(addr),
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn overlap_is_symmetric_and_needs_a_shared_address() {
        assert!(overlaps(net("10.88.0.0/16"), net("10.88.3.0/24")));
        assert!(overlaps(net("10.88.3.0/24"), net("10.88.0.0/16")));
        assert!(!overlaps(net("10.86.0.0/16"), net("10.88.0.0/16")));
        assert!(overlaps(net("10.0.0.0/8"), net("10.86.0.0/16")));
    }

    /// containerd's CNI bridge `cni0` on 10.88.0.0/16: the message names
    /// both subnets and the device, once.
    #[test]
    fn a_route_of_another_runtime_is_named_with_its_device() {
        let occ = [
            route("0.0.0.0/0", 2, "eth0"),
            route("192.0.2.0/24", 2, "eth0"),
            route("10.88.0.0/16", 7, "cni0"),
            address("10.88.0.1/16", 7, "cni0"),
        ];
        let o = find_overlap(net("10.88.0.0/16"), None, &occ).unwrap();
        let err = NetworkError::SubnetOverlap {
            subnet: net("10.88.0.0/16"),
            other: o.to_string(),
        };
        let msg = err.to_string();
        assert_eq!(
            msg,
            "bridge subnet 10.88.0.0/16 overlaps route 10.88.0.0/16 dev cni0"
        );
        assert_eq!(msg.matches("cni0").count(), 1, "{msg}");
        // The default route alone is no conflict.
        assert!(find_overlap(net("10.86.0.0/16"), None, &occ).is_none());
    }

    #[test]
    fn the_own_bridge_and_addresses_without_routes() {
        let occ = [
            route("10.86.0.0/16", 5, "cubelet0"),
            address("10.86.0.1/16", 5, "cubelet0"),
            address("10.86.9.9/32", 3, "dummy0"),
        ];
        // Cubelet's own bridge is not a conflict; a /32 elsewhere is.
        let o = find_overlap(net("10.86.0.0/16"), Some(5), &occ).unwrap();
        assert_eq!(o.to_string(), "address 10.86.9.9/32 on dummy0");
        // Before the bridge exists its own routes cannot be told apart by
        // index: a bridge of the same name is looked up by name first.
        assert!(find_overlap(net("10.87.0.0/16"), Some(5), &occ).is_none());
    }
}
