//! What a plugin is given besides its config: `CNI_ARGS` with the pod's
//! identity, capability arguments (`portMappings`), and the stdin config
//! with `prevResult` and `runtimeConfig`.

use cubelet_engine::spec::{PortMapping, Protocol, SandboxSpec};
use cubelet_engine::SandboxId;
use serde_json::{Map, Value};

use super::conf::NetworkList;
use crate::error::NetworkError;

/// `CNI_ARGS` for a pod, as kubelet's dockershim and containerd pass them.
pub(super) fn cni_args(sandbox: &SandboxId, spec: &SandboxSpec) -> Vec<(String, String)> {
    [
        ("IgnoreUnknown", "1"),
        ("K8S_POD_NAMESPACE", spec.namespace.as_str()),
        ("K8S_POD_NAME", spec.name.as_str()),
        ("K8S_POD_INFRA_CONTAINER_ID", sandbox.as_str()),
        ("K8S_POD_UID", spec.uid.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// `K=V;K=V`. `;` and `=` cannot be escaped in CNI_ARGS, so they are dropped
/// from values (Kubernetes names never contain them).
pub(super) fn join_args(args: &[(String, String)]) -> String {
    args.iter()
        .map(|(k, v)| format!("{k}={}", v.replace([';', '='], "")))
        .collect::<Vec<_>>()
        .join(";")
}

/// Capability arguments: `portMappings` in the CNI convention, host ports
/// of 0 (no host port) left out.
pub(super) fn capability_args(ports: &[PortMapping]) -> Map<String, Value> {
    let maps: Vec<Value> = ports
        .iter()
        .filter(|p| p.host_port != 0)
        .map(|p| {
            let mut m = serde_json::json!({
                "hostPort": p.host_port,
                "containerPort": p.container_port,
                "protocol": match p.protocol {
                    Protocol::Tcp => "tcp",
                    Protocol::Udp => "udp",
                    Protocol::Sctp => "sctp",
                },
            });
            if let (Some(ip), Value::Object(o)) = (p.host_ip, &mut m) {
                o.insert("hostIP".into(), Value::String(ip.to_string()));
            }
            m
        })
        .collect();
    let mut caps = Map::new();
    if !maps.is_empty() {
        caps.insert("portMappings".into(), Value::Array(maps));
    }
    caps
}

/// The config plugin `i` reads on stdin: its own object with the list's
/// `name` and `cniVersion`, `prevResult`, and `runtimeConfig` holding the
/// capability arguments it declares.
pub(super) fn plugin_stdin(
    list: &NetworkList,
    i: usize,
    prev: Option<&Value>,
    caps: &Map<String, Value>,
) -> Result<Vec<u8>, NetworkError> {
    let mut conf = list.plugins.get(i).cloned().unwrap_or_default();
    conf.insert("name".into(), Value::String(list.name.clone()));
    conf.insert("cniVersion".into(), Value::String(list.cni_version.clone()));
    match prev {
        Some(p) => {
            conf.insert("prevResult".into(), p.clone());
        }
        None => {
            conf.remove("prevResult");
        }
    }
    let granted: Map<String, Value> = caps
        .iter()
        .filter(|(cap, _)| list.has_capability(i, cap))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !granted.is_empty() {
        let rc = conf
            .entry("runtimeConfig")
            .or_insert_with(|| Value::Object(Map::new()));
        if !rc.is_object() {
            *rc = Value::Object(Map::new());
        }
        if let Value::Object(rc) = rc {
            rc.extend(granted);
        }
    }
    serde_json::to_vec(&conf).map_err(|e| NetworkError::CniConfig {
        path: list.source.clone(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};
    use std::path::Path;

    fn list() -> NetworkList {
        let v = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "net",
            "plugins": [
                {"type": "bridge", "bridge": "b0", "ipam": {"type": "host-local"}},
                {"type": "portmap", "capabilities": {"portMappings": true}, "runtimeConfig": {"other": 1}}
            ]
        });
        NetworkList::from_value(v, Path::new("/t")).unwrap()
    }

    #[test]
    fn stdin_injects_name_version_prev_result_and_capabilities() {
        let l = list();
        let caps = capability_args(&[
            PortMapping {
                protocol: Protocol::Udp,
                container_port: 53,
                host_port: 5353,
                host_ip: Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1))),
            },
            PortMapping {
                protocol: Protocol::Tcp,
                container_port: 80,
                host_port: 0,
                host_ip: None,
            },
        ]);
        let prev = serde_json::json!({"cniVersion": "1.0.0", "ips": []});
        let first: Value =
            serde_json::from_slice(&plugin_stdin(&l, 0, None, &caps).unwrap()).unwrap();
        assert_eq!(first["name"], "net");
        assert_eq!(first["cniVersion"], "1.0.0");
        assert_eq!(first["bridge"], "b0");
        assert!(first.get("prevResult").is_none());
        assert!(
            first.get("runtimeConfig").is_none(),
            "bridge lacks the capability"
        );

        let second: Value =
            serde_json::from_slice(&plugin_stdin(&l, 1, Some(&prev), &caps).unwrap()).unwrap();
        assert_eq!(second["prevResult"], prev);
        assert_eq!(second["runtimeConfig"]["other"], 1);
        assert_eq!(
            second["runtimeConfig"]["portMappings"],
            serde_json::json!([{"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "127.0.0.1"}])
        );
        assert!(capability_args(&[]).is_empty());
    }

    #[test]
    fn cni_args_carry_the_pod_identity() {
        let id = SandboxId::new_unchecked("abc");
        let spec = SandboxSpec {
            name: "web".into(),
            namespace: "default".into(),
            uid: "u-1".into(),
            ..SandboxSpec::default()
        };
        assert_eq!(
            join_args(&cni_args(&id, &spec)),
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1"
        );
        assert_eq!(join_args(&[("A".into(), "x;B=y".into())]), "A=xBy");
    }
}
