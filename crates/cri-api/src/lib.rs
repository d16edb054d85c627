//! The Kubernetes Container Runtime Interface, version 1 (`runtime.v1`), as
//! Cubelet speaks it: prost messages plus tonic servers and clients for
//! `RuntimeService` and `ImageService`, generated at build time from the
//! project's own `proto/cri/v1/api.proto` (wire-compatible with the CRI of
//! Kubernetes 1.36; see docs/cri-api.md for how it is kept up to date).

/// CRI v1 messages, enums, `runtime_service_{server,client}` and
/// `image_service_{server,client}`.
#[allow(
    missing_docs,
    unreachable_pub,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod v1 {
    tonic::include_proto!("runtime.v1");
}

/// Prints which credentials are present, never their values.
impl std::fmt::Debug for v1::AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn shown(s: &str) -> &'static str {
            if s.is_empty() {
                ""
            } else {
                "<redacted>"
            }
        }
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("password", &shown(&self.password))
            .field("auth", &shown(&self.auth))
            .field("server_address", &self.server_address)
            .field("identity_token", &shown(&self.identity_token))
            .field("registry_token", &shown(&self.registry_token))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::v1;
    use prost::Message;

    #[test]
    fn auth_config_debug_hides_secrets() {
        let auth = v1::AuthConfig {
            username: "user".into(),
            password: "hunter2".into(),
            auth: "dXNlcjpodW50ZXIy".into(),
            server_address: "registry.test".into(),
            identity_token: "idtok".into(),
            registry_token: "regtok".into(),
        };
        let shown = format!(
            "{:?}",
            v1::PullImageRequest {
                auth: Some(auth),
                ..Default::default()
            }
        );
        for secret in ["hunter2", "dXNlcjpodW50ZXIy", "idtok", "regtok"] {
            assert!(!shown.contains(secret), "{secret} leaked in {shown}");
        }
        assert!(shown.contains("user") && shown.contains("registry.test"));
    }

    /// Field numbers added after Kubernetes 1.32 survive a decode: the reason
    /// this crate exists (k8s-cri 0.11 dropped them).
    #[test]
    fn fields_added_since_1_32_decode() {
        let mount = v1::Mount {
            image_sub_path: "sub/dir".into(),
            ..Default::default()
        };
        let config = v1::ContainerConfig {
            stop_signal: v1::Signal::Sigusr1 as i32,
            mounts: vec![mount],
            ..Default::default()
        };
        let back =
            v1::ContainerConfig::decode(config.encode_to_vec().as_slice()).unwrap_or_default();
        assert_eq!(back.stop_signal, v1::Signal::Sigusr1 as i32);
        assert_eq!(back.mounts[0].image_sub_path, "sub/dir");
        // Raw wire check: ContainerConfig.stop_signal is field 18, varint,
        // so its key is (18 << 3) = 144, the two-byte varint 0x90 0x01.
        let raw = v1::ContainerConfig {
            stop_signal: 29,
            ..Default::default()
        }
        .encode_to_vec();
        assert_eq!(raw, vec![0x90, 0x01, 29]);
    }
}
