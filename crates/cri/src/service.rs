//! The CRI service object and the tonic trait implementations, which only
//! measure, convert errors and delegate to the sandbox, container and image
//! modules.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubelet_cri_api::v1 as cri;
use cubelet_cri_api::v1::image_service_server::ImageService;
use cubelet_cri_api::v1::runtime_service_server::RuntimeService;
use cubelet_pod::PodService;
use cubelet_runtime::container::ContainerRuntime;
use cubelet_runtime::image::ImageService as Images;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::{CriError, CriResult};

/// Receives one call per CRI request (the binary exports these as metrics).
pub trait CriObserver: Send + Sync + 'static {
    /// A request to `method` ended with `code` after `elapsed`.
    fn request(&self, method: &'static str, code: tonic::Code, elapsed: Duration);

    /// A `GetContainerEvents` subscriber fell behind and lost `n` events.
    fn events_dropped(&self, _n: u64) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopCriObserver;

impl CriObserver for NoopCriObserver {
    fn request(&self, _method: &'static str, _code: tonic::Code, _elapsed: Duration) {}
}

/// Node conditions for CRI `Status`, owned by the binary.
pub trait NodeConditions: Send + Sync + 'static {
    /// `(ready, reason, message)` of the runtime.
    fn runtime_ready(&self) -> (bool, String, String);
    /// `(ready, reason, message)` of the network.
    fn network_ready(&self) -> (bool, String, String);
}

/// What the CRI shim is built from.
pub struct CriDeps {
    /// Every pod and container transition, and the records.
    pub pods: PodService,
    /// containerd's containers, read for cgroup support, handlers and users.
    pub runtime: Arc<ContainerRuntime>,
    /// Images.
    pub images: Arc<Images>,
    /// Status conditions.
    pub conditions: Arc<dyn NodeConditions>,
    /// Request metrics.
    pub observer: Arc<dyn CriObserver>,
    /// Cgroup driver reported by `RuntimeConfig`.
    pub cgroup_driver: cri::CgroupDriver,
    /// The pause image reference (never garbage collected, reported pinned).
    pub pause_image: String,
    /// Snapshotter root and content store root, measured by `ImageFsInfo`.
    pub image_fs: (std::path::PathBuf, std::path::PathBuf),
    /// Extra verbose info for `Status` (config, versions), as JSON strings.
    pub status_info: HashMap<String, String>,
    /// The streaming server for Exec/Attach/PortForward; `None` answers
    /// those calls with `Unimplemented`.
    pub streaming: Option<cubelet_streaming::StreamingServer>,
}

impl fmt::Debug for CriDeps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CriDeps")
            .field("pause_image", &self.pause_image)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) deps: CriDeps,
    /// The image filesystem's mount point as stats name it (the
    /// snapshotter root of `deps.image_fs`).
    pub(crate) image_fs_mountpoint: String,
    /// The last `ImageFsInfo` measurement.
    pub(crate) fs_info: crate::image::FsInfoCache,
    /// Cancelled at shutdown: ends every `GetContainerEvents` stream.
    pub(crate) events_closed: tokio_util::sync::CancellationToken,
}

/// The CRI shim: implements `RuntimeService` and `ImageService`.
#[derive(Clone)]
pub struct Cri {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Cri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cri").finish_non_exhaustive()
    }
}

impl Cri {
    /// Builds the shim.
    pub fn new(deps: CriDeps) -> Self {
        Self {
            inner: Arc::new(Inner {
                image_fs_mountpoint: deps.image_fs.0.display().to_string(),
                deps,
                fs_info: crate::image::FsInfoCache::default(),
                events_closed: tokio_util::sync::CancellationToken::new(),
            }),
        }
    }

    pub(crate) fn deps(&self) -> &CriDeps {
        &self.inner.deps
    }

    /// The pod service behind the lifecycle calls.
    pub(crate) fn pods(&self) -> &PodService {
        &self.inner.deps.pods
    }

    /// Runs a handler body in a span of its own: measures it and maps its
    /// error to a status.
    async fn call<T>(
        &self,
        method: &'static str,
        body: impl Future<Output = CriResult<T>>,
    ) -> Result<Response<T>, Status> {
        let started = Instant::now();
        let result = body.instrument(tracing::info_span!("cri", method)).await;
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(e) => e.code(),
        };
        self.deps()
            .observer
            .request(method, code, started.elapsed());
        match result {
            Ok(v) => Ok(Response::new(v)),
            Err(e) => {
                if matches!(code, tonic::Code::Internal | tonic::Code::Unavailable) {
                    tracing::warn!(method, error = %cubelet_engine::chain(&e), "request failed");
                } else {
                    tracing::debug!(method, error = %e, "request refused");
                }
                Err(Status::from(e))
            }
        }
    }
}

/// The version Cubelet reports to kubelet (`RuntimeVersion`, the node's
/// `containerRuntimeVersion`): `CUBELET_BUILD_VERSION` at build time when
/// set (a build told apart from another of the same source, e.g. the
/// upgrade of `hack/vm.sh helm`), else the crate version.
const RUNTIME_VERSION: &str = match option_env!("CUBELET_BUILD_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

fn unimplemented<T>(what: &str) -> CriResult<T> {
    Err(CriError::Unimplemented(format!(
        "{what} is not supported by cubelet yet"
    )))
}

#[tonic::async_trait]
impl RuntimeService for Cri {
    async fn version(
        &self,
        _r: Request<cri::VersionRequest>,
    ) -> Result<Response<cri::VersionResponse>, Status> {
        self.call("Version", async {
            Ok(cri::VersionResponse {
                version: "0.1.0".into(),
                runtime_name: "cubelet".into(),
                runtime_version: RUNTIME_VERSION.into(),
                runtime_api_version: "v1".into(),
            })
        })
        .await
    }

    async fn run_pod_sandbox(
        &self,
        r: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        let r = r.into_inner();
        self.call("RunPodSandbox", self.run_pod_sandbox_impl(r))
            .await
    }

    async fn stop_pod_sandbox(
        &self,
        r: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        let r = r.into_inner();
        self.call("StopPodSandbox", async {
            self.pods().stop_sandbox(&r.pod_sandbox_id).await?;
            tracing::info!(sandbox_id = %r.pod_sandbox_id, "pod sandbox stopped");
            Ok(cri::StopPodSandboxResponse {})
        })
        .await
    }

    async fn remove_pod_sandbox(
        &self,
        r: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        let r = r.into_inner();
        self.call("RemovePodSandbox", async {
            let removed = self.pods().remove_sandbox(&r.pod_sandbox_id).await;
            // A failed removal may have removed some of the pod's containers.
            self.inner.fs_info.invalidate();
            removed?;
            tracing::info!(sandbox_id = %r.pod_sandbox_id, "pod sandbox removed");
            Ok(cri::RemovePodSandboxResponse {})
        })
        .await
    }

    async fn pod_sandbox_status(
        &self,
        r: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        let r = r.into_inner();
        self.call("PodSandboxStatus", self.pod_sandbox_status_impl(r))
            .await
    }

    async fn list_pod_sandbox(
        &self,
        r: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        let r = r.into_inner();
        self.call("ListPodSandbox", async { self.list_pod_sandbox_impl(r) })
            .await
    }

    async fn create_container(
        &self,
        r: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        let r = r.into_inner();
        self.call("CreateContainer", self.create_container_impl(r))
            .await
    }

    async fn start_container(
        &self,
        r: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        let r = r.into_inner();
        self.call("StartContainer", async {
            self.start_container_impl(&r.container_id).await?;
            Ok(cri::StartContainerResponse {})
        })
        .await
    }

    async fn stop_container(
        &self,
        r: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        let r = r.into_inner();
        self.call("StopContainer", async {
            self.stop_container_impl(&r.container_id, r.timeout).await?;
            Ok(cri::StopContainerResponse {})
        })
        .await
    }

    async fn remove_container(
        &self,
        r: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        let r = r.into_inner();
        self.call("RemoveContainer", async {
            self.remove_container_impl(&r.container_id).await?;
            Ok(cri::RemoveContainerResponse {})
        })
        .await
    }

    async fn list_containers(
        &self,
        r: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        let r = r.into_inner();
        self.call("ListContainers", async { self.list_containers_impl(r) })
            .await
    }

    async fn container_status(
        &self,
        r: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        let r = r.into_inner();
        self.call("ContainerStatus", self.container_status_impl(r))
            .await
    }

    async fn update_container_resources(
        &self,
        r: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        let r = r.into_inner();
        self.call("UpdateContainerResources", async {
            self.update_container_resources_impl(r).await?;
            Ok(cri::UpdateContainerResourcesResponse {})
        })
        .await
    }

    async fn reopen_container_log(
        &self,
        r: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        let r = r.into_inner();
        self.call("ReopenContainerLog", async {
            self.reopen_container_log_impl(&r.container_id).await?;
            Ok(cri::ReopenContainerLogResponse {})
        })
        .await
    }

    async fn exec_sync(
        &self,
        r: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        let r = r.into_inner();
        self.call("ExecSync", self.exec_sync_impl(r)).await
    }

    async fn exec(
        &self,
        r: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        let r = r.into_inner();
        self.call("Exec", self.exec_impl(r)).await
    }

    async fn attach(
        &self,
        r: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        let r = r.into_inner();
        self.call("Attach", self.attach_impl(r)).await
    }

    async fn port_forward(
        &self,
        r: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        let r = r.into_inner();
        self.call("PortForward", self.port_forward_impl(r)).await
    }

    async fn container_stats(
        &self,
        r: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        let r = r.into_inner();
        self.call("ContainerStats", self.container_stats_impl(r))
            .await
    }

    async fn list_container_stats(
        &self,
        r: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        let r = r.into_inner();
        self.call("ListContainerStats", self.list_container_stats_impl(r))
            .await
    }

    async fn pod_sandbox_stats(
        &self,
        r: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        let r = r.into_inner();
        self.call("PodSandboxStats", self.pod_sandbox_stats_impl(r))
            .await
    }

    async fn list_pod_sandbox_stats(
        &self,
        r: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        let r = r.into_inner();
        self.call("ListPodSandboxStats", self.list_pod_sandbox_stats_impl(r))
            .await
    }

    async fn update_runtime_config(
        &self,
        _r: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        // kubelet sends the pod CIDR here; the bridge provider takes its
        // subnet from configuration, so there is nothing to change.
        self.call("UpdateRuntimeConfig", async {
            Ok(cri::UpdateRuntimeConfigResponse {})
        })
        .await
    }

    async fn status(
        &self,
        r: Request<cri::StatusRequest>,
    ) -> Result<Response<cri::StatusResponse>, Status> {
        let verbose = r.into_inner().verbose;
        self.call("Status", async {
            let cond = |t: &str, (status, reason, message): (bool, String, String)| {
                cri::RuntimeCondition {
                    r#type: t.to_owned(),
                    status,
                    reason,
                    message,
                }
            };
            let c = &self.deps().conditions;
            let info = if verbose {
                let mut info = self.deps().status_info.clone();
                // What the node's cgroups can enforce, and which requested
                // resources were left out of specs for want of a controller.
                let cgroups = self.deps().runtime.cgroups().report();
                if let Ok(json) = serde_json::to_string(&cgroups) {
                    info.insert("cgroups".to_owned(), json);
                }
                info
            } else {
                HashMap::new()
            };
            let handlers = crate::features::runtime_handlers(self.deps().runtime.config());
            Ok(cri::StatusResponse {
                status: Some(cri::RuntimeStatus {
                    conditions: vec![
                        cond("RuntimeReady", c.runtime_ready()),
                        cond("NetworkReady", c.network_ready()),
                    ],
                }),
                info,
                runtime_handlers: handlers,
                features: Some(crate::features::runtime_features()),
            })
        })
        .await
    }

    async fn checkpoint_container(
        &self,
        _r: Request<cri::CheckpointContainerRequest>,
    ) -> Result<Response<cri::CheckpointContainerResponse>, Status> {
        self.call("CheckpointContainer", async {
            if crate::features::on_path("criu") {
                unimplemented(
                    "CheckpointContainer (criu is installed, but checkpointing is not implemented)",
                )
            } else {
                unimplemented("CheckpointContainer (needs CRIU, which this node does not have)")
            }
        })
        .await
    }

    type GetContainerEventsStream = crate::events::EventStream;

    async fn get_container_events(
        &self,
        _r: Request<cri::GetEventsRequest>,
    ) -> Result<Response<Self::GetContainerEventsStream>, Status> {
        self.call("GetContainerEvents", async { Ok(self.container_events()) })
            .await
    }

    async fn list_metric_descriptors(
        &self,
        _r: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Result<Response<cri::ListMetricDescriptorsResponse>, Status> {
        self.call("ListMetricDescriptors", async {
            Ok(cri::ListMetricDescriptorsResponse {
                descriptors: crate::metrics_cri::descriptors(),
            })
        })
        .await
    }

    async fn list_pod_sandbox_metrics(
        &self,
        _r: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Result<Response<cri::ListPodSandboxMetricsResponse>, Status> {
        self.call(
            "ListPodSandboxMetrics",
            self.list_pod_sandbox_metrics_impl(),
        )
        .await
    }

    async fn runtime_config(
        &self,
        _r: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        self.call("RuntimeConfig", async {
            Ok(cri::RuntimeConfigResponse {
                linux: Some(cri::LinuxRuntimeConfiguration {
                    cgroup_driver: self.deps().cgroup_driver as i32,
                }),
            })
        })
        .await
    }

    type StreamPodSandboxesStream = ListStream<cri::StreamPodSandboxesResponse>;

    async fn stream_pod_sandboxes(
        &self,
        r: Request<cri::StreamPodSandboxesRequest>,
    ) -> Result<Response<Self::StreamPodSandboxesStream>, Status> {
        let filter = r.into_inner().filter;
        self.call("StreamPodSandboxes", async {
            let items = self
                .list_pod_sandbox_impl(cri::ListPodSandboxRequest { filter })?
                .items;
            Ok(list_stream(items, |pod_sandboxes| {
                cri::StreamPodSandboxesResponse { pod_sandboxes }
            }))
        })
        .await
    }

    type StreamContainersStream = ListStream<cri::StreamContainersResponse>;

    async fn stream_containers(
        &self,
        r: Request<cri::StreamContainersRequest>,
    ) -> Result<Response<Self::StreamContainersStream>, Status> {
        let filter = r.into_inner().filter;
        self.call("StreamContainers", async {
            let items = self
                .list_containers_impl(cri::ListContainersRequest { filter })?
                .containers;
            Ok(list_stream(items, |containers| {
                cri::StreamContainersResponse { containers }
            }))
        })
        .await
    }

    type StreamContainerStatsStream = ListStream<cri::StreamContainerStatsResponse>;

    async fn stream_container_stats(
        &self,
        r: Request<cri::StreamContainerStatsRequest>,
    ) -> Result<Response<Self::StreamContainerStatsStream>, Status> {
        let filter = r.into_inner().filter;
        self.call("StreamContainerStats", async {
            let items = self
                .list_container_stats_impl(cri::ListContainerStatsRequest { filter })
                .await?
                .stats;
            Ok(list_stream(items, |container_stats| {
                cri::StreamContainerStatsResponse { container_stats }
            }))
        })
        .await
    }

    type StreamPodSandboxStatsStream = ListStream<cri::StreamPodSandboxStatsResponse>;

    async fn stream_pod_sandbox_stats(
        &self,
        r: Request<cri::StreamPodSandboxStatsRequest>,
    ) -> Result<Response<Self::StreamPodSandboxStatsStream>, Status> {
        let filter = r.into_inner().filter;
        self.call("StreamPodSandboxStats", async {
            let items = self
                .list_pod_sandbox_stats_impl(cri::ListPodSandboxStatsRequest { filter })
                .await?
                .stats;
            Ok(list_stream(items, |pod_sandbox_stats| {
                cri::StreamPodSandboxStatsResponse { pod_sandbox_stats }
            }))
        })
        .await
    }

    type StreamPodSandboxMetricsStream = ListStream<cri::StreamPodSandboxMetricsResponse>;

    async fn stream_pod_sandbox_metrics(
        &self,
        _r: Request<cri::StreamPodSandboxMetricsRequest>,
    ) -> Result<Response<Self::StreamPodSandboxMetricsStream>, Status> {
        self.call("StreamPodSandboxMetrics", async {
            let items = self.list_pod_sandbox_metrics_impl().await?.pod_metrics;
            Ok(list_stream(items, |pod_sandbox_metrics| {
                cri::StreamPodSandboxMetricsResponse {
                    pod_sandbox_metrics,
                }
            }))
        })
        .await
    }

    async fn update_pod_sandbox_resources(
        &self,
        r: Request<cri::UpdatePodSandboxResourcesRequest>,
    ) -> Result<Response<cri::UpdatePodSandboxResourcesResponse>, Status> {
        let r = r.into_inner();
        self.call("UpdatePodSandboxResources", async {
            self.update_pod_sandbox_resources_impl(&r)
        })
        .await
    }
}

#[tonic::async_trait]
impl ImageService for Cri {
    async fn list_images(
        &self,
        r: Request<cri::ListImagesRequest>,
    ) -> Result<Response<cri::ListImagesResponse>, Status> {
        let r = r.into_inner();
        self.call("ListImages", self.list_images_impl(r)).await
    }

    async fn image_status(
        &self,
        r: Request<cri::ImageStatusRequest>,
    ) -> Result<Response<cri::ImageStatusResponse>, Status> {
        let r = r.into_inner();
        self.call("ImageStatus", self.image_status_impl(r)).await
    }

    async fn pull_image(
        &self,
        r: Request<cri::PullImageRequest>,
    ) -> Result<Response<cri::PullImageResponse>, Status> {
        let r = r.into_inner();
        self.call("PullImage", self.pull_image_impl(r)).await
    }

    async fn remove_image(
        &self,
        r: Request<cri::RemoveImageRequest>,
    ) -> Result<Response<cri::RemoveImageResponse>, Status> {
        let r = r.into_inner();
        self.call("RemoveImage", async {
            self.remove_image_impl(r).await?;
            Ok(cri::RemoveImageResponse {})
        })
        .await
    }

    async fn image_fs_info(
        &self,
        _r: Request<cri::ImageFsInfoRequest>,
    ) -> Result<Response<cri::ImageFsInfoResponse>, Status> {
        self.call("ImageFsInfo", self.image_fs_info_impl()).await
    }

    type StreamImagesStream = ListStream<cri::StreamImagesResponse>;

    async fn stream_images(
        &self,
        r: Request<cri::StreamImagesRequest>,
    ) -> Result<Response<Self::StreamImagesStream>, Status> {
        let filter = r.into_inner().filter;
        self.call("StreamImages", async {
            let items = self
                .list_images_impl(cri::ListImagesRequest { filter })
                .await?
                .images;
            Ok(list_stream(items, |images| cri::StreamImagesResponse {
                images,
            }))
        })
        .await
    }
}

/// The stream type of the `Stream*` list methods (CRI 1.36).
pub(crate) type ListStream<T> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

/// Items per message of a `Stream*` reply: well under gRPC's 4 MiB default
/// message limit even for the largest items (pod stats with containers).
pub(crate) const STREAM_CHUNK: usize = 100;

/// A `Stream*` reply (CRI 1.36, KEP 5825): the items of the matching list
/// call, each exactly once, in messages of 1..=[`STREAM_CHUNK`] items, then
/// the end of the stream; no message at all when there are none.
pub(crate) fn list_stream<I, T>(items: Vec<I>, wrap: fn(Vec<I>) -> T) -> ListStream<T>
where
    I: Send + 'static,
    T: Send + 'static,
{
    let mut chunks = Vec::with_capacity(items.len().div_ceil(STREAM_CHUNK));
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(Ok(wrap(items.by_ref().take(STREAM_CHUNK).collect())));
    }
    Box::pin(futures::stream::iter(chunks))
}

#[cfg(test)]
mod stream_tests {
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn list_streams_send_each_item_once_in_bounded_messages() {
        let wrap = |images| cri::StreamImagesResponse { images };
        let image = |n: usize| cri::Image {
            id: format!("sha256:{n}"),
            ..Default::default()
        };
        assert_eq!(list_stream(Vec::new(), wrap).count().await, 0);
        let items: Vec<_> = (0..2 * STREAM_CHUNK + 1).map(image).collect();
        let got: Vec<_> = list_stream(items.clone(), wrap).collect().await;
        let sizes: Vec<_> = got
            .iter()
            .map(|r| r.as_ref().map_or(0, |m| m.images.len()))
            .collect();
        assert_eq!(sizes, vec![STREAM_CHUNK, STREAM_CHUNK, 1]);
        let flat: Vec<_> = got.into_iter().flat_map(|r| r.unwrap().images).collect();
        assert_eq!(flat, items);
    }
}
