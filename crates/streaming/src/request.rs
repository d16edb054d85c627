//! The requests a caller registers: what to run once the client connects.
//! The caller has checked them (the container runs, the pod is ready, the
//! stream flags make sense); the server only carries them to the session.

use std::path::PathBuf;

/// Which stdio streams a remote command uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streams {
    /// The client sends stdin.
    pub stdin: bool,
    /// The client reads stdout.
    pub stdout: bool,
    /// The client reads stderr (never with `tty`).
    pub stderr: bool,
    /// The process runs on a terminal; stderr is merged into stdout.
    pub tty: bool,
}

/// Run a command in a running container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    /// The container.
    pub container_id: String,
    /// The command line (not empty).
    pub cmd: Vec<String>,
    /// Its stdio.
    pub streams: Streams,
}

/// Attach to a running container's own stdio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    /// The container.
    pub container_id: String,
    /// The streams the client uses.
    pub streams: Streams,
}

/// Forward ports into a pod's network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortForwardRequest {
    /// The pod, as named in messages to the client.
    pub pod_sandbox_id: String,
    /// Its network namespace, handed to [`crate::StreamBackend::dial`]
    /// as it is; `None` for a host-network pod.
    pub netns: Option<PathBuf>,
    /// Ports named in the request (used when the URL names none).
    pub ports: Vec<u16>,
}
