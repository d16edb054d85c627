//! What the node can do of the CRI's optional features, as `Status`
//! reports them (`features`, `runtime_handlers[].features`), and the check
//! that refuses a pod asking for one its handler lacks.
//!
//! - Supplemental groups policy: Cubelet resolves the groups itself, for
//!   every handler.
//! - Recursive read-only mounts: Cubelet stages them on the node (runtime
//!   crate, `staged`), so every handler gets a plain read-only bind.
//! - User namespaces: a pod's user namespace is made by the network step
//!   (util-linux `unshare`) and joined by an OCI runtime that understands
//!   `linux.uidMappings` (the runc shim: runc, crun). Reported for those
//!   handlers only, and only when the node can make one: the check runs
//!   `unshare --user true` once.

use std::sync::OnceLock;

use cubelet_cri_api::v1 as cri;
use cubelet_engine::SandboxSpec;
use cubelet_runtime::container::{HandlerConfig, RuntimeConfig};

use crate::error::{CriError, CriResult};

/// The containerd runtime whose OCI runtimes take user namespaces.
const RUNC_SHIM: &str = "io.containerd.runc.v2";

/// True if an executable file `name` is in a `PATH` directory.
pub(crate) fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Why this node cannot make user namespaces for pods, if it cannot
/// (checked once).
pub fn node_userns_unsupported() -> Option<&'static str> {
    static CHECK: OnceLock<Option<String>> = OnceLock::new();
    CHECK
        .get_or_init(|| {
            let max = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok());
            if max == Some(0) {
                return Some("user namespaces are disabled (user.max_user_namespaces = 0)".into());
            }
            if !on_path("unshare") {
                return Some("unshare (util-linux) is not in PATH".into());
            }
            match std::process::Command::new("unshare")
                .args(["--user", "--net", "true"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
            {
                Ok(s) if s.success() => None,
                Ok(s) => Some(format!("unshare --user --net true failed ({s})")),
                Err(e) => Some(format!("unshare --user --net true: {e}")),
            }
        })
        .as_deref()
}

/// Whether pods of `handler` can have a user namespace of their own.
pub fn handler_supports_userns(handler: &HandlerConfig) -> bool {
    handler.runtime_type == RUNC_SHIM && node_userns_unsupported().is_none()
}

/// `Status.runtime_handlers[].features` of `handler`.
pub fn handler_features(handler: &HandlerConfig) -> cri::RuntimeHandlerFeatures {
    cri::RuntimeHandlerFeatures {
        recursive_read_only_mounts: true,
        user_namespaces: handler_supports_userns(handler),
    }
}

/// `Status.runtime_handlers`: the default handler under the empty name
/// first (what a pod that names no handler gets, as containerd reports
/// it; kubelet and critest look features up by the name they send), then
/// every configured handler by name.
pub fn runtime_handlers(config: &RuntimeConfig) -> Vec<cri::RuntimeHandler> {
    let default = config
        .handlers
        .get(&config.default_handler)
        .map(|h| (String::new(), h));
    default
        .into_iter()
        .chain(config.handlers.iter().map(|(n, h)| (n.clone(), h)))
        .map(|(name, h)| cri::RuntimeHandler {
            name,
            features: Some(handler_features(h)),
        })
        .collect()
}

/// `Status.features`. `user_namespaces_host_network` is false: a pod in
/// its own user namespace cannot have the node's network here (refused as
/// `..namespace_options.userns_options`), and a 1.36 kubelet that reads the
/// false refuses such pods before it asks.
pub fn runtime_features() -> cri::RuntimeFeatures {
    cri::RuntimeFeatures {
        supplemental_groups_policy: true,
        user_namespaces_host_network: false,
    }
}

/// Refuses a pod that asks for its own user namespace on a handler (or a
/// node) that cannot give it one.
pub fn check_userns(spec: &SandboxSpec, handler: &HandlerConfig) -> CriResult<()> {
    if spec.namespaces.userns.is_none() || handler_supports_userns(handler) {
        return Ok(());
    }
    let why = node_userns_unsupported().map_or_else(
        || {
            format!(
                "runtime handler {:?} ({}) does not support user namespaces",
                spec.runtime_handler, handler.runtime_type
            )
        },
        str::to_owned,
    );
    Err(CriError::precondition(why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_engine::spec::{IdMapping, NamespaceOptions, UserNamespace};

    #[test]
    fn only_runc_shim_handlers_take_user_namespaces() {
        let other = HandlerConfig {
            runtime_type: "io.containerd.kata.v2".into(),
            ..Default::default()
        };
        assert!(!handler_supports_userns(&other));
        assert!(!handler_features(&other).user_namespaces);
        assert!(handler_features(&other).recursive_read_only_mounts);
        assert!(runtime_features().supplemental_groups_policy);
        assert!(!runtime_features().user_namespaces_host_network);
        let map = IdMapping {
            container_id: 0,
            host_id: 1000,
            length: 10,
        };
        let pod = SandboxSpec {
            namespaces: NamespaceOptions {
                userns: Some(UserNamespace {
                    uids: map,
                    gids: map,
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(matches!(
            check_userns(&pod, &other),
            Err(CriError::Pod(cubelet_pod::PodError::FailedPrecondition(_)))
        ));
        check_userns(&SandboxSpec::default(), &other).unwrap();
        let mut config = RuntimeConfig::new("/run/x".into());
        config.handlers.insert("kata".into(), other.clone());
        let names: Vec<_> = runtime_handlers(&config)
            .into_iter()
            .map(|h| (h.name, h.features.unwrap().user_namespaces))
            .collect();
        let node = node_userns_unsupported().is_none();
        assert_eq!(
            names,
            [
                (String::new(), node),
                ("kata".to_owned(), false),
                ("runc".to_owned(), node)
            ]
        );
        let runc = HandlerConfig::default();
        assert_eq!(
            handler_supports_userns(&runc),
            node_userns_unsupported().is_none()
        );
    }
}
