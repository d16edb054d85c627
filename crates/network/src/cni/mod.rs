//! The `network` flow provider on standard CNI plugins: the sandbox's
//! namespace is pinned here (as the bridge provider does), then the plugins
//! of the node's network config run against it, as containerd and CRI-O run
//! them.
//!
//! * Config: the first `*.conflist`, `*.conf` or `*.json` in `conf_dir` by
//!   name (single-plugin configs are wrapped into a list of one).
//! * ADD runs each plugin in order, each getting the previous one's result as
//!   `prevResult`; DEL runs them in reverse with the cached ADD result; CHECK
//!   runs them in order with it. `portMappings` go to plugins declaring that
//!   capability (what each plugin is given is built in `args.rs`).
//! * Every attachment is cached on disk (see `cache.rs`), so DEL after an
//!   agent restart uses the config and result of ADD.

mod args;
mod cache;
mod conf;
mod exec;
mod result;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use cubelet_engine::spec::{NetworkStatus, SandboxSpec};
use cubelet_engine::{Flow, FlowContext, LiveSandboxes, SandboxId, StepError};
use serde_json::{Map, Value};

use self::args::{capability_args, cni_args, join_args, plugin_stdin};
use self::conf::NetworkList;
use self::exec::{Invocation, Op};
use crate::create::{self, InFlight};
use crate::error::NetworkError;
use crate::{netns, POD_INTERFACE};

/// Configuration of the CNI provider (`network.cni` in the config file, plus
/// the node's directories).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniConfig {
    /// Where plugin binaries are looked up, in order (`network.cni.bin_dir`;
    /// Debian's containernetworking-plugins installs into `/usr/lib/cni`).
    /// Passed to plugins as `CNI_PATH`.
    pub bin_dirs: Vec<PathBuf>,
    /// Where the network config is read from (`network.cni.conf_dir`).
    pub conf_dir: PathBuf,
    /// Volatile state directory; namespaces are pinned under `<state_dir>/netns`.
    pub state_dir: PathBuf,
    /// Persistent directory for the result cache (`<cache_dir>/results/…`);
    /// it must outlive agent restarts, e.g. `<root_dir>/cni`.
    pub cache_dir: PathBuf,
}

/// Whether the provider can set up pod networks, for CRI
/// `Status.NetworkReady`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// A usable network config and its plugins are present.
    Ready,
    /// Pods cannot get a network yet.
    NotReady {
        /// Machine-readable reason (`NetworkPluginNotReady`).
        reason: &'static str,
        /// Human-readable cause, e.g. `no network config found in /etc/cni/net.d`.
        message: String,
    },
}

impl Readiness {
    /// The reason CRI reports when the network is not ready.
    pub const NOT_READY_REASON: &'static str = "NetworkPluginNotReady";

    /// True when ready.
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Ready)
    }
}

/// What [`CniNetwork::gc`] reclaimed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CniGcReport {
    /// Cached attachments of dead sandboxes that were deleted (DEL + cache
    /// entry + pin).
    pub attachments: usize,
    /// Namespace pins without a cache entry that were removed.
    pub netns: usize,
    /// Dead sandboxes whose DEL failed; they are retried on the next run.
    pub failed: usize,
}

/// A plugin's answer to `VERSION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginVersion {
    /// Plugin type.
    pub plugin: String,
    /// The CNI versions it supports.
    pub supported: Vec<String>,
    /// Whether it supports the network config's `cniVersion`.
    pub compatible: bool,
}

/// The CNI network provider. See the module documentation.
pub struct CniNetwork {
    config: CniConfig,
    netns_dir: PathBuf,
    cni_path: String,
    /// Sandboxes whose create is running; `gc` treats them as live.
    in_flight: InFlight,
}

impl std::fmt::Debug for CniNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CniNetwork")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What a DEL needs besides the sandbox id.
struct Attachment {
    list: NetworkList,
    args: Vec<(String, String)>,
    caps: Map<String, Value>,
    prev: Option<Value>,
    cache: Option<PathBuf>,
}

impl CniNetwork {
    /// A provider for `config`. Nothing is touched until [`Flow::init`]; the
    /// network config is read on every create, so it may appear later
    /// (see [`Self::ready`]).
    pub fn new(config: CniConfig) -> Result<Self, NetworkError> {
        if config.bin_dirs.is_empty() {
            return Err(NetworkError::InvalidConfig {
                reason: "cni bin_dir must name at least one directory".into(),
            });
        }
        let dirs = config.bin_dirs.iter().map(|p| ("bin_dir", p));
        let others = [
            ("conf_dir", &config.conf_dir),
            ("state_dir", &config.state_dir),
            ("cache_dir", &config.cache_dir),
        ];
        for (key, path) in dirs.chain(others) {
            let s = path.to_string_lossy();
            if !path.is_absolute() || (key == "bin_dir" && s.contains(':')) {
                return Err(NetworkError::InvalidConfig {
                    reason: format!("cni {key} {} must be an absolute path", path.display()),
                });
            }
        }
        Ok(Self {
            netns_dir: config.state_dir.join("netns"),
            cni_path: exec::join_dirs(&config.bin_dirs),
            config,
            in_flight: InFlight::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CniConfig {
        &self.config
    }

    /// Where the namespace of `sandbox` is pinned.
    pub fn netns_path(&self, sandbox: &SandboxId) -> PathBuf {
        self.netns_dir.join(sandbox.as_str())
    }

    /// Where the result of `sandbox`'s attachment to `network` is cached.
    pub fn cache_path(&self, network: &str, sandbox: &SandboxId) -> PathBuf {
        cache::path(
            &self.config.cache_dir,
            network,
            sandbox.as_str(),
            POD_INTERFACE,
        )
    }

    /// Whether pods can get a network now: a valid config exists in
    /// `conf_dir` and every plugin it names is installed. Reads the
    /// directory; cheap enough for every CRI `Status` call.
    pub fn ready(&self) -> Readiness {
        let not_ready = |e: NetworkError| Readiness::NotReady {
            reason: Readiness::NOT_READY_REASON,
            message: e.to_string(),
        };
        let list = match conf::load(&self.config.conf_dir) {
            Ok(l) => l,
            Err(e) => return not_ready(e),
        };
        for i in 0..list.plugins.len() {
            if let Err(e) = exec::find(&self.config.bin_dirs, list.plugin_type(i)) {
                return not_ready(e);
            }
        }
        Readiness::Ready
    }

    /// Prepares the node: the pin and cache directories. Reports (in the
    /// log) plugins that do not support the config's version. Idempotent.
    pub async fn setup(&self) -> Result<(), NetworkError> {
        netns::prepare_dir(&self.netns_dir)?;
        let results = cache::dir(&self.config.cache_dir);
        std::fs::create_dir_all(&results)
            .map_err(|e| NetworkError::io("create directory", &results, e))?;
        match self.versions().await {
            Ok(versions) => {
                for v in versions.iter().filter(|v| !v.compatible) {
                    tracing::warn!(plugin = %v.plugin, supported = ?v.supported, "cni plugin does not support the config's cniVersion");
                }
                tracing::info!(conf_dir = %self.config.conf_dir.display(), plugins = versions.len(), "cni network ready");
            }
            Err(e) => {
                tracing::warn!(error = %cubelet_engine::chain(&e), "cni network not ready yet")
            }
        }
        Ok(())
    }

    /// Runs `VERSION` on every plugin of the current network config.
    pub async fn versions(&self) -> Result<Vec<PluginVersion>, NetworkError> {
        let list = conf::load(&self.config.conf_dir)?;
        let stdin = serde_json::to_vec(&serde_json::json!({ "cniVersion": list.cni_version }))
            .map_err(|e| NetworkError::CniConfig {
                path: list.source.clone(),
                reason: e.to_string(),
            })?;
        let mut out = Vec::with_capacity(list.plugins.len());
        for i in 0..list.plugins.len() {
            let plugin = list.plugin_type(i);
            let binary = exec::find(&self.config.bin_dirs, plugin)?;
            let inv = Invocation {
                op: Op::Version,
                container_id: "",
                netns: "",
                ifname: "",
                args: "",
                path: &self.cni_path,
            };
            let answer = exec::exec(&binary, plugin, &inv, &stdin).await?;
            let supported: Vec<String> = answer
                .as_ref()
                .and_then(|v| v.get("supportedVersions"))
                .and_then(Value::as_array)
                .ok_or_else(|| NetworkError::CniOutput {
                    plugin: plugin.to_owned(),
                    command: "VERSION",
                    reason: "no supportedVersions".into(),
                })?
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            out.push(PluginVersion {
                plugin: plugin.to_owned(),
                compatible: supported.contains(&list.cni_version),
                supported,
            });
        }
        Ok(out)
    }

    /// Builds the sandbox's network and returns what it publishes. On
    /// failure, whatever was built is deleted again before the error returns.
    pub async fn create_sandbox(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<NetworkStatus, NetworkError> {
        self.create_with(sandbox, spec, &|| false).await
    }

    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    async fn create_with(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
        cancelled: &(dyn Fn() -> bool + Sync),
    ) -> Result<NetworkStatus, NetworkError> {
        // Nothing is built (or undone) unless the config and all its
        // plugins are there.
        let prepare = || {
            let list = conf::load(&self.config.conf_dir)?;
            let binaries = (0..list.plugins.len())
                .map(|i| exec::find(&self.config.bin_dirs, list.plugin_type(i)))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((list, binaries))
        };
        let build = |(list, binaries): (NetworkList, Vec<PathBuf>)| async move {
            let pin = self.netns_path(sandbox);
            let userns_path = netns::create(pin.clone(), spec.namespaces.userns).await?;
            let status = self
                .attach(sandbox, spec, &list, &binaries, &pin, cancelled)
                .await?;
            Ok(NetworkStatus {
                userns_path,
                ..status
            })
        };
        create::create(
            &self.in_flight,
            sandbox,
            spec.host_network(),
            cancelled,
            prepare,
            build,
            || self.teardown(sandbox, spec),
        )
        .await
    }

    /// Loopback up, cache entry, ADD chain, cache entry with the result.
    async fn attach(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
        list: &NetworkList,
        binaries: &[PathBuf],
        pin: &Path,
        cancelled: &(dyn Fn() -> bool + Sync),
    ) -> Result<NetworkStatus, NetworkError> {
        netns::loopback_up(pin.to_path_buf()).await?;
        let args = cni_args(sandbox, spec);
        let caps = capability_args(&spec.port_mappings);
        let path = self.cache_path(&list.name, sandbox);
        let mut entry = cache::Entry {
            kind: cache::KIND.into(),
            container_id: sandbox.as_str().into(),
            network_name: list.name.clone(),
            if_name: POD_INTERFACE.into(),
            config: list.to_value(),
            cni_args: args.clone(),
            capability_args: caps.clone(),
            result: None,
        };
        // Written before ADD so that DEL finds this config even if we die
        // halfway through the chain.
        cache::write(&path, &entry)?;
        let args = join_args(&args);
        let netns = pin.to_string_lossy();
        let inv = Invocation {
            op: Op::Add,
            container_id: sandbox.as_str(),
            netns: &netns,
            ifname: POD_INTERFACE,
            args: &args,
            path: &self.cni_path,
        };
        let mut prev: Option<Value> = None;
        for (i, binary) in binaries.iter().enumerate() {
            if cancelled() {
                return Err(NetworkError::Cancelled {
                    sandbox: sandbox.clone(),
                    after: None,
                });
            }
            let plugin = list.plugin_type(i);
            let stdin = plugin_stdin(list, i, prev.as_ref(), &caps)?;
            let out = exec::exec(binary, plugin, &inv, &stdin).await?;
            prev = Some(out.ok_or_else(|| NetworkError::CniOutput {
                plugin: plugin.to_owned(),
                command: "ADD",
                reason: "no result printed".into(),
            })?);
        }
        let result = prev.unwrap_or(Value::Null);
        let last = list.plugin_type(list.plugins.len().saturating_sub(1));
        let unusable = |reason: String| NetworkError::CniOutput {
            plugin: last.to_owned(),
            command: "ADD",
            reason,
        };
        let ips = result::pod_ips(&result, POD_INTERFACE).map_err(unusable)?;
        if ips.is_empty() {
            return Err(unusable(format!("no address for {POD_INTERFACE}")));
        }
        entry.result = Some(result);
        cache::write(&path, &entry)?;
        Ok(NetworkStatus {
            netns_path: Some(pin.to_path_buf()),
            ips,
            interface: Some(POD_INTERFACE.into()),
            userns_path: None,
        })
    }

    /// Runs `CHECK` on every plugin, in order, with the cached result. A
    /// sandbox with no complete cached result is an `InvalidConfig` error;
    /// lists older than 0.4.0 or with `disableCheck` pass without running
    /// anything.
    pub async fn check_sandbox(&self, sandbox: &SandboxId) -> Result<(), NetworkError> {
        let preferred = conf::load(&self.config.conf_dir)
            .ok()
            .map(|l| self.cache_path(&l.name, sandbox));
        let (path, entry) = cache::find(
            &self.config.cache_dir,
            preferred.as_deref(),
            sandbox.as_str(),
            POD_INTERFACE,
        )?
        .ok_or_else(|| NetworkError::InvalidConfig {
            reason: format!("no cached cni result for sandbox {sandbox}"),
        })?;
        let list = NetworkList::from_value(entry.config, &path)?;
        if list.disable_check || !list.version_at_least((0, 4, 0)) {
            return Ok(());
        }
        let prev = entry.result.ok_or_else(|| NetworkError::InvalidConfig {
            reason: format!("cni ADD of sandbox {sandbox} did not complete"),
        })?;
        let pin = self.netns_path(sandbox);
        let netns = pin.to_string_lossy();
        let args = join_args(&entry.cni_args);
        let inv = Invocation {
            op: Op::Check,
            container_id: sandbox.as_str(),
            netns: &netns,
            ifname: POD_INTERFACE,
            args: &args,
            path: &self.cni_path,
        };
        for i in 0..list.plugins.len() {
            let plugin = list.plugin_type(i);
            let binary = exec::find(&self.config.bin_dirs, plugin)?;
            let stdin = plugin_stdin(&list, i, Some(&prev), &entry.capability_args)?;
            exec::exec(&binary, plugin, &inv, &stdin).await?;
        }
        Ok(())
    }

    /// Deletes the sandbox's attachment: DEL of every plugin in reverse
    /// order with the cached config and result (or, with no cache entry, the
    /// current config and `spec`), then the cache entry and the pin.
    /// Idempotent. Plugin errors are tolerated when the namespace is already
    /// gone; otherwise the first one is returned and the cache entry and pin
    /// are kept, so a retry runs DEL again.
    #[tracing::instrument(level = "debug", skip_all, fields(sandbox_id = %sandbox))]
    pub async fn teardown(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<(), NetworkError> {
        let pin = self.netns_path(sandbox);
        match self.attachment(sandbox, spec)? {
            Some(att) => {
                let pinned = netns::is_pinned(&pin);
                let netns = if pinned {
                    pin.to_string_lossy().into_owned()
                } else {
                    String::new()
                };
                if let Err(e) = self.del_chain(sandbox, &att, &netns).await {
                    if pinned {
                        return Err(e);
                    }
                    tracing::warn!(sandbox = %sandbox, error = %cubelet_engine::chain(&e), "cni DEL failed with the namespace gone; ignored");
                }
                if let Some(path) = &att.cache {
                    cache::remove(path)?;
                }
            }
            None => {
                tracing::debug!(sandbox = %sandbox, "no cni config or cache entry: nothing to DEL");
            }
        }
        netns::remove(&pin).await?;
        Ok(())
    }

    /// What DEL should run with: the cache entry, else the current config.
    fn attachment(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<Option<Attachment>, NetworkError> {
        let current = conf::load(&self.config.conf_dir);
        let preferred = current
            .as_ref()
            .ok()
            .map(|l| self.cache_path(&l.name, sandbox));
        let found = cache::find(
            &self.config.cache_dir,
            preferred.as_deref(),
            sandbox.as_str(),
            POD_INTERFACE,
        )?;
        Ok(match (found, current) {
            (Some((path, entry)), _) => Some(Attachment {
                list: NetworkList::from_value(entry.config, &path)?,
                args: entry.cni_args,
                caps: entry.capability_args,
                prev: entry.result,
                cache: Some(path),
            }),
            (None, Ok(list)) => Some(Attachment {
                list,
                args: cni_args(sandbox, spec),
                caps: capability_args(&spec.port_mappings),
                prev: None,
                cache: None,
            }),
            (None, Err(_)) => None,
        })
    }

    /// DEL of every plugin in reverse order. All are attempted; the first
    /// error is returned.
    async fn del_chain(
        &self,
        sandbox: &SandboxId,
        att: &Attachment,
        netns: &str,
    ) -> Result<(), NetworkError> {
        let list = &att.list;
        // prevResult on DEL arrived with CNI 0.4.0.
        let prev = att
            .prev
            .as_ref()
            .filter(|_| list.version_at_least((0, 4, 0)));
        let args = join_args(&att.args);
        let inv = Invocation {
            op: Op::Del,
            container_id: sandbox.as_str(),
            netns,
            ifname: POD_INTERFACE,
            args: &args,
            path: &self.cni_path,
        };
        let mut first = None;
        for i in (0..list.plugins.len()).rev() {
            let plugin = list.plugin_type(i);
            let run = async {
                let binary = exec::find(&self.config.bin_dirs, plugin)?;
                let stdin = plugin_stdin(list, i, prev, &att.caps)?;
                exec::exec(&binary, plugin, &inv, &stdin).await
            };
            if let Err(e) = run.await {
                tracing::warn!(sandbox = %sandbox, plugin, error = %cubelet_engine::chain(&e), "cni DEL failed");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Deletes the attachments of sandboxes not in `live` (DEL with the
    /// cached result, then cache entry and pin) and removes pins of dead
    /// sandboxes that have none. `live` is asked after each listing;
    /// sandboxes whose create is running in this provider count as live. A
    /// failed DEL is counted and retried next time.
    pub async fn gc(&self, live: &dyn LiveSandboxes) -> Result<CniGcReport, NetworkError> {
        let mut report = CniGcReport::default();
        let entries = cache::list(&self.config.cache_dir)?;
        let now = if entries.is_empty() {
            HashSet::new()
        } else {
            match self.in_flight.and(live) {
                Some(now) => now,
                None => return Ok(report),
            }
        };
        for (path, entry) in entries {
            let Some(id) = SandboxId::parse(&entry.container_id) else {
                tracing::warn!(path = %path.display(), "cni cache entry with an invalid sandbox id; left alone");
                continue;
            };
            if now.contains(&id) {
                continue;
            }
            match self.teardown(&id, &SandboxSpec::default()).await {
                Ok(()) => report.attachments += 1,
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %cubelet_engine::chain(&e), "cni gc failed");
                    report.failed += 1;
                }
            }
        }
        report.netns = netns::remove_pins_except(&self.netns_dir, || self.in_flight.and(live))?;
        Ok(report)
    }
}

#[async_trait]
impl Flow for CniNetwork {
    async fn init(&self) -> Result<(), StepError> {
        Ok(self.setup().await?)
    }

    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let cancelled = || ctx.cancel_token().is_cancelled();
        let status = self
            .create_with(ctx.sandbox_id(), ctx.spec(), &cancelled)
            .await?;
        ctx.publish(status);
        Ok(())
    }

    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        if ctx.spec().host_network() {
            return Ok(());
        }
        Ok(self.teardown(ctx.sandbox_id(), ctx.spec()).await?)
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
    fn bad_configs_are_rejected_and_missing_conf_is_not_ready() {
        let dir = tempfile::tempdir().unwrap();
        let good = CniConfig {
            bin_dirs: vec!["/usr/lib/cni".into()],
            conf_dir: dir.path().join("net.d"),
            state_dir: dir.path().join("state"),
            cache_dir: dir.path().join("cache"),
        };
        let net = CniNetwork::new(good.clone()).unwrap();
        assert_eq!(
            net.ready(),
            Readiness::NotReady {
                reason: "NetworkPluginNotReady",
                message: format!("no network config found in {}", good.conf_dir.display()),
            }
        );
        for bad in [
            CniConfig {
                bin_dirs: vec![],
                ..good.clone()
            },
            CniConfig {
                bin_dirs: vec!["rel".into()],
                ..good.clone()
            },
            CniConfig {
                bin_dirs: vec!["/a:/b".into()],
                ..good.clone()
            },
            CniConfig {
                conf_dir: "net.d".into(),
                ..good.clone()
            },
            CniConfig {
                cache_dir: "".into(),
                ..good.clone()
            },
        ] {
            let err = CniNetwork::new(bad).unwrap_err();
            assert_eq!(err.kind(), cubelet_engine::StepErrorKind::InvalidArgument);
        }
    }
}
