//! Image calls, served by the runtime crate's image service.

use cubelet_runtime::image::RegistryAuth;
use cubelet_runtime::types::ImageInfo;
use k8s_cri::v1 as cri;

use crate::error::{CriError, CriResult};
use crate::service::Cri;

fn image_ref(field: &str, spec: Option<&cri::ImageSpec>) -> CriResult<String> {
    let image = spec.map(|s| s.image.clone()).unwrap_or_default();
    if image.is_empty() {
        return Err(CriError::invalid(field, "must not be empty"));
    }
    Ok(image)
}

impl Cri {
    fn to_cri_image(&self, info: &ImageInfo) -> cri::Image {
        let (uid, username) = match info.config.user.split(':').next().unwrap_or("") {
            "" => (None, String::new()),
            u => match u.parse::<i64>() {
                Ok(n) => (Some(cri::Int64Value { value: n }), String::new()),
                Err(_) => (None, u.to_owned()),
            },
        };
        let pinned = info.pinned || info.repo_tags.iter().any(|t| t == &self.deps().pause_image);
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
        });
        let info = self.deps().images.pull(&reference, auth).await?;
        Ok(cri::PullImageResponse { image_ref: info.id })
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
        self.deps().images.remove(&reference).await?;
        Ok(())
    }

    pub(crate) async fn image_fs_info_impl(&self) -> CriResult<cri::ImageFsInfoResponse> {
        let (snapshots, content) = &self.deps().image_fs;
        let usage = self.deps().images.fs_info(snapshots, content).await?;
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
