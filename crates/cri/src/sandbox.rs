//! Pod sandbox calls: converted here, run by the pod service.

use std::time::SystemTime;

use cubelet_cri_api::v1 as cri;

use crate::convert;
use crate::error::CriResult;
use crate::service::Cri;

impl Cri {
    pub(crate) async fn run_pod_sandbox_impl(
        &self,
        r: cri::RunPodSandboxRequest,
    ) -> CriResult<cri::RunPodSandboxResponse> {
        // One lookup: the handler's name (the default for none) and config.
        let (handler, config) = self.deps().runtime.handler(&r.runtime_handler)?;
        let spec = convert::sandbox_spec(r.config.as_ref(), handler)?;
        crate::features::check_userns(&spec, config)?;
        let id = self.pods().run_sandbox(spec).await?;
        Ok(cri::RunPodSandboxResponse {
            pod_sandbox_id: id.to_string(),
        })
    }

    pub(crate) async fn pod_sandbox_status_impl(
        &self,
        r: cri::PodSandboxStatusRequest,
    ) -> CriResult<cri::PodSandboxStatusResponse> {
        let rec = self
            .pods()
            .require_sandbox("pod_sandbox_id", &r.pod_sandbox_id)?;
        self.pods().note_seen([&rec.id]);
        let status = convert::pod_sandbox_status(&rec);
        let mut info = std::collections::HashMap::new();
        if r.verbose {
            let history = self.pods().history(&rec.id);
            let verbose = serde_json::json!({
                "sandboxID": rec.id.as_str(),
                "state": rec.state.as_str(),
                "pid": rec.process.as_ref().and_then(|p| p.pid),
                "infraContainer": rec.process.as_ref().map(|p| !p.is_infraless()),
                "ipcPath": rec.process.as_ref().and_then(|p| p.ipc_path.clone()),
                "utsPath": rec.process.as_ref().and_then(|p| p.uts_path.clone()),
                "runtimeHandler": rec.spec.runtime_handler,
                "netnsPath": rec.network.as_ref().and_then(|n| n.netns_path.clone()),
                "sandboxDir": rec.storage.as_ref().map(|s| s.sandbox_dir.clone()),
                "lastError": rec.last_error,
                "cleanupAttempts": rec.cleanup_attempts,
                "config": rec.spec,
                "flows": history.iter().map(|f| serde_json::json!({
                    "flow": f.kind.as_str(),
                    "state": f.state,
                    "error": f.error,
                    "steps": f.steps.iter().map(|s| serde_json::json!({
                        "step": s.step,
                        "stage": s.stage,
                        "durationMs": s.duration.map(|d| d.as_secs_f64() * 1000.0),
                        "error": s.error,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            });
            info.insert("info".to_owned(), verbose.to_string());
        }
        Ok(cri::PodSandboxStatusResponse {
            status: Some(status),
            info,
            containers_statuses: Vec::new(),
            timestamp: convert::nanos(SystemTime::now()),
        })
    }

    /// `UpdatePodSandboxResources`: kubelet (1.33+) tells the runtime the
    /// pod's new overhead and total resources after it resized the pod's
    /// cgroup itself. The pod cgroup (`cgroup_parent`) is kubelet's, not
    /// Cubelet's, so nothing is written to it: the call is checked (sandbox
    /// known, resources valid) and recorded as an event in the log. The
    /// containers' own cgroups follow `UpdateContainerResources`.
    pub(crate) fn update_pod_sandbox_resources_impl(
        &self,
        r: &cri::UpdatePodSandboxResourcesRequest,
    ) -> CriResult<cri::UpdatePodSandboxResourcesResponse> {
        check_sandbox_resources(r)?;
        let rec = self
            .pods()
            .require_sandbox("pod_sandbox_id", &r.pod_sandbox_id)?;
        let summary = |res: Option<&cri::LinuxContainerResources>| {
            res.map(|x| {
                format!(
                    "cpu_shares={} cpu_quota={} cpu_period={} memory_limit_in_bytes={} cpuset_cpus={:?}",
                    x.cpu_shares, x.cpu_quota, x.cpu_period, x.memory_limit_in_bytes, x.cpuset_cpus
                )
            })
        };
        tracing::info!(
            sandbox = %rec.id,
            overhead = summary(r.overhead.as_ref()),
            resources = summary(r.resources.as_ref()),
            "pod-level resources updated by kubelet"
        );
        Ok(cri::UpdatePodSandboxResourcesResponse {})
    }

    pub(crate) fn list_pod_sandbox_impl(
        &self,
        r: cri::ListPodSandboxRequest,
    ) -> CriResult<cri::ListPodSandboxResponse> {
        let filter = r.filter.unwrap_or_default();
        let listed: Vec<_> = self
            .pods()
            .list_sandboxes()?
            .into_iter()
            .filter(|rec| convert::sandbox_matches(&filter, rec))
            .collect();
        // What kubelet is told about it still tracks: the GC leaves those.
        self.pods().note_seen(listed.iter().map(|rec| &rec.id));
        let items = listed.iter().map(|rec| convert::pod_sandbox(rec)).collect();
        Ok(cri::ListPodSandboxResponse { items })
    }
}

/// The checks of `UpdatePodSandboxResources` that need no sandbox: an id,
/// and both resource sets (each optional) valid as a container's would be.
fn check_sandbox_resources(r: &cri::UpdatePodSandboxResourcesRequest) -> CriResult<()> {
    if r.pod_sandbox_id.is_empty() {
        return Err(crate::error::CriError::invalid(
            "pod_sandbox_id",
            "must not be empty",
        ));
    }
    if let Some(o) = &r.overhead {
        crate::validate::resources("overhead", o)?;
    }
    if let Some(res) = &r.resources {
        crate::validate::resources("resources", res)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::error::CriError;

    fn field(r: &cri::UpdatePodSandboxResourcesRequest) -> String {
        // Through the wire, as kubelet sends it.
        let r =
            cri::UpdatePodSandboxResourcesRequest::decode(r.encode_to_vec().as_slice()).unwrap();
        match check_sandbox_resources(&r) {
            Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn update_pod_sandbox_resources_checks_its_fields() {
        let good = cri::LinuxContainerResources {
            cpu_shares: 512,
            cpu_quota: 50_000,
            cpu_period: 100_000,
            memory_limit_in_bytes: 256 << 20,
            ..Default::default()
        };
        let mut r = cri::UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: "abc".into(),
            overhead: Some(good.clone()),
            resources: Some(good.clone()),
        };
        let back =
            cri::UpdatePodSandboxResourcesRequest::decode(r.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, r);
        check_sandbox_resources(&back).unwrap();
        // Both sets are optional.
        r.overhead = None;
        r.resources = None;
        check_sandbox_resources(&r).unwrap();
        r.pod_sandbox_id.clear();
        assert_eq!(field(&r), "pod_sandbox_id");
        r.pod_sandbox_id = "abc".into();
        r.resources = Some(cri::LinuxContainerResources {
            cpu_shares: 1,
            ..good.clone()
        });
        assert_eq!(field(&r), "resources.cpu_shares");
        r.resources = None;
        r.overhead = Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: -5,
            ..good
        });
        assert_eq!(field(&r), "overhead.memory_limit_in_bytes");
    }
}
