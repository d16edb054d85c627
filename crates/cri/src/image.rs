//! Image calls, served by the runtime crate's image service.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cubelet_cri_api::v1 as cri;
use cubelet_runtime::image::{FsUsage, RegistryAuth};
use cubelet_runtime::stats::SNAPSHOT_USAGE_PERIOD;
use cubelet_runtime::types::ImageInfo;

use crate::error::{CriError, CriResult};
use crate::service::Cri;

fn image_ref(field: &str, spec: Option<&cri::ImageSpec>) -> CriResult<String> {
    let image = spec.map(|s| s.image.clone()).unwrap_or_default();
    if image.is_empty() {
        return Err(CriError::invalid(field, "must not be empty"));
    }
    Ok(image)
}

/// How long an `ImageFsInfo` measurement answers the calls after it: as
/// long as containerd's CRI goes between two readings of its snapshots.
pub(crate) const FS_INFO_MAX_AGE: Duration = SNAPSHOT_USAGE_PERIOD;

/// The last `ImageFsInfo` measurement. kubelet asks for it several times in
/// ten seconds (eviction manager, summary API, image GC), and measuring walks
/// the snapshotter root and the content store, whose trees grow with every
/// container and image (about 30 ms at 250 pods). A measurement answers for
/// [`FS_INFO_MAX_AGE`] unless a call that changes those trees (a pull, a
/// removal of an image, a container or a pod) has come since: kubelet reads
/// the usage again right after its image and container GC, to see what they
/// freed, and must not be told the usage from before. Calls that find no
/// answer while one is being measured wait for it rather than walk again.
#[derive(Debug, Default)]
pub(crate) struct FsInfoCache {
    /// Bumped by every call that changes the trees.
    generation: AtomicU64,
    /// The last measurement: the generation it started at, when, what.
    last: tokio::sync::Mutex<Option<(u64, Instant, Vec<FsUsage>)>>,
}

impl FsInfoCache {
    /// Tells the cache the trees have changed: the next call measures.
    pub(crate) fn invalidate(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The last measurement if it is still good, else `measure`'s (kept).
    pub(crate) async fn get_or_measure<F, Fut, E>(&self, measure: F) -> Result<Vec<FsUsage>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<FsUsage>, E>>,
    {
        let mut last = self.last.lock().await;
        // Read before measuring: a change during the walk leaves the
        // measurement stale for the next call.
        let generation = self.generation.load(Ordering::Acquire);
        if let Some((at_generation, at, usage)) = last.as_ref() {
            if *at_generation == generation && at.elapsed() < FS_INFO_MAX_AGE {
                return Ok(usage.clone());
            }
        }
        let usage = measure().await?;
        *last = Some((generation, Instant::now(), usage.clone()));
        Ok(usage)
    }
}

/// `PullImageResponse` of a pulled image. CRI 1.36: `image_ref` is the
/// image's id, the same value as `Image.id` ([`cri_image`]) and a created
/// container's `Container.image_id` and `ContainerStatus.image_id` (the pod
/// service records `ImageInfo::id`): the config digest, never a manifest or
/// repo digest.
pub(crate) fn pull_response(info: &ImageInfo) -> cri::PullImageResponse {
    cri::PullImageResponse {
        image_ref: info.id.clone(),
    }
}

/// The CRI `Image` of `info`; `Image.id` is the config digest (see
/// [`pull_response`]).
pub(crate) fn cri_image(info: &ImageInfo, pinned: bool) -> cri::Image {
    let (uid, username) = match info.config.user.split(':').next().unwrap_or("") {
        "" => (None, String::new()),
        u => match u.parse::<i64>() {
            Ok(n) => (Some(cri::Int64Value { value: n }), String::new()),
            Err(_) => (None, u.to_owned()),
        },
    };
    cri::Image {
        id: info.id.clone(),
        repo_tags: info.repo_tags.clone(),
        repo_digests: info.repo_digests.clone(),
        size: info.size,
        uid,
        username,
        spec: Some(cri::ImageSpec {
            image: info.id.clone(),
            ..Default::default()
        }),
        pinned,
    }
}

impl Cri {
    fn to_cri_image(&self, info: &ImageInfo) -> cri::Image {
        let pinned = info.pinned || info.repo_tags.iter().any(|t| t == &self.deps().pause_image);
        cri_image(info, pinned)
    }

    pub(crate) async fn list_images_impl(
        &self,
        r: cri::ListImagesRequest,
    ) -> CriResult<cri::ListImagesResponse> {
        let filter = r
            .filter
            .and_then(|f| f.image)
            .map(|i| i.image)
            .unwrap_or_default();
        let images = if filter.is_empty() {
            self.deps().images.list().await?
        } else {
            self.deps()
                .images
                .status(&filter)
                .await?
                .into_iter()
                .collect()
        };
        Ok(cri::ListImagesResponse {
            images: images.iter().map(|i| self.to_cri_image(i)).collect(),
        })
    }

    pub(crate) async fn image_status_impl(
        &self,
        r: cri::ImageStatusRequest,
    ) -> CriResult<cri::ImageStatusResponse> {
        let reference = image_ref("image.image", r.image.as_ref())?;
        // An image that is not present is not an error: the status is empty.
        let Some(info) = self.deps().images.status(&reference).await? else {
            return Ok(cri::ImageStatusResponse::default());
        };
        let mut extra = std::collections::HashMap::new();
        if r.verbose {
            extra.insert(
                "info".to_owned(),
                serde_json::json!({
                    "chainID": info.chain_id,
                    "target": info.target_digest,
                    "imageSpec": info.config,
                })
                .to_string(),
            );
        }
        Ok(cri::ImageStatusResponse {
            image: Some(self.to_cri_image(&info)),
            info: extra,
        })
    }

    pub(crate) async fn pull_image_impl(
        &self,
        r: cri::PullImageRequest,
    ) -> CriResult<cri::PullImageResponse> {
        let reference = image_ref("image.image", r.image.as_ref())?;
        let auth = r.auth.map(|a| RegistryAuth {
            username: a.username,
            password: a.password,
            auth: a.auth,
            identity_token: a.identity_token,
            registry_token: a.registry_token,
            server_address: a.server_address,
        });
        let pulled = self.deps().images.pull(&reference, auth).await;
        // Even a failed pull may leave content behind.
        self.inner.fs_info.invalidate();
        let info = pulled?;
        Ok(pull_response(&info))
    }

    pub(crate) async fn remove_image_impl(&self, r: cri::RemoveImageRequest) -> CriResult<()> {
        let reference = image_ref("image.image", r.image.as_ref())?;
        if let Some(info) = self.deps().images.status(&reference).await? {
            if info.repo_tags.iter().any(|t| t == &self.deps().pause_image) {
                return Err(CriError::precondition(format!(
                    "image {reference} is the pod infra image and is pinned"
                )));
            }
        }
        let removed = self.deps().images.remove(&reference).await;
        self.inner.fs_info.invalidate();
        removed?;
        Ok(())
    }

    pub(crate) async fn image_fs_info_impl(&self) -> CriResult<cri::ImageFsInfoResponse> {
        let (snapshots, content) = &self.deps().image_fs;
        let usage = self
            .inner
            .fs_info
            .get_or_measure(|| self.deps().images.fs_info(snapshots, content))
            .await?;
        let image_filesystems = usage
            .iter()
            .map(|u| cri::FilesystemUsage {
                timestamp: u.timestamp_ns,
                fs_id: Some(cri::FilesystemIdentifier {
                    mountpoint: u.mountpoint.display().to_string(),
                }),
                used_bytes: Some(cri::UInt64Value {
                    value: u.used_bytes,
                }),
                inodes_used: Some(cri::UInt64Value {
                    value: u.inodes_used,
                }),
            })
            .collect();
        Ok(cri::ImageFsInfoResponse {
            image_filesystems,
            container_filesystems: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use super::*;

    /// CRI 1.36's image id contract: PullImageResponse.image_ref ==
    /// Image.id == Container.image_id == ContainerStatus.image_id, all the
    /// config digest, while the repo digest stays in `repo_digests` and
    /// `ContainerStatus.image_ref`.
    #[test]
    fn one_image_id_for_pull_list_and_container_status() {
        use cubelet_pod::ContainerRecord;
        let info = ImageInfo {
            id: "sha256:c0ff1e".into(),
            repo_tags: vec!["r.test/app:1".into()],
            repo_digests: vec!["r.test/app@sha256:3a41f357".into()],
            target_digest: "sha256:3a41f357".into(),
            ..Default::default()
        };
        let pulled = pull_response(&info).image_ref;
        let listed = cri_image(&info, false).id;
        // What the pod service records for a container of this image.
        let mut rec = ContainerRecord::new(
            "c1",
            cubelet_engine::SandboxId::new_unchecked("s1"),
            "app",
            0,
            "r.test/app:1",
        );
        rec.image_ref = info.id.clone();
        rec.config = serde_json::json!({ "image_repo_digest": info.repo_digests.first() });
        let status = crate::convert::container_status(&rec);
        let listed_container = crate::convert::container(&rec);
        assert_eq!(pulled, "sha256:c0ff1e");
        assert_eq!(listed, pulled);
        assert_eq!(status.image_id, pulled);
        assert_eq!(listed_container.image_id, pulled);
        assert_eq!(status.image_ref, "r.test/app@sha256:3a41f357");
    }

    fn usage(bytes: u64) -> Vec<FsUsage> {
        vec![FsUsage {
            mountpoint: "/var/lib/containerd".into(),
            used_bytes: bytes,
            inodes_used: 1,
            timestamp_ns: 1,
        }]
    }

    /// A measurement that counts its calls and reports the count as bytes.
    fn counting(calls: &AtomicUsize) -> impl Future<Output = Result<Vec<FsUsage>, String>> + '_ {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        async move { Ok(usage(n as u64)) }
    }

    #[tokio::test]
    async fn a_measurement_answers_until_a_change() {
        let cache = FsInfoCache::default();
        let calls = AtomicUsize::new(0);
        assert_eq!(
            cache.get_or_measure(|| counting(&calls)).await,
            Ok(usage(1))
        );
        assert_eq!(
            cache.get_or_measure(|| counting(&calls)).await,
            Ok(usage(1))
        );
        cache.invalidate();
        assert_eq!(
            cache.get_or_measure(|| counting(&calls)).await,
            Ok(usage(2))
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failed_measurement_is_not_kept() {
        let cache = FsInfoCache::default();
        let failed: Result<Vec<FsUsage>, String> = cache
            .get_or_measure(|| async { Err("walk".to_owned()) })
            .await;
        assert!(failed.is_err());
        let calls = AtomicUsize::new(0);
        assert_eq!(
            cache.get_or_measure(|| counting(&calls)).await,
            Ok(usage(1))
        );
    }

    #[tokio::test]
    async fn a_change_during_a_measurement_leaves_it_stale() {
        let cache = Arc::new(FsInfoCache::default());
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let measuring = {
            let cache = Arc::clone(&cache);
            tokio::spawn(async move {
                cache
                    .get_or_measure(|| async move {
                        let _ = started_tx.send(());
                        let _ = go_rx.await;
                        Ok::<_, String>(usage(7))
                    })
                    .await
            })
        };
        started_rx.await.unwrap();
        cache.invalidate();
        go_tx.send(()).unwrap();
        assert_eq!(measuring.await.unwrap(), Ok(usage(7)));
        let calls = AtomicUsize::new(0);
        assert_eq!(
            cache.get_or_measure(|| counting(&calls)).await,
            Ok(usage(1))
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_share_one_measurement() {
        let cache = Arc::new(FsInfoCache::default());
        let calls = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (cache, calls) = (Arc::clone(&cache), Arc::clone(&calls));
                tokio::spawn(async move {
                    cache
                        .get_or_measure(|| async move {
                            calls.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            Ok::<_, String>(usage(3))
                        })
                        .await
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), Ok(usage(3)));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
