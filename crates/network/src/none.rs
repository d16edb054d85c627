//! The `none` network provider: every pod that does not use the node's
//! network gets a namespace of its own, pinned exactly as the bridge and CNI
//! providers pin theirs, with only `lo` in it (up). No interface, no
//! address, no route, no host ports; containerd's and CRI-O's "no network"
//! pods look the same. Host-network pods get nothing from it.

use std::path::PathBuf;

use async_trait::async_trait;
use cubelet_engine::spec::{NetworkStatus, PortMapping, UserNamespace};
use cubelet_engine::{Flow, FlowContext, LiveSandboxes, SandboxId, StepError};

use crate::create::{self, InFlight};
use crate::error::NetworkError;
use crate::netns;

/// What [`NoneNetwork::gc`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoneGcReport {
    /// Namespace pins removed.
    pub netns: usize,
}

/// The `none` network provider. See the module documentation.
#[derive(Debug)]
pub struct NoneNetwork {
    netns_dir: PathBuf,
    /// Sandboxes whose create is running; `gc` treats them as live.
    in_flight: InFlight,
}

impl NoneNetwork {
    /// A provider pinning namespaces under `<state_dir>/netns`. Nothing is
    /// touched until [`Flow::init`].
    pub fn new(state_dir: impl Into<PathBuf>) -> Result<Self, NetworkError> {
        let state_dir = state_dir.into();
        if !state_dir.is_absolute() {
            return Err(NetworkError::InvalidConfig {
                reason: format!("state_dir {} must be absolute", state_dir.display()),
            });
        }
        Ok(Self {
            netns_dir: state_dir.join("netns"),
            in_flight: InFlight::default(),
        })
    }

    /// Where the namespace of `sandbox` is pinned.
    pub fn netns_path(&self, sandbox: &SandboxId) -> PathBuf {
        self.netns_dir.join(sandbox.as_str())
    }

    /// Prepares the node: the pin directory. Idempotent.
    pub async fn setup(&self) -> Result<(), NetworkError> {
        netns::prepare_dir(&self.netns_dir)?;
        tracing::info!(netns_dir = %self.netns_dir.display(), "none network ready (loopback-only pod namespaces)");
        Ok(())
    }

    /// Builds the sandbox's network (a pinned namespace with `lo` up) and
    /// returns what it publishes: the pin, no address, no interface. Port
    /// mappings are ignored. A host-network pod gets no namespace; like the
    /// other providers, it reports the node's primary IPv4 address. On
    /// failure the pin is removed again before the error returns; a repeated
    /// call for the same sandbox returns the same namespace.
    pub async fn create_sandbox(
        &self,
        sandbox: &SandboxId,
        host_network: bool,
        ports: &[PortMapping],
    ) -> Result<NetworkStatus, NetworkError> {
        self.create_with(sandbox, host_network, ports, None, &|| false)
            .await
    }

    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    async fn create_with(
        &self,
        sandbox: &SandboxId,
        host_network: bool,
        ports: &[PortMapping],
        userns: Option<UserNamespace>,
        cancelled: &(dyn Fn() -> bool + Sync),
    ) -> Result<NetworkStatus, NetworkError> {
        let build = |()| async {
            if !ports.is_empty() {
                tracing::debug!(sandbox = %sandbox, ports = ports.len(), "network provider none: port mappings ignored");
            }
            let pin = self.netns_path(sandbox);
            let userns_path = netns::create(pin.clone(), userns).await?;
            netns::loopback_up(pin.clone()).await?;
            Ok(NetworkStatus {
                netns_path: Some(pin),
                ips: Vec::new(),
                interface: None,
                userns_path,
            })
        };
        let undo = || self.teardown(sandbox);
        create::create(
            &self.in_flight,
            sandbox,
            host_network,
            cancelled,
            || Ok(()),
            build,
            undo,
        )
        .await
    }

    /// Removes the sandbox's namespace pin, after a creation of it still in
    /// flight. A missing pin is fine.
    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    pub async fn teardown(&self, sandbox: &SandboxId) -> Result<(), NetworkError> {
        netns::remove(&self.netns_path(sandbox)).await.map(|_| ())
    }

    /// Removes namespace pins that belong to no sandbox in `live` (asked
    /// after the pins are listed). Sandboxes whose create is running in this
    /// provider count as live too.
    pub async fn gc(&self, live: &dyn LiveSandboxes) -> Result<NoneGcReport, NetworkError> {
        Ok(NoneGcReport {
            netns: netns::remove_pins_except(&self.netns_dir, || self.in_flight.and(live))?,
        })
    }
}

#[async_trait]
impl Flow for NoneNetwork {
    async fn init(&self) -> Result<(), StepError> {
        Ok(self.setup().await?)
    }

    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let spec = ctx.spec();
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

    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        if ctx.spec().host_network() {
            return Ok(());
        }
        Ok(self.teardown(ctx.sandbox_id()).await?)
    }

    /// Nothing is kept between destroy and cleanup: cleanup is a repeated
    /// (idempotent) destroy.
    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.destroy(ctx).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_state_dir_is_rejected() {
        NoneNetwork::new("/run/cubelet-test").unwrap();
        let err = NoneNetwork::new("run/cubelet").unwrap_err();
        assert_eq!(
            err.kind(),
            cubelet_engine::StepErrorKind::InvalidArgument,
            "{err}"
        );
        assert!(err.to_string().contains("must be absolute"), "{err}");
    }

    #[test]
    fn pins_live_where_the_other_providers_pin_them() {
        let net = NoneNetwork::new("/run/cubelet").unwrap();
        let id = SandboxId::new_unchecked("abc");
        assert_eq!(net.netns_path(&id), PathBuf::from("/run/cubelet/netns/abc"));
    }
}
