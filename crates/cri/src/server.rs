//! The CRI unix socket.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use cubelet_cri_api::v1::image_service_server::ImageServiceServer;
use cubelet_cri_api::v1::runtime_service_server::RuntimeServiceServer;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::service::Cri;
use crate::transport::{self, TransportOptions};

/// Largest CRI message accepted or sent (kubelet uses 16 MiB).
const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// The CRI socket, bound. Clients that connect wait in its backlog until
/// [`serve_unix`] serves it, so the agent can bind it before it says it is
/// ready and serve right after.
#[derive(Debug)]
pub struct CriSocket {
    path: PathBuf,
    listener: UnixListener,
}

impl CriSocket {
    /// Binds `path` (parent created, a stale socket file removed, mode 0660).
    pub fn bind(path: impl Into<PathBuf>) -> io::Result<Self> {
        let path = path.into();
        let listener = bind(&path)?;
        Ok(Self { path, listener })
    }

    /// Where it is bound.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Serves both CRI services on `socket` until `shutdown` is cancelled, its
/// connections treated as `options` say; removes the socket file at the end.
pub async fn serve_unix(
    socket: CriSocket,
    cri: Cri,
    options: TransportOptions,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let CriSocket {
        path: socket,
        listener,
    } = socket;
    // Event streams never end on their own; end them when shutdown starts
    // so the graceful drain does not wait for their clients.
    {
        let cri = cri.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(
            async move {
                shutdown.cancelled().await;
                cri.close_events();
            }
            .in_current_span(),
        );
    }
    tonic::transport::Server::builder()
        // Expired client deadlines get DEADLINE_EXCEEDED (tonic's own
        // enforcement answers CANCELLED).
        .layer(crate::deadline::DeadlineLayer)
        .add_service(
            RuntimeServiceServer::new(cri.clone())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        .add_service(
            ImageServiceServer::new(cri)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        // Through the `:authority` repair unless it is switched off: Go
        // clients that send the socket path as authority would otherwise get
        // every stream reset by h2.
        .serve_with_incoming_shutdown(
            transport::incoming(listener, options),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(io::Error::other)?;
    // Leave no socket behind that would answer nothing.
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Binds the unix socket, replacing a stale one.
fn bind(socket: &Path) -> io::Result<UnixListener> {
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
