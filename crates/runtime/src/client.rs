//! The containerd connection, scoped to Cubelet's namespace.

use std::path::{Path, PathBuf};

use containerd_client::services::v1::{
    containers_client::ContainersClient, content_client::ContentClient, diff_client::DiffClient,
    events_client::EventsClient, images_client::ImagesClient, leases_client::LeasesClient,
    snapshots::snapshots_client::SnapshotsClient, tasks_client::TasksClient,
    version_client::VersionClient,
};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::Request;

use crate::error::RuntimeError;

/// The largest header block (a status's trailers included) taken from
/// containerd. An error names what it failed on, and some of that is a
/// tenant's (an image with 500 layers makes a 46 KB `mount options is too
/// long` message): past h2's default of 16 KiB the call failed with
/// `h2 protocol error` instead of containerd's answer.
const MAX_HEADER_LIST: u32 = 4 << 20;

/// A connection to containerd in one containerd namespace.
///
/// Every request built with [`Containerd::request`] carries the namespace
/// header, so Cubelet never touches objects of containerd's own CRI plugin.
#[derive(Debug, Clone)]
pub struct Containerd {
    channel: Channel,
    namespace: MetadataValue<tonic::metadata::Ascii>,
    namespace_str: String,
    address: PathBuf,
}

impl Containerd {
    /// Connects to containerd's socket at `address`, using `namespace`.
    pub async fn connect(address: &Path, namespace: &str) -> Result<Self, RuntimeError> {
        let ns = namespace
            .parse()
            .map_err(|_| RuntimeError::InvalidArgument {
                field: "containerd.namespace".to_owned(),
                reason: format!("{namespace:?} is not a valid header value"),
            })?;
        let path = address.to_path_buf();
        // The URI is not used: every connection is the unix socket's.
        let channel = tonic::transport::Endpoint::from_static("http://[::]")
            .http2_max_header_list_size(MAX_HEADER_LIST)
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .map_err(|source| RuntimeError::Connect {
                address: address.display().to_string(),
                source,
            })?;
        Ok(Self {
            channel,
            namespace: ns,
            namespace_str: namespace.to_owned(),
            address: address.to_path_buf(),
        })
    }

    /// The namespace name.
    pub fn namespace(&self) -> &str {
        &self.namespace_str
    }

    /// The socket path.
    pub fn address(&self) -> &Path {
        &self.address
    }

    /// Wraps a message in a request carrying the namespace header.
    pub fn request<T>(&self, message: T) -> Request<T> {
        let mut req = Request::new(message);
        req.metadata_mut()
            .insert("containerd-namespace", self.namespace.clone());
        req
    }

    /// Containers service.
    pub fn containers(&self) -> ContainersClient<Channel> {
        ContainersClient::new(self.channel.clone())
    }
    /// Content service.
    pub fn content(&self) -> ContentClient<Channel> {
        ContentClient::new(self.channel.clone())
    }
    /// Diff service.
    pub fn diff(&self) -> DiffClient<Channel> {
        DiffClient::new(self.channel.clone())
    }
    /// Events service.
    pub fn events(&self) -> EventsClient<Channel> {
        EventsClient::new(self.channel.clone())
    }
    /// Images service.
    pub fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(self.channel.clone())
    }
    /// Leases service.
    pub fn leases(&self) -> LeasesClient<Channel> {
        LeasesClient::new(self.channel.clone())
    }
    /// Snapshots service.
    pub fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(self.channel.clone())
    }
    /// Tasks service.
    pub fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }
    /// Version service.
    pub fn version(&self) -> VersionClient<Channel> {
        VersionClient::new(self.channel.clone())
    }
}
