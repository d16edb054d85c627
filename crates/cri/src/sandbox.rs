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
