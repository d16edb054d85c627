//! The runtime-neutral description of a container ([`ContainerSpec`]) and
//! its translation into an OCI runtime spec.
//!
//! The CRI shim converts a CRI `ContainerConfig` into a [`ContainerSpec`];
//! [`build_oci_spec`] turns it into the `config.json` runc runs. Image
//! defaults (entrypoint/cmd, env, working dir, user) are applied here, after
//! the rules of CRI and Docker, so every caller gets the same behaviour.
//!
//! The parts, one module each: the model (the spec and its pieces), user
//! resolution against the image's `/etc/passwd`, capabilities, mounts,
//! devices, resources and seccomp, and the builder that puts them together.

mod build;
mod capabilities;
mod devices;
mod model;
mod mounts;
mod resources;
mod seccomp;
mod user;

pub use build::{build_oci_spec, process_groups};
pub use capabilities::{effective_capabilities, DEFAULT_CAPABILITIES};
pub use model::{
    ContainerKind, ContainerNamespaces, ContainerSpec, DeviceSpec, HugepageLimit, MountSpec,
    NamespaceJoin, PodNamespacePaths, Propagation, Resources, SeccompProfile, SpecOptions,
    SupplementalGroupsPolicy, UserNamespaceJoin, DEFAULT_PATH_ENV,
};
pub use mounts::{DEFAULT_MASKED_PATHS, DEFAULT_READONLY_PATHS};
pub use resources::{cgroup_path, clamp_oom_score_adj, linux_resources};
pub use seccomp::{runtime_default_seccomp, RUNTIME_DEFAULT_DENIED_SYSCALLS};
pub use user::{parse_user, resolve_user, user_needs_lookup, ResolvedUser, UserRequest};

use crate::error::RuntimeError;

fn oci_err(what: &'static str) -> impl FnOnce(oci_spec::OciSpecError) -> RuntimeError {
    move |e| RuntimeError::InvalidArgument {
        field: what.to_owned(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod test_support {
    use crate::types::{ImageConfig, ImageInfo};

    pub(super) fn image(entrypoint: &[&str], cmd: &[&str], env: &[&str]) -> ImageInfo {
        ImageInfo {
            config: std::sync::Arc::new(ImageConfig {
                entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                env: env.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub(super) fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }
}
