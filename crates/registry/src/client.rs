//! The distribution (Docker registry v2) API client, on hyper: manifest
//! resolution, blob download, token and Basic auth, redirects and
//! `hosts.toml` mirrors, and resolving a reference to the image documents of
//! a platform.
//!
//! A [`RegistryClient`] keeps one hyper client per distinct TLS setting of
//! its hosts; redirects (to blob storage, say) and token requests use the
//! client of the host that led to them.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use bytes::Bytes;
use futures::Stream;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::{Method, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use oci_spec::distribution::Reference;
use oci_spec::image::{ImageManifest, MediaType, Platform};

use crate::auth::{self, RegistryAuth};
use crate::error::RegistryError;
use crate::hosts::RegistryHost;
use crate::media::{self, MANIFEST_ACCEPT};
use crate::platform::pick_manifest;
use crate::reference::ReferenceExt as _;
use crate::tls::{self, TlsOptions};

/// Largest manifest or index accepted (as containerd: 4 MiB).
const MAX_MANIFEST: usize = 4 << 20;
const MAX_REDIRECTS: usize = 5;

/// A hyper client for `http` and `https` URLs with one TLS setting.
type HttpsClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A manifest or small blob read from a registry.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Media type (from `Content-Type` for manifests, else the document's
    /// own `mediaType`).
    pub media_type: MediaType,
    /// `sha256:` digest of `data`.
    pub digest: String,
    /// The bytes.
    pub data: Bytes,
}

/// The documents of one image, as a pull needs them before any layer.
#[derive(Debug, Clone)]
pub struct ImageDocuments {
    /// The document the reference resolved to: an index or a manifest.
    pub top: Fetched,
    /// Position of the chosen manifest in the index, when `top` is one.
    pub index_pick: Option<usize>,
    /// The chosen manifest (`top` itself without an index).
    pub manifest: Fetched,
    /// `manifest`, decoded.
    pub parsed: ImageManifest,
    /// The config blob `parsed` names.
    pub config: Bytes,
}

/// A registry client for one repository, over its ordered hosts.
#[derive(Debug)]
pub struct RegistryClient {
    /// One client per distinct TLS setting of the hosts.
    clients: HashMap<TlsOptions, HttpsClient>,
    hosts: Vec<RegistryHost>,
    repository: String,
    auth: Option<RegistryAuth>,
    /// `Authorization` values learned per host authority.
    authorization: Mutex<HashMap<String, String>>,
    /// Authorities of `http_fallback` hosts found to speak plain HTTP.
    plain_http: Mutex<HashSet<String>>,
}

fn https_client(config: &tls::TlsConfig) -> HttpsClient {
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.client_config())
        .https_or_http()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

impl RegistryClient {
    /// A client for `repository` served by `hosts` (see [`hosts_for`](crate::hosts::hosts_for)).
    /// Fails only if a host's TLS configuration cannot be built.
    pub fn new(
        hosts: Vec<RegistryHost>,
        repository: &str,
        auth: Option<RegistryAuth>,
    ) -> Result<Self, RegistryError> {
        let mut clients = HashMap::new();
        for h in &hosts {
            if !clients.contains_key(h.tls()) {
                clients.insert(h.tls().clone(), https_client(&h.tls_config()?));
            }
        }
        Ok(Self {
            clients,
            hosts,
            repository: repository.to_owned(),
            auth,
            authorization: Mutex::new(HashMap::new()),
            plain_http: Mutex::new(HashSet::new()),
        })
    }

    /// The hosts, in the order they are tried.
    pub fn hosts(&self) -> &[RegistryHost] {
        &self.hosts
    }

    /// Resolves `object` (a tag or a digest) to a manifest or index, trying
    /// each capable host in order. Returns the index of the host that
    /// answered, or `None` if every host said the manifest does not exist.
    pub async fn resolve(&self, object: &str) -> Result<Option<(usize, Fetched)>, RegistryError> {
        let by_digest = object.starts_with("sha256:");
        let mut last_err = None;
        for (i, host) in self.hosts.iter().enumerate() {
            if !(host.resolve || (by_digest && host.pull)) {
                continue;
            }
            match self.manifest(i, object).await {
                Ok(Some(f)) => return Ok(Some((i, f))),
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(host = %host.authority, error = %e, "registry host failed");
                    last_err = Some(e);
                }
            }
        }
        match last_err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// Fetches the manifest `object` from host `host`; `None` on 404.
    pub async fn manifest(
        &self,
        host: usize,
        object: &str,
    ) -> Result<Option<Fetched>, RegistryError> {
        let h = self.host(host)?;
        let url = h.url(&self.repository, "manifests", object);
        let resp = self.send(h, &url, Some(MANIFEST_ACCEPT)).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let resp = check_status(&url, resp).await?;
        let media_type = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_owned())
            .unwrap_or_default();
        let data = read_limited(&url, resp.into_body(), MAX_MANIFEST).await?;
        let digest = media::sha256_digest(&data);
        if object.starts_with("sha256:") && digest != object {
            return Err(RegistryError::DigestMismatch {
                digest: object.to_owned(),
                actual: digest,
            });
        }
        // Fall back to the document's own mediaType if the header is generic.
        let media_type = MediaType::from(media_type.as_str());
        let media_type = if media::is_index(&media_type) || media::is_manifest(&media_type) {
            media_type
        } else {
            serde_json::from_slice::<serde_json::Value>(&data)
                .ok()
                .and_then(|v| {
                    v.get("mediaType")
                        .and_then(|m| m.as_str())
                        .map(MediaType::from)
                })
                .unwrap_or(media_type)
        };
        Ok(Some(Fetched {
            media_type,
            digest,
            data,
        }))
    }

    /// Fetches a small blob (a config) whole and checks its digest.
    pub async fn blob_bytes(&self, host: usize, digest: &str) -> Result<Bytes, RegistryError> {
        let (url, body) = self.blob(host, digest).await?;
        let data = read_limited(&url, body, MAX_MANIFEST * 4).await?;
        let actual = media::sha256_digest(&data);
        if actual != digest {
            return Err(RegistryError::DigestMismatch {
                digest: digest.to_owned(),
                actual,
            });
        }
        Ok(data)
    }

    /// Starts downloading blob `digest` from host `host`: a stream of its
    /// bytes, which the caller verifies against the digest.
    pub async fn blob_stream(
        &self,
        host: usize,
        digest: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, RegistryError>> + Send, RegistryError> {
        let (url, body) = self.blob(host, digest).await?;
        Ok(body_stream(url, body))
    }

    /// Resolves `reference` and fetches the image manifest for `platform`
    /// (through the index, if the reference names one) and its config.
    /// Returns the host that answered with the documents, or `None` if the
    /// registry has no such manifest.
    pub async fn fetch_image(
        &self,
        reference: &Reference,
        platform: &Platform,
    ) -> Result<Option<(usize, ImageDocuments)>, RegistryError> {
        let name = reference.to_string();
        let Some((host, top)) = self.resolve(reference.object()).await? else {
            return Ok(None);
        };
        tracing::debug!(%name, digest = %top.digest, media_type = %top.media_type, "resolved");
        let (index_pick, manifest) = if media::is_index(&top.media_type) {
            let index = media::decode_index(&top.data)?;
            let (pick, entry) = pick_manifest(&index, platform, &name)?;
            let Some(m) = self.manifest(host, entry.digest().as_ref()).await? else {
                return Ok(None);
            };
            (Some(pick), m)
        } else if media::is_manifest(&top.media_type) {
            (None, top.clone())
        } else {
            return Err(RegistryError::ImageFormat {
                reference: name,
                reason: format!(
                    "unsupported manifest media type {:?}",
                    top.media_type.as_ref()
                ),
            });
        };
        let parsed = media::decode_manifest(&manifest.data)?;
        let config = self
            .blob_bytes(host, parsed.config().digest().as_ref())
            .await?;
        Ok(Some((
            host,
            ImageDocuments {
                top,
                index_pick,
                manifest,
                parsed,
                config,
            },
        )))
    }

    /// Starts downloading blob `digest`; the caller reads the body.
    async fn blob(&self, host: usize, digest: &str) -> Result<(String, Incoming), RegistryError> {
        let h = self.host(host)?;
        let url = h.url(&self.repository, "blobs", digest);
        let resp = self.send(h, &url, None).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(RegistryError::NotFound {
                kind: "blob",
                id: url,
            });
        }
        let resp = check_status(&url, resp).await?;
        Ok((url, resp.into_body()))
    }

    fn host(&self, i: usize) -> Result<&RegistryHost, RegistryError> {
        self.hosts
            .get(i)
            .ok_or_else(|| RegistryError::InvalidArgument {
                field: "registry host".to_owned(),
                reason: format!("no host #{i}"),
            })
    }

    /// The hyper client for `host`'s TLS setting.
    fn client(&self, host: &RegistryHost) -> Result<&HttpsClient, RegistryError> {
        self.clients
            .get(host.tls())
            .ok_or_else(|| RegistryError::InvalidArgument {
                field: "registry host".to_owned(),
                reason: format!("no client for the TLS settings of {}", host.authority),
            })
    }

    /// `url` over plain HTTP if its authority was found not to speak TLS.
    fn after_fallback(&self, url: String) -> String {
        let Some(rest) = url.strip_prefix("https://") else {
            return url;
        };
        let authority = rest.split('/').next().unwrap_or(rest);
        let plain = self
            .plain_http
            .lock()
            .is_ok_and(|set| set.contains(authority));
        if plain {
            format!("http://{rest}")
        } else {
            url
        }
    }

    fn cached_auth(&self, authority: &str) -> Option<String> {
        self.authorization
            .lock()
            .ok()
            .and_then(|m| m.get(authority).cloned())
    }

    /// GET `url` following redirects and answering one auth challenge.
    async fn send(
        &self,
        host: &RegistryHost,
        url: &str,
        accept: Option<&str>,
    ) -> Result<Response<Incoming>, RegistryError> {
        let client = self.client(host)?;
        let mut url = url.to_owned();
        let mut authed = false;
        let mut redirects = 0;
        loop {
            url = self.after_fallback(url);
            let uri: http::Uri =
                url.parse()
                    .map_err(|e: http::uri::InvalidUri| RegistryError::Http {
                        url: url.clone(),
                        source: e.into(),
                    })?;
            let authority = uri.authority().map(|a| a.to_string()).unwrap_or_default();
            let mut req = hyper::Request::builder()
                .method(Method::GET)
                .uri(uri.clone());
            if let Some(a) = accept {
                req = req.header(http::header::ACCEPT, a);
            }
            if authority == host.authority {
                for (k, v) in &host.headers {
                    req = req.header(k.as_str(), v.as_str());
                }
            }
            if let Some(a) = self.cached_auth(&authority) {
                req = req.header(http::header::AUTHORIZATION, a);
            }
            let req = req
                .body(Full::new(Bytes::new()))
                .map_err(|e| RegistryError::Http {
                    url: url.clone(),
                    source: e.into(),
                })?;
            let resp = match client.request(req).await {
                Ok(resp) => resp,
                Err(e)
                    if host.http_fallback
                        && authority == host.authority
                        && uri.scheme_str() == Some("https")
                        && speaks_no_tls(&e, uri.port().is_some()) =>
                {
                    // Once per pull for every plain local registry: not news.
                    tracing::debug!(
                        host = %authority,
                        "registry does not speak TLS; using plain HTTP"
                    );
                    if let Ok(mut set) = self.plain_http.lock() {
                        set.insert(authority);
                    }
                    url = format!("http://{}", url.trim_start_matches("https://"));
                    continue;
                }
                Err(e) => return Err(request_error(&url, e)),
            };
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && !authed {
                authed = true;
                let challenge = resp
                    .headers()
                    .get(http::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(auth::parse_challenge);
                let value = self.answer(client, &url, challenge).await?;
                if let Ok(mut m) = self.authorization.lock() {
                    m.insert(authority, value);
                }
                continue;
            }
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                let body = body_text(resp.into_body()).await;
                return Err(RegistryError::Unauthorized { url, reason: body });
            }
            if status.is_redirection() {
                let Some(loc) = resp
                    .headers()
                    .get(http::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                else {
                    return Ok(resp);
                };
                redirects += 1;
                if redirects > MAX_REDIRECTS {
                    return Err(RegistryError::Status {
                        url,
                        status: status.as_u16(),
                        body: "too many redirects".to_owned(),
                    });
                }
                url = if loc.starts_with("http://") || loc.starts_with("https://") {
                    loc.to_owned()
                } else {
                    let scheme = uri.scheme_str().unwrap_or("http");
                    format!("{scheme}://{authority}{loc}")
                };
                continue;
            }
            return Ok(resp);
        }
    }

    /// Computes the `Authorization` value answering `challenge`, asking
    /// token servers through `client` (that of the challenged host).
    async fn answer(
        &self,
        client: &HttpsClient,
        url: &str,
        challenge: Option<auth::Challenge>,
    ) -> Result<String, RegistryError> {
        let auth = self.auth.clone().unwrap_or_default();
        if !auth.registry_token.is_empty() {
            return Ok(format!("Bearer {}", auth.registry_token));
        }
        match challenge {
            Some(auth::Challenge::Basic) => {
                auth.basic_header()
                    .ok_or_else(|| RegistryError::Unauthorized {
                        url: url.to_owned(),
                        reason: "registry wants Basic auth and no credentials were given"
                            .to_owned(),
                    })
            }
            Some(auth::Challenge::Bearer {
                realm,
                service,
                scope,
            }) => {
                let scope = scope.unwrap_or_else(|| format!("repository:{}:pull", self.repository));
                let token = self
                    .fetch_token(client, &realm, service.as_deref(), &scope, &auth)
                    .await?;
                Ok(format!("Bearer {token}"))
            }
            None => Err(RegistryError::Unauthorized {
                url: url.to_owned(),
                reason: "401 without a usable WWW-Authenticate challenge".to_owned(),
            }),
        }
    }

    /// Asks a token server for a bearer token.
    async fn fetch_token(
        &self,
        client: &HttpsClient,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        auth: &RegistryAuth,
    ) -> Result<String, RegistryError> {
        let mut query = vec![("scope", scope.to_owned())];
        if let Some(s) = service {
            query.push(("service", s.to_owned()));
        }
        let req = if !auth.identity_token.is_empty() {
            // OAuth2 refresh-token grant, as containerd does with identity tokens.
            query.push(("grant_type", "refresh_token".to_owned()));
            query.push(("client_id", "cubelet".to_owned()));
            query.push(("refresh_token", auth.identity_token.clone()));
            hyper::Request::builder()
                .method(Method::POST)
                .uri(realm)
                .header(
                    http::header::CONTENT_TYPE,
                    "application/x-www-form-urlencoded",
                )
                .body(Full::new(Bytes::from(form_encode(&query))))
        } else {
            let sep = if realm.contains('?') { '&' } else { '?' };
            let mut b = hyper::Request::builder()
                .method(Method::GET)
                .uri(format!("{realm}{sep}{}", form_encode(&query)));
            if let Some(h) = auth.basic_header() {
                b = b.header(http::header::AUTHORIZATION, h);
            }
            b.body(Full::new(Bytes::new()))
        }
        .map_err(|e| RegistryError::Http {
            url: realm.to_owned(),
            source: e.into(),
        })?;
        let resp = client
            .request(req)
            .await
            .map_err(|e| request_error(realm, e))?;
        if matches!(
            resp.status(),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            let body = body_text(resp.into_body()).await;
            return Err(RegistryError::Unauthorized {
                url: realm.to_owned(),
                reason: body,
            });
        }
        let resp = check_status(realm, resp).await?;
        let data = read_limited(realm, resp.into_body(), 1 << 20).await?;
        #[derive(serde::Deserialize)]
        struct Token {
            #[serde(default)]
            token: String,
            #[serde(default)]
            access_token: String,
        }
        let t: Token = serde_json::from_slice(&data).map_err(|source| RegistryError::Json {
            what: "registry token response",
            source,
        })?;
        let token = if t.access_token.is_empty() {
            t.token
        } else {
            t.access_token
        };
        if token.is_empty() {
            return Err(RegistryError::Unauthorized {
                url: realm.to_owned(),
                reason: "token server returned no token".to_owned(),
            });
        }
        Ok(token)
    }
}

/// Turns a hyper body into a stream of byte chunks.
fn body_stream(
    url: String,
    body: Incoming,
) -> impl Stream<Item = Result<Bytes, RegistryError>> + Send {
    futures::stream::unfold(Some(body), move |state| {
        let url = url.clone();
        async move {
            let mut body = state?;
            loop {
                match body.frame().await {
                    None => return None,
                    Some(Err(e)) => {
                        return Some((
                            Err(RegistryError::Http {
                                url,
                                source: e.into(),
                            }),
                            None,
                        ))
                    }
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            return Some((Ok(data), Some(body)));
                        }
                    }
                }
            }
        }
    })
}

/// Maps a failed request: a rejected server certificate gets its own error
/// (saying how to trust it), the rest keep the whole cause chain.
fn request_error(url: &str, e: hyper_util::client::legacy::Error) -> RegistryError {
    if let Some(err @ rustls::Error::InvalidCertificate(_)) = tls::find_rustls_error(&e) {
        return RegistryError::Certificate {
            url: url.to_owned(),
            source: err.clone(),
        };
    }
    RegistryError::Http {
        url: url.to_owned(),
        source: e.into(),
    }
}

/// True when an HTTPS attempt failed because the server speaks plain HTTP:
/// its answer to the TLS hello is not TLS (rustls sees an invalid record),
/// or, when the URL gave no port, nothing listens on 443.
fn speaks_no_tls(e: &hyper_util::client::legacy::Error, port_given: bool) -> bool {
    if let Some(err) = tls::find_rustls_error(e) {
        return matches!(err, rustls::Error::InvalidMessage(_));
    }
    if port_given {
        return false;
    }
    tls::error_chain(e).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Percent-encodes `k=v&...` (RFC 3986 unreserved characters kept).
fn form_encode(pairs: &[(&str, String)]) -> String {
    fn enc(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

async fn check_status(
    url: &str,
    resp: Response<Incoming>,
) -> Result<Response<Incoming>, RegistryError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let body = body_text(resp.into_body()).await;
    Err(RegistryError::Status {
        url: url.to_owned(),
        status,
        body,
    })
}

/// The first 512 bytes of a body, for error messages.
async fn body_text(body: Incoming) -> String {
    match read_limited("", body, 64 << 10).await {
        Ok(b) => String::from_utf8_lossy(&b[..b.len().min(512)])
            .trim()
            .to_owned(),
        Err(_) => String::new(),
    }
}

async fn read_limited(url: &str, mut body: Incoming, limit: usize) -> Result<Bytes, RegistryError> {
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| RegistryError::Http {
            url: url.to_owned(),
            source: e.into(),
        })?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(RegistryError::Status {
                    url: url.to_owned(),
                    status: 200,
                    body: format!("response larger than {limit} bytes"),
                });
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_encoding_escapes_reserved_characters() {
        let q = [
            ("scope", "repository:library/busybox:pull".to_owned()),
            ("service", "a b".to_owned()),
        ];
        assert_eq!(
            form_encode(&q),
            "scope=repository%3Alibrary%2Fbusybox%3Apull&service=a%20b"
        );
    }

    async fn https_get(url: String) -> hyper_util::client::legacy::Error {
        let client = https_client(&tls::default_config().unwrap());
        let req = hyper::Request::get(url)
            .body(Full::new(Bytes::new()))
            .unwrap();
        client.request(req).await.unwrap_err()
    }

    #[tokio::test]
    async fn plain_http_answers_and_refused_port_443_mean_no_tls() {
        // A server that answers the TLS hello in plain HTTP, as a plain
        // registry does.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf).await;
            let _ = conn
                .write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
                .await;
        });
        let e = https_get(format!("https://127.0.0.1:{port}/v2/")).await;
        assert!(speaks_no_tls(&e, true), "{e:?}");
        server.await.unwrap();
        assert!(matches!(request_error("u", e), RegistryError::Http { .. }));

        // Nothing listens on a just-closed port: that means "no TLS" only
        // when the URL named no port (443 implied, 80 may serve HTTP).
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let e = https_get(format!("https://127.0.0.1:{port}/v2/")).await;
        assert!(speaks_no_tls(&e, false), "{e:?}");
        assert!(!speaks_no_tls(&e, true), "{e:?}");
    }
}
