//! Container calls: converted here, run by the pod service.

use std::time::Duration;

use cubelet_cri_api::v1 as cri;

use crate::convert;
use crate::error::CriResult;
use crate::service::Cri;

impl Cri {
    pub(crate) async fn create_container_impl(
        &self,
        r: cri::CreateContainerRequest,
    ) -> CriResult<cri::CreateContainerResponse> {
        let req = convert::container_request(r.config.as_ref())?;
        let config = r.config;
        let meta = config.as_ref().and_then(|c| c.metadata.as_ref());
        let (name, attempt) = meta.map_or((String::new(), 0), |m| (m.name.clone(), m.attempt));
        // Checked against the pod's record the service reads under its lock.
        let container_id = self
            .pods()
            .create_container_checked(&r.pod_sandbox_id, req, move |pod| {
                crate::validate::container_userns(config.as_ref(), &pod.spec.namespaces)
            })
            .await?;
        // At INFO, as containerd logs its CRI container calls: what an
        // operator reads to follow a pod's containers.
        tracing::info!(
            container_id = %container_id,
            sandbox_id = %r.pod_sandbox_id,
            name = %name,
            attempt,
            "container created"
        );
        Ok(cri::CreateContainerResponse { container_id })
    }

    pub(crate) async fn start_container_impl(&self, id: &str) -> CriResult<()> {
        self.pods().start_container(id).await?;
        tracing::info!(container_id = %id, "container started");
        Ok(())
    }

    pub(crate) async fn stop_container_impl(&self, id: &str, timeout: i64) -> CriResult<()> {
        let timeout = Duration::from_secs(u64::try_from(timeout).unwrap_or(0));
        self.pods().stop_container(id, timeout).await?;
        tracing::info!(container_id = %id, timeout = ?timeout, "container stopped");
        Ok(())
    }

    pub(crate) async fn remove_container_impl(&self, id: &str) -> CriResult<()> {
        let removed = self.pods().remove_container(id).await;
        self.inner.fs_info.invalidate();
        if let Some(id) = removed? {
            tracing::info!(container_id = %id, "container removed");
        }
        Ok(())
    }

    pub(crate) fn list_containers_impl(
        &self,
        r: cri::ListContainersRequest,
    ) -> CriResult<cri::ListContainersResponse> {
        let f = r.filter.unwrap_or_default();
        let containers = self
            .pods()
            .list_containers()?
            .iter()
            .filter(|c| convert::container_matches(&f, c))
            .map(|c| convert::container(c))
            .collect();
        Ok(cri::ListContainersResponse { containers })
    }

    pub(crate) async fn container_status_impl(
        &self,
        r: cri::ContainerStatusRequest,
    ) -> CriResult<cri::ContainerStatusResponse> {
        let c = self.pods().container_status(&r.container_id).await?;
        let mut info = std::collections::HashMap::new();
        if r.verbose {
            info.insert(
                "info".to_owned(),
                serde_json::json!({ "pid": c.pid, "sandboxID": c.sandbox_id.as_str(), "record": c })
                    .to_string(),
            );
        }
        let user = self.deps().runtime.process_user(&c.id).await.ok().flatten();
        Ok(cri::ContainerStatusResponse {
            status: Some(cri::ContainerStatus {
                user: convert::container_user(user.as_ref()),
                ..convert::container_status(&c)
            }),
            info,
        })
    }

    pub(crate) async fn exec_sync_impl(
        &self,
        r: cri::ExecSyncRequest,
    ) -> CriResult<cri::ExecSyncResponse> {
        crate::validate::exec_cmd("cmd", &r.cmd)?;
        let timeout = u64::try_from(r.timeout)
            .ok()
            .filter(|t| *t > 0)
            .map(Duration::from_secs);
        let out = self
            .pods()
            .exec_sync(&r.container_id, &r.cmd, timeout)
            .await?;
        Ok(cri::ExecSyncResponse {
            stdout: out.stdout,
            stderr: out.stderr,
            exit_code: out.exit_code,
        })
    }

    pub(crate) async fn update_container_resources_impl(
        &self,
        r: cri::UpdateContainerResourcesRequest,
    ) -> CriResult<()> {
        if let Some(linux) = &r.linux {
            crate::validate::resources("linux", linux)?;
        }
        let res = convert::container_resources(r.linux.as_ref());
        Ok(self.pods().update_resources(&r.container_id, &res).await?)
    }

    pub(crate) async fn reopen_container_log_impl(&self, id: &str) -> CriResult<()> {
        Ok(self.pods().reopen_log(id).await?)
    }
}
