//! The `:authority` repair in front of a real tonic server on a unix socket,
//! through `transport::incoming` as the CRI socket uses it: a raw HTTP/2
//! client that sends the socket path as `:authority` (as Go gRPC clients of
//! some versions do) is reset by h2 with the repair switched off and served
//! with it on; clients that send a valid authority (raw, tonic's own) are
//! served either way; `crictl` works when it is installed.

// Helpers outside #[test] fns unwrap too; a failure should print its error.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use cubelet_cri::transport::{self, TransportOptions};
use cubelet_cri_api::v1::image_service_client::ImageServiceClient;
use cubelet_cri_api::v1::image_service_server::{ImageService, ImageServiceServer};
use cubelet_cri_api::v1::{
    Image, ImageFsInfoRequest, ImageFsInfoResponse, ImageStatusRequest, ImageStatusResponse,
    ListImagesRequest, ListImagesResponse, PullImageRequest, PullImageResponse, RemoveImageRequest,
    RemoveImageResponse, StreamImagesRequest, StreamImagesResponse,
};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const IMAGE_ID: &str = "sha256:test-authority-0001";
const IMAGE_TAG: &str = "test.local/authority:1";
const CRICTL: &str = "/usr/local/bin/crictl";

/// An image service with one image.
struct OneImage;

#[tonic::async_trait]
impl ImageService for OneImage {
    async fn list_images(
        &self,
        _: Request<ListImagesRequest>,
    ) -> Result<Response<ListImagesResponse>, Status> {
        Ok(Response::new(ListImagesResponse {
            images: vec![Image {
                id: IMAGE_ID.to_string(),
                repo_tags: vec![IMAGE_TAG.to_string()],
                size: 4096,
                ..Default::default()
            }],
        }))
    }
    async fn image_status(
        &self,
        _: Request<ImageStatusRequest>,
    ) -> Result<Response<ImageStatusResponse>, Status> {
        Ok(Response::new(ImageStatusResponse::default()))
    }
    async fn pull_image(
        &self,
        _: Request<PullImageRequest>,
    ) -> Result<Response<PullImageResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn remove_image(
        &self,
        _: Request<RemoveImageRequest>,
    ) -> Result<Response<RemoveImageResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn image_fs_info(
        &self,
        _: Request<ImageFsInfoRequest>,
    ) -> Result<Response<ImageFsInfoResponse>, Status> {
        // crictl calls this to validate the connection.
        Ok(Response::new(ImageFsInfoResponse::default()))
    }
    type StreamImagesStream = futures::stream::Empty<Result<StreamImagesResponse, Status>>;
    async fn stream_images(
        &self,
        _: Request<StreamImagesRequest>,
    ) -> Result<Response<Self::StreamImagesStream>, Status> {
        Err(Status::unimplemented("test"))
    }
}

/// A served socket; stops the server and removes the directory on drop.
struct Served {
    dir: tempfile::TempDir,
    stop: CancellationToken,
}

impl Served {
    /// Serves [`OneImage`] on a fresh socket through the transport the CRI
    /// socket uses, with the `:authority` repair on or off.
    fn start(with_fix: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("test-authority-")
            .tempdir()
            .unwrap();
        let listener = UnixListener::bind(dir.path().join("cri.sock")).unwrap();
        let stop = CancellationToken::new();
        let server =
            tonic::transport::Server::builder().add_service(ImageServiceServer::new(OneImage));
        let shutdown = stop.clone().cancelled_owned();
        let options = TransportOptions {
            rewrite_invalid_authority: with_fix,
        };
        tokio::spawn(
            server.serve_with_incoming_shutdown(transport::incoming(listener, options), shutdown),
        );
        Self { dir, stop }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("cri.sock")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream_id.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// How one raw stream ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Trailers with this `grpc-status`, and the response message body.
    Done(String, Vec<u8>),
    /// RST_STREAM with this error code.
    Reset(u32),
}

/// Sends `n` ListImages calls on one connection the way a Go client does:
/// every header block HPACK-encoded with a shared dynamic table, with the
/// given `:authority`. Returns how each stream ended.
async fn raw_list_images(socket: &Path, authority: &str, n: u32) -> Vec<Outcome> {
    let mut conn = UnixStream::connect(socket).await.unwrap();
    let mut encoder = loona_hpack::Encoder::new();
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    for i in 0..n {
        let id = 1 + 2 * i;
        let block = encoder.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/runtime.v1.ImageService/ListImages"),
            (b":authority", authority.as_bytes()),
            (b"content-type", b"application/grpc"),
            (b"user-agent", b"grpc-go/1.50.1"),
            (b"te", b"trailers"),
            (b"grpc-timeout", b"9999m"),
        ]);
        out.extend(frame(0x1, 0x4, id, &block));
        out.extend(frame(0x0, 0x1, id, &[0, 0, 0, 0, 0]));
    }
    conn.write_all(&out).await.unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut bodies: Vec<Vec<u8>> = vec![Vec::new(); n as usize];
    let mut outcomes: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
    let mut block: Vec<u8> = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while outcomes.iter().any(Option::is_none) {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.unwrap();
            let slot = (id as usize).checked_sub(1).map(|i| i / 2);
            match kind {
                0x0 => bodies[slot.unwrap()].extend_from_slice(&payload),
                0x1 | 0x9 => {
                    block.extend_from_slice(&payload);
                    if flags & 0x4 == 0 {
                        continue;
                    }
                    let headers = decoder.decode(&block).unwrap();
                    block.clear();
                    if flags & 0x1 != 0 {
                        let status = headers
                            .iter()
                            .find(|(n, _)| n == b"grpc-status")
                            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                            .unwrap_or_default();
                        let i = slot.unwrap();
                        outcomes[i] = Some(Outcome::Done(status, std::mem::take(&mut bodies[i])));
                    }
                }
                0x3 => {
                    let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    outcomes[slot.unwrap()] = Some(Outcome::Reset(code));
                }
                0x4 if flags & 0x1 == 0 => conn.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap(),
                0x7 => panic!("GOAWAY from the server: {payload:?}"),
                _ => {}
            }
        }
    })
    .await
    .expect("server answered every stream");
    outcomes.into_iter().map(Option::unwrap).collect()
}

fn assert_one_image(body: &[u8]) {
    assert_eq!(body[0], 0, "uncompressed gRPC message");
    let response = ListImagesResponse::decode(&body[5..]).unwrap();
    assert_eq!(response.images.len(), 1);
    assert_eq!(response.images[0].id, IMAGE_ID);
}

#[tokio::test]
async fn socket_path_authority_is_reset_without_the_fix() {
    let served = Served::start(false);
    let path = served.socket().display().to_string();
    let outcomes = raw_list_images(&served.socket(), &path, 2).await;
    // PROTOCOL_ERROR = 1: the bug this crate works around.
    assert_eq!(outcomes, vec![Outcome::Reset(1), Outcome::Reset(1)]);
}

#[tokio::test]
async fn socket_path_authority_is_served_with_the_fix() {
    let served = Served::start(true);
    let path = served.socket().display().to_string();
    let outcomes = raw_list_images(&served.socket(), &path, 4).await;
    assert_eq!(outcomes.len(), 4);
    for outcome in outcomes {
        match outcome {
            Outcome::Done(status, body) => {
                assert_eq!(status, "0");
                assert_one_image(&body);
            }
            Outcome::Reset(code) => panic!("stream reset with {code}"),
        }
    }
}

/// Raw clients with valid authorities get every stream answered.
async fn assert_valid_authorities_served(served: &Served) {
    for authority in ["localhost", "[::]"] {
        for outcome in raw_list_images(&served.socket(), authority, 3).await {
            match outcome {
                Outcome::Done(status, body) => {
                    assert_eq!(status, "0");
                    assert_one_image(&body);
                }
                Outcome::Reset(code) => panic!("stream reset with {code}"),
            }
        }
    }
}

#[tokio::test]
async fn valid_authority_is_served_with_the_fix() {
    assert_valid_authorities_served(&Served::start(true)).await;
}

#[tokio::test]
async fn valid_authority_is_served_with_the_fix_switched_off() {
    assert_valid_authorities_served(&Served::start(false)).await;
}

/// tonic's own client lists the image, with either authority it may send.
async fn assert_tonic_client_works(served: &Served) {
    for uri in ["http://localhost", "http://[::]:50051"] {
        let socket = served.socket();
        let channel = tonic::transport::Endpoint::try_from(uri)
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let socket = socket.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        UnixStream::connect(socket).await?,
                    ))
                }
            }))
            .await
            .unwrap();
        let mut client = ImageServiceClient::new(channel);
        for _ in 0..3 {
            let images = client
                .list_images(ListImagesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .images;
            assert_eq!(images.len(), 1);
            assert_eq!(images[0].repo_tags, vec![IMAGE_TAG.to_string()]);
        }
    }
}

#[tokio::test]
async fn tonic_client_still_works() {
    assert_tonic_client_works(&Served::start(true)).await;
}

#[tokio::test]
async fn tonic_client_works_with_the_fix_switched_off() {
    assert_tonic_client_works(&Served::start(false)).await;
}

/// Runs `crictl images` against `served`, or `None` when crictl is not
/// installed.
async fn crictl_images(served: &Served) -> Option<(bool, String, String)> {
    if !Path::new(CRICTL).exists() {
        println!("SKIP: {CRICTL} not installed");
        return None;
    }
    let endpoint = format!("unix://{}", served.socket().display());
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(CRICTL)
            .args([
                "--timeout",
                "10s",
                "-r",
                &endpoint,
                "-i",
                &endpoint,
                "images",
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("crictl finished")
    .unwrap();
    Some((
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crictl_is_reset_without_the_fix() {
    let served = Served::start(false);
    let Some((ok, _, stderr)) = crictl_images(&served).await else {
        return;
    };
    // crictl built with grpc-go before 1.57 (cri-tools 1.26 and older, and
    // kubelets of that age) sends the socket path as :authority and is reset
    // without the fix; newer builds send `localhost`. Either way the call must
    // not fail for any other reason.
    if ok {
        println!(
            "NOTE: the installed {CRICTL} sends a valid :authority; \
             the fix is not needed for it (it is for older Go clients)"
        );
        return;
    }
    assert!(stderr.contains("PROTOCOL_ERROR"), "crictl stderr: {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crictl_lists_images_through_the_fix() {
    let served = Served::start(true);
    let Some((ok, stdout, stderr)) = crictl_images(&served).await else {
        return;
    };
    assert!(ok, "crictl failed: {stderr}");
    assert!(
        stdout.contains("test.local/authority"),
        "crictl output: {stdout} {stderr}"
    );
}
