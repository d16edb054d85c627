//! CRI `Exec`, `Attach` and `PortForward`: validate, hand the request to the
//! streaming server (`cubelet-streaming`) in its own terms, return its URL.
//! The pod service says whether the container runs or the pod is ready.

use cubelet_cri_api::v1 as cri;
use cubelet_streaming::{
    AttachRequest, ExecRequest, PortForwardRequest, StreamingError, StreamingServer, Streams,
};

use crate::error::{CriError, CriResult};
use crate::service::Cri;

fn check_streams(stdin: bool, stdout: bool, stderr: bool, tty: bool) -> CriResult<Streams> {
    if tty && stderr {
        return Err(CriError::invalid(
            "stderr",
            "tty and stderr cannot both be true",
        ));
    }
    if !stdin && !stdout && !stderr {
        return Err(CriError::invalid(
            "stdin",
            "one of stdin, stdout, or stderr must be set",
        ));
    }
    Ok(Streams {
        stdin,
        stdout,
        stderr,
        tty,
    })
}

/// A URL; `ResourceExhausted` when too many are unused (as kubelet), else
/// `FailedPrecondition` when no token could be made.
fn url(registered: Result<String, StreamingError>) -> CriResult<String> {
    registered.map_err(|e| {
        let why = format!(
            "cannot create a streaming token: {}",
            cubelet_engine::chain(&e)
        );
        match e {
            StreamingError::TooManyInFlight { .. } => CriError::resource_exhausted(why),
            _ => CriError::precondition(why),
        }
    })
}

impl Cri {
    fn streaming(&self, what: &str) -> CriResult<&StreamingServer> {
        self.deps().streaming.as_ref().ok_or_else(|| {
            CriError::Unimplemented(format!("{what}: the streaming server is not running"))
        })
    }

    pub(crate) async fn exec_impl(&self, r: cri::ExecRequest) -> CriResult<cri::ExecResponse> {
        let server = self.streaming("Exec")?;
        crate::validate::exec_cmd("cmd", &r.cmd)?;
        let streams = check_streams(r.stdin, r.stdout, r.stderr, r.tty)?;
        let container_id = self.pods().running_container(&r.container_id)?;
        let url = url(server.exec(ExecRequest {
            container_id,
            cmd: r.cmd,
            streams,
        }))?;
        Ok(cri::ExecResponse { url })
    }

    pub(crate) async fn attach_impl(
        &self,
        r: cri::AttachRequest,
    ) -> CriResult<cri::AttachResponse> {
        let server = self.streaming("Attach")?;
        let streams = check_streams(r.stdin, r.stdout, r.stderr, r.tty)?;
        let container_id = self.pods().running_container(&r.container_id)?;
        let url = url(server.attach(AttachRequest {
            container_id,
            streams,
        }))?;
        Ok(cri::AttachResponse { url })
    }

    pub(crate) async fn port_forward_impl(
        &self,
        r: cri::PortForwardRequest,
    ) -> CriResult<cri::PortForwardResponse> {
        let server = self.streaming("PortForward")?;
        let rec = self.pods().ready_sandbox(&r.pod_sandbox_id)?;
        let mut ports = Vec::with_capacity(r.port.len());
        for p in &r.port {
            match u16::try_from(*p) {
                Ok(n) if n > 0 => ports.push(n),
                _ => {
                    return Err(CriError::invalid(
                        "port",
                        format!("{p} is not a valid port"),
                    ))
                }
            }
        }
        let netns = rec.network.as_ref().and_then(|n| n.netns_path.clone());
        let url = url(server.port_forward(PortForwardRequest {
            pod_sandbox_id: rec.id.as_str().to_owned(),
            netns,
            ports,
        }))?;
        Ok(cri::PortForwardResponse { url })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_flags_are_validated_as_kubelet_does() {
        let e = check_streams(false, true, true, true).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("tty and stderr"));
        let e = check_streams(false, false, false, false).unwrap_err();
        assert!(e.to_string().contains("one of stdin, stdout, or stderr"));
        assert_eq!(
            check_streams(true, true, false, true).unwrap(),
            Streams {
                stdin: true,
                stdout: true,
                stderr: false,
                tty: true
            }
        );
        assert!(check_streams(false, true, true, false).is_ok());
    }

    #[test]
    fn a_token_failure_is_a_failed_precondition() {
        let e = url(Err(StreamingError::AlreadyServing)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.to_string().contains("cannot create a streaming token"),
            "{e}"
        );
        let e = url(Err(StreamingError::TooManyInFlight { max: 1000 })).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.to_string().contains("max_in_flight_urls"), "{e}");
    }
}
