//! Reading the pod's addresses out of a CNI result (0.3.x, 0.4.0 and 1.0.0
//! use `ips[].address`; 0.1.0/0.2.0 use `ip4.ip`/`ip6.ip`).

use std::net::IpAddr;

use serde_json::Value;

/// The addresses of interface `ifname` in the sandbox, in result order.
/// Addresses that name no interface count as the pod's; addresses on
/// another interface (the host-side veth, another sandbox interface) do not.
pub(crate) fn pod_ips(result: &Value, ifname: &str) -> Result<Vec<IpAddr>, String> {
    if let Some(ips) = result.get("ips") {
        let ips = ips.as_array().ok_or("\"ips\" is not an array")?;
        let interfaces = result
            .get("interfaces")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let ours = |idx: &Value| -> bool {
            let Some(i) = idx.as_u64().and_then(|i| usize::try_from(i).ok()) else {
                return true;
            };
            interfaces.get(i).is_none_or(|intf| {
                intf.get("name").and_then(Value::as_str) == Some(ifname)
                    && intf
                        .get("sandbox")
                        .and_then(Value::as_str)
                        .is_some_and(|s| !s.is_empty())
            })
        };
        let mut out = Vec::new();
        for ip in ips {
            if !ip.get("interface").is_none_or(ours) {
                continue;
            }
            let addr = ip
                .get("address")
                .and_then(Value::as_str)
                .ok_or("an ips entry has no string \"address\"")?;
            out.push(parse_cidr(addr)?);
        }
        return Ok(out);
    }
    let mut out = Vec::new();
    for key in ["ip4", "ip6"] {
        if let Some(ip) = result.get(key).and_then(|v| v.get("ip")) {
            let s = ip.as_str().ok_or(format!("\"{key}.ip\" is not a string"))?;
            out.push(parse_cidr(s)?);
        }
    }
    Ok(out)
}

/// `10.0.0.5/24` → `10.0.0.5`.
fn parse_cidr(s: &str) -> Result<IpAddr, String> {
    let addr = s.split_once('/').map_or(s, |(a, _)| a);
    addr.parse().map_err(|e| format!("bad address {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_zero_zero_result_with_interfaces() {
        let r = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "cnitest0", "mac": "aa"},
                {"name": "veth1234", "mac": "bb"},
                {"name": "eth0", "mac": "cc", "sandbox": "/run/netns/x"}
            ],
            "ips": [
                {"address": "10.203.0.5/24", "gateway": "10.203.0.1", "interface": 2},
                {"address": "fd00::5/64", "interface": 2},
                {"address": "10.9.9.9/32", "interface": 0}
            ]
        });
        assert_eq!(
            pod_ips(&r, "eth0").unwrap(),
            vec![
                "10.203.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
    }

    #[test]
    fn zero_four_zero_without_interface_indexes() {
        let r = json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.2.3/16"}]});
        assert_eq!(
            pod_ips(&r, "eth0").unwrap(),
            vec!["10.1.2.3".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn legacy_zero_two_zero() {
        let r = json!({"cniVersion": "0.2.0", "ip4": {"ip": "10.1.2.3/16"}});
        assert_eq!(
            pod_ips(&r, "eth0").unwrap(),
            vec!["10.1.2.3".parse::<IpAddr>().unwrap()]
        );
        assert!(pod_ips(&json!({}), "eth0").unwrap().is_empty());
    }

    #[test]
    fn malformed_results_are_errors() {
        assert!(pod_ips(&json!({"ips": 3}), "eth0").is_err());
        assert!(pod_ips(&json!({"ips": [{"address": "nope/24"}]}), "eth0").is_err());
        assert!(pod_ips(&json!({"ips": [{}]}), "eth0").is_err());
    }
}
