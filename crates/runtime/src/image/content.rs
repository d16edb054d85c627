//! containerd's content store and leases, as the image module uses them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

use super::direct::{self, DirectContent};
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
    /// Layers written into containerd's content directory, when usable.
    direct: Option<Arc<DirectContent>>,
}

impl Store {
    pub(crate) fn new(cd: &Containerd) -> Self {
        Self {
            cd: cd.clone(),
            lease: None,
            direct: None,
        }
    }

    /// Writes layers through `direct` while it is on (see
    /// [`super::direct`]).
    pub(crate) fn with_direct(mut self, direct: Option<Arc<DirectContent>>) -> Self {
        self.direct = direct;
        self
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
            direct: None,
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
        if let Some(d) = self.direct.as_ref().filter(|d| d.takes(size)) {
            if let Some(target) = d.blob_path(digest) {
                return self
                    .write_direct(d, &target, digest, size, labels, body)
                    .await;
            }
        }
        self.write_streamed(digest, size, labels, body).await
    }

    /// [`Store::write`] through containerd's content API.
    async fn write_streamed<S>(
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
                within_size(digest, size, offset + chunk.len() as u64)?;
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
            as_declared(digest, size, &actual, offset)?;
            let _ = tx
                .send(commit_request(&ingest, digest, total, &labels))
                .await;
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

    /// [`Store::write`] into containerd's content directory (see
    /// [`super::direct`]): the body is staged, checked against `digest`
    /// and `size`, linked into the blob directory and committed by a
    /// write that sends no data, or the staged data when containerd asks
    /// for it.
    async fn write_direct<S>(
        &self,
        d: &DirectContent,
        target: &std::path::Path,
        digest: &str,
        size: u64,
        labels: HashMap<String, String>,
        body: S,
    ) -> Result<(), RuntimeError>
    where
        S: Stream<Item = Result<Bytes, RuntimeError>> + Send,
    {
        let name = format!("cubelet-{}", unique());
        // As many chunks in flight as the streamed write keeps.
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
        // Hashing and writing run on a thread of their own, beside the
        // download; the staging file's guard goes with them.
        let writer = tokio::task::spawn_blocking({
            let staged = d.stage(&name);
            move || direct::write_staged(staged, rx)
        });
        let producer = async move {
            let mut offset: u64 = 0;
            let mut body = std::pin::pin!(coalesce(body, CHUNK));
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                // Never past the declared size.
                offset += chunk.len() as u64;
                within_size(digest, size, offset)?;
                if tx.send(Bytes::from(chunk)).await.is_err() {
                    // The writer failed; its error is reported below.
                    break;
                }
            }
            Ok::<(), RuntimeError>(())
        };
        let produced = producer.await;
        let (staged, written) = writer.await.map_err(|e| RuntimeError::Io {
            op: "writing the staging file",
            path: name.clone(),
            source: std::io::Error::other(e),
        })?;
        produced?;
        let (actual, written_size) = written?;
        as_declared(digest, size, &actual, written_size)?;
        let linked = {
            let (from, to) = (staged.path().to_owned(), target.to_owned());
            tokio::task::spawn_blocking(move || direct::link(&from, &to))
                .await
                .map_err(|e| RuntimeError::Io {
                    op: "linking a staged blob into",
                    path: target.display().to_string(),
                    source: std::io::Error::other(e),
                })??
        };
        if self.commit_linked(digest, size, &labels).await? {
            return Ok(());
        }
        // containerd wants the data. Either its garbage collector took the
        // blob between the link and the write, or it does not see the
        // blob directory at all: then the link goes and so do direct
        // writes.
        if tokio::fs::try_exists(target).await.unwrap_or(false) {
            if linked {
                let _ = tokio::fs::remove_file(target).await;
            }
            d.disable("a blob linked into the directory was not seen by containerd");
        } else {
            tracing::debug!(
                digest,
                "a linked blob was collected before its commit; sending it"
            );
        }
        let file = tokio::fs::File::open(staged.path())
            .await
            .map_err(crate::error::io_err(
                "reading the staging file",
                staged.path(),
            ))?;
        let path = staged.path().display().to_string();
        let body = tokio_util::io::ReaderStream::with_capacity(file, CHUNK).map(move |r| {
            r.map_err(|source| RuntimeError::Io {
                op: "reading the staging file",
                path: path.clone(),
                source,
            })
        });
        self.write_streamed(digest, size, labels, body).await
    }

    /// Whether containerd sees blobs written through `d`: a blob of unique
    /// content is staged and linked, and containerd asked whether a write
    /// of it needs data; the write is aborted and the blob removed either
    /// way.
    pub(crate) async fn sees_direct_blobs(&self, d: &DirectContent) -> Result<bool, RuntimeError> {
        let content = format!("cubelet direct content probe {}\n", unique()).into_bytes();
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&content)));
        let size = content.len() as u64;
        let Some(target) = d.blob_path(&digest) else {
            return Ok(false);
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        let writer = tokio::task::spawn_blocking({
            let staged = d.stage(&format!("cubelet-probe-{}", unique()));
            move || direct::write_staged(staged, rx)
        });
        let _ = tx.send(Bytes::from(content)).await;
        drop(tx);
        let joined = |e: tokio::task::JoinError| RuntimeError::Io {
            op: "probing direct content writes in",
            path: target.display().to_string(),
            source: std::io::Error::other(e),
        };
        let (staged, written) = writer.await.map_err(joined)?;
        written?;
        let (from, to) = (staged.path().to_owned(), target.clone());
        tokio::task::spawn_blocking(move || direct::link(&from, &to))
            .await
            .map_err(joined)??;
        let seen = self.wants_no_data(&digest, size).await;
        let _ = tokio::fs::remove_file(&target).await;
        seen
    }

    /// Opens a write of `digest` (`total` bytes) under `ingest` and asks
    /// for its status. Returns the way on (the sender), the answers, and
    /// whether containerd needs no data for it (the blob is in its content
    /// directory, in no namespace yet).
    async fn open_stat(
        &self,
        ingest: &str,
        digest: &str,
        total: i64,
    ) -> Result<
        (
            tokio::sync::mpsc::Sender<WriteContentRequest>,
            tonic::Streaming<containerd_client::services::v1::WriteContentResponse>,
            bool,
        ),
        tonic::Status,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteContentRequest>(2);
        // Room for it: the receiver is still here.
        let _ = tx.try_send(WriteContentRequest {
            action: WriteAction::Stat as i32,
            r#ref: ingest.to_owned(),
            total,
            expected: digest.to_owned(),
            offset: 0,
            data: Vec::new(),
            labels: HashMap::new(),
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let mut responses = self.client().write(self.req(stream)).await?.into_inner();
        let status = responses.message().await?;
        let shared = status.is_some_and(|st| st.offset == total && st.total == total);
        Ok((tx, responses, shared))
    }

    /// Whether containerd needs no data for a write of `digest` (the blob
    /// is in its content directory). The write is aborted.
    async fn wants_no_data(&self, digest: &str, size: u64) -> Result<bool, RuntimeError> {
        let ingest = format!("cubelet-probe-{}", unique());
        let _abort = AbortIngest {
            store: self.clone(),
            ingest: Some(ingest.clone()),
        };
        let total = i64::try_from(size).unwrap_or(i64::MAX);
        let (_tx, _responses, shared) = self
            .open_stat(&ingest, digest, total)
            .await
            .map_err(|s| RuntimeError::containerd("content.write", s))?;
        Ok(shared)
    }

    /// Commits a blob present in containerd's content directory but in no
    /// namespace, with no data sent: true when containerd took it (or the
    /// namespace had it already), false when it asks for the data.
    async fn commit_linked(
        &self,
        digest: &str,
        size: u64,
        labels: &HashMap<String, String>,
    ) -> Result<bool, RuntimeError> {
        let ingest = format!("cubelet-{}-{digest}", unique());
        let mut guard = AbortIngest {
            store: self.clone(),
            ingest: Some(ingest.clone()),
        };
        let total = i64::try_from(size).unwrap_or(i64::MAX);
        let answered = async {
            let (tx, mut responses, shared) = self.open_stat(&ingest, digest, total).await?;
            if shared {
                let _ = tx
                    .send(commit_request(&ingest, digest, total, labels))
                    .await;
                drop(tx);
                while responses.message().await?.is_some() {}
            }
            Ok::<bool, tonic::Status>(shared)
        };
        match answered.await {
            Ok(true) => {
                guard.ingest = None;
                Ok(true)
            }
            // The guard aborts the ingest.
            Ok(false) => Ok(false),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                guard.ingest = None;
                self.hold(digest).await?;
                self.set_labels(digest, labels).await?;
                Ok(true)
            }
            Err(s) => Err(RuntimeError::containerd("content.write", s)),
        }
    }
}

/// The message that commits ingest `ingest` as `digest` of `total` bytes,
/// with `labels`, once all its data is written.
fn commit_request(
    ingest: &str,
    digest: &str,
    total: i64,
    labels: &HashMap<String, String>,
) -> WriteContentRequest {
    WriteContentRequest {
        action: WriteAction::Commit as i32,
        r#ref: ingest.to_owned(),
        total,
        expected: digest.to_owned(),
        offset: total,
        data: Vec::new(),
        labels: labels.clone(),
    }
}

/// Refuses a blob that has passed its declared `size` (`so_far` bytes).
fn within_size(digest: &str, size: u64, so_far: u64) -> Result<(), RuntimeError> {
    if so_far <= size {
        return Ok(());
    }
    Err(RuntimeError::DigestMismatch {
        digest: digest.to_owned(),
        actual: format!("more than the declared {size} bytes ({so_far} so far)"),
    })
}

/// Refuses a whole blob whose sha256 (`actual`) or length is not the one
/// declared.
fn as_declared(digest: &str, size: u64, actual: &str, length: u64) -> Result<(), RuntimeError> {
    if actual == digest && length == size {
        return Ok(());
    }
    Err(RuntimeError::DigestMismatch {
        digest: digest.to_owned(),
        actual: format!("{actual} ({length} bytes, want {size})"),
    })
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
