//! containerd's content store and leases, as the image module uses them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use containerd_client::services::v1::{
    content_client::ContentClient, AddResourceRequest, CreateRequest, DeleteRequest, Info,
    InfoRequest, ReadContentRequest, Resource, UpdateRequest, WriteAction, WriteContentRequest,
};
use futures::{Stream, StreamExt as _};
use sha2::Digest as _;
use tonic::transport::Channel;
use tonic::Request;

use crate::client::Containerd;
use crate::error::RuntimeError;

/// gRPC header that puts a request's new objects under a lease.
const LEASE_HEADER: &str = "containerd-lease";
/// How long a pull lease lives if Cubelet dies before deleting it.
const LEASE_EXPIRY: Duration = Duration::from_secs(3600);
const CHUNK: usize = 1 << 20;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A process-unique suffix for lease ids and ingest refs.
pub(crate) fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Content-store access, optionally under a lease.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    cd: Containerd,
    lease: Option<String>,
}

impl Store {
    pub(crate) fn new(cd: &Containerd) -> Self {
        Self {
            cd: cd.clone(),
            lease: None,
        }
    }

    /// Creates a lease (expiring after an hour, in case we die) and returns
    /// a store whose requests run under it.
    pub(crate) async fn leased(cd: &Containerd, purpose: &str) -> Result<Self, RuntimeError> {
        let id = format!("cubelet-{purpose}-{}", unique());
        let expire = humantime::format_rfc3339_seconds(SystemTime::now() + LEASE_EXPIRY);
        let mut labels =
            HashMap::from([("containerd.io/gc.expire".to_owned(), expire.to_string())]);
        crate::reclaim::owner::mark(&mut labels);
        cd.leases()
            .create(cd.request(CreateRequest {
                id: id.clone(),
                labels,
            }))
            .await
            .map_err(|s| RuntimeError::containerd("leases.create", s))?;
        Ok(Self {
            cd: cd.clone(),
            lease: Some(id),
        })
    }

    /// Deletes the lease; what nothing else references becomes garbage.
    pub(crate) async fn release(self) -> Result<(), RuntimeError> {
        if let Some(id) = self.lease {
            match self
                .cd
                .leases()
                .delete(self.cd.request(DeleteRequest { id, sync: false }))
                .await
            {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(RuntimeError::containerd("leases.delete", s)),
            }
        }
        Ok(())
    }

    pub(crate) fn containerd(&self) -> &Containerd {
        &self.cd
    }

    /// Wraps a message with the namespace and, if any, the lease header.
    pub(crate) fn req<T>(&self, m: T) -> Request<T> {
        let mut r = self.cd.request(m);
        if let Some(l) = self.lease.as_deref().and_then(|l| l.parse().ok()) {
            r.metadata_mut().insert(LEASE_HEADER, l);
        }
        r
    }

    fn client(&self) -> ContentClient<Channel> {
        self.cd.content()
    }

    /// Content info, `None` if absent.
    pub(crate) async fn info(&self, digest: &str) -> Result<Option<Info>, RuntimeError> {
        match self
            .client()
            .info(self.req(InfoRequest {
                digest: digest.to_owned(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(RuntimeError::containerd("content.info", s)),
        }
    }

    /// Reads a whole blob (manifests, configs).
    pub(crate) async fn read(&self, digest: &str) -> Result<Vec<u8>, RuntimeError> {
        let req = self.req(ReadContentRequest {
            digest: digest.to_owned(),
            offset: 0,
            size: 0,
        });
        let mut stream = match self.client().read(req).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::NotFound => {
                return Err(RuntimeError::NotFound {
                    kind: "content",
                    id: digest.to_owned(),
                })
            }
            Err(s) => return Err(RuntimeError::containerd("content.read", s)),
        };
        let mut out = Vec::new();
        while let Some(m) = stream.message().await.map_err(|s| {
            if s.code() == tonic::Code::NotFound {
                RuntimeError::NotFound {
                    kind: "content",
                    id: digest.to_owned(),
                }
            } else {
                RuntimeError::containerd("content.read", s)
            }
        })? {
            out.extend_from_slice(&m.data);
        }
        Ok(out)
    }

    /// Sets labels on existing content.
    pub(crate) async fn set_labels(
        &self,
        digest: &str,
        labels: &HashMap<String, String>,
    ) -> Result<(), RuntimeError> {
        if labels.is_empty() {
            return Ok(());
        }
        let info = Info {
            digest: digest.to_owned(),
            labels: labels.clone(),
            ..Default::default()
        };
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        let mask = prost_types::FieldMask { paths };
        self.client()
            .update(self.req(UpdateRequest {
                info: Some(info),
                update_mask: Some(mask),
            }))
            .await
            .map_err(|s| RuntimeError::containerd("content.update", s))?;
        Ok(())
    }

    /// Puts existing content under this store's lease.
    async fn hold(&self, digest: &str) -> Result<(), RuntimeError> {
        let Some(id) = self.lease.clone() else {
            return Ok(());
        };
        let resource = Resource {
            id: digest.to_owned(),
            r#type: "content".to_owned(),
        };
        self.cd
            .leases()
            .add_resource(self.cd.request(AddResourceRequest {
                id,
                resource: Some(resource),
            }))
            .await
            .map_err(|s| RuntimeError::containerd("leases.add_resource", s))?;
        Ok(())
    }

    /// If `digest` is present: hold it under the lease, set `labels`, and
    /// return true.
    pub(crate) async fn reuse(
        &self,
        digest: &str,
        labels: &HashMap<String, String>,
    ) -> Result<bool, RuntimeError> {
        if self.info(digest).await?.is_none() {
            return Ok(false);
        }
        self.hold(digest).await?;
        self.set_labels(digest, labels).await?;
        Ok(true)
    }

    /// Writes a blob held in memory (no-op apart from labels if present).
    pub(crate) async fn put(
        &self,
        digest: &str,
        data: Bytes,
        labels: HashMap<String, String>,
    ) -> Result<(), RuntimeError> {
        if self.reuse(digest, &labels).await? {
            return Ok(());
        }
        let size = data.len() as u64;
        let chunks: Vec<Result<Bytes, RuntimeError>> = (0..data.len())
            .step_by(CHUNK)
            .map(|i| Ok(data.slice(i..(i + CHUNK).min(data.len()))))
            .collect();
        self.write(digest, size, labels, futures::stream::iter(chunks))
            .await
    }

    /// Streams a blob into the content store, verifying its sha256 digest and
    /// size before committing (and refusing it as soon as it passes `size`);
    /// containerd checks the digest again on commit. On any error the
    /// ingest is aborted, so nothing of it stays in the content store.
    pub(crate) async fn write<S>(
        &self,
        digest: &str,
        size: u64,
        labels: HashMap<String, String>,
        body: S,
    ) -> Result<(), RuntimeError>
    where
        S: Stream<Item = Result<Bytes, RuntimeError>> + Send,
    {
        let ingest = format!("cubelet-{}-{digest}", unique());
        // A write dropped half-way (a pull whose other layer failed, or
        // that every caller gave up on) must not leave its ingest behind.
        let mut guard = AbortIngest {
            store: self.clone(),
            ingest: Some(ingest.clone()),
        };
        let total = i64::try_from(size).unwrap_or(i64::MAX);
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteContentRequest>(4);
        let producer = async {
            let mut hasher = sha2::Sha256::new();
            let mut offset: u64 = 0;
            // HTTP bodies arrive in frames of a few KiB: each becomes one
            // write and one answer in containerd, so they are sent in
            // messages of about CHUNK bytes instead.
            let mut body = std::pin::pin!(coalesce(body, CHUNK));
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                // Never past the declared size: a larger blob is refused
                // before its excess reaches the content store.
                if offset + chunk.len() as u64 > size {
                    return Err(RuntimeError::DigestMismatch {
                        digest: digest.to_owned(),
                        actual: format!(
                            "more than the declared {size} bytes ({} so far)",
                            offset + chunk.len() as u64
                        ),
                    });
                }
                hasher.update(&chunk);
                let msg = WriteContentRequest {
                    action: WriteAction::Write as i32,
                    r#ref: ingest.clone(),
                    total,
                    expected: digest.to_owned(),
                    offset: i64::try_from(offset).unwrap_or(i64::MAX),
                    data: chunk,
                    labels: HashMap::new(),
                };
                offset += msg.data.len() as u64;
                if tx.send(msg).await.is_err() {
                    // The call ended early; its error is reported below.
                    return Ok(());
                }
            }
            let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
            if actual != digest || offset != size {
                return Err(RuntimeError::DigestMismatch {
                    digest: digest.to_owned(),
                    actual: format!("{actual} ({offset} bytes, want {size})"),
                });
            }
            let commit = WriteContentRequest {
                action: WriteAction::Commit as i32,
                r#ref: ingest.clone(),
                total,
                expected: digest.to_owned(),
                offset: total,
                data: Vec::new(),
                labels: labels.clone(),
            };
            let _ = tx.send(commit).await;
            drop(tx);
            Ok(())
        };
        let call = async {
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            let mut responses = self.client().write(self.req(stream)).await?.into_inner();
            while responses.message().await?.is_some() {}
            Ok::<(), tonic::Status>(())
        };
        let (produced, called) = tokio::join!(producer, call);
        if let Err(e) = produced {
            guard.ingest = None;
            let _ = self
                .client()
                .abort(self.req(containerd_client::services::v1::AbortRequest { r#ref: ingest }))
                .await;
            return Err(e);
        }
        guard.ingest = None;
        match called {
            Ok(()) => Ok(()),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                // Written concurrently by someone else: reuse it.
                self.hold(digest).await?;
                self.set_labels(digest, &labels).await
            }
            Err(s) => Err(RuntimeError::containerd("content.write", s)),
        }
    }
}

/// Aborts an ingest in the background when dropped while still armed.
struct AbortIngest {
    store: Store,
    ingest: Option<String>,
}

impl Drop for AbortIngest {
    fn drop(&mut self) {
        let Some(r#ref) = self.ingest.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        runtime.spawn(async move {
            let req = store.req(containerd_client::services::v1::AbortRequest { r#ref });
            if let Err(s) = store.client().abort(req).await {
                if s.code() != tonic::Code::NotFound {
                    tracing::debug!(error = %s, "aborting a dropped ingest");
                }
            }
        });
    }
}

/// `body` regrouped into buffers of about `max` bytes: frames are joined
/// until the next would pass `max` (a frame larger than `max` goes alone).
/// An error ends the stream; bytes buffered before it are dropped, as the
/// write they were for is aborted.
fn coalesce<S, E>(body: S, max: usize) -> impl Stream<Item = Result<Vec<u8>, E>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: Send,
{
    let state = (Box::pin(body), Vec::new(), false);
    futures::stream::unfold(state, move |(mut body, mut buf, done)| async move {
        if done {
            return None;
        }
        loop {
            match body.next().await {
                Some(Ok(frame)) => {
                    if !buf.is_empty() && buf.len() + frame.len() > max {
                        let out = std::mem::replace(&mut buf, frame.to_vec());
                        return Some((Ok(out), (body, buf, false)));
                    }
                    buf.extend_from_slice(&frame);
                }
                Some(Err(e)) => return Some((Err(e), (body, Vec::new(), true))),
                None if buf.is_empty() => return None,
                None => return Some((Ok(buf), (body, Vec::new(), true))),
            }
        }
    })
}

#[cfg(test)]
mod coalesce_tests {
    use super::*;

    fn frames(sizes: &[usize]) -> Vec<Result<Bytes, &'static str>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Ok(Bytes::from(vec![i as u8; n])))
            .collect()
    }

    #[tokio::test]
    async fn frames_are_joined_up_to_the_limit_in_order() {
        let body = futures::stream::iter(frames(&[3, 3, 3, 10, 1]));
        let out: Vec<_> = coalesce(body, 8).collect().await;
        let sizes: Vec<usize> = out.iter().map(|r| r.as_ref().map_or(0, Vec::len)).collect();
        assert_eq!(sizes, [6, 3, 10, 1]);
        let joined: Vec<u8> = out
            .into_iter()
            .flat_map(|r| r.unwrap_or_default())
            .collect();
        let want: Vec<u8> = [3, 3, 3, 10, 1]
            .iter()
            .enumerate()
            .flat_map(|(i, &n)| vec![i as u8; n])
            .collect();
        assert_eq!(joined, want);
    }

    #[tokio::test]
    async fn an_error_ends_the_stream() {
        let mut items = frames(&[2, 2]);
        items.push(Err("boom"));
        items.extend(frames(&[5]));
        let out: Vec<_> = coalesce(futures::stream::iter(items), 8).collect().await;
        assert_eq!(out, vec![Err("boom")]);
        let empty: Vec<_> = coalesce(futures::stream::iter(frames(&[])), 8)
            .collect()
            .await;
        assert!(empty.is_empty());
    }
}
