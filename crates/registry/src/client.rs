//! The distribution (Docker registry v2) API client, on hyper: manifest
//! resolution, blob download, token and Basic auth, redirects and
//! `hosts.toml` mirrors, and resolving a reference to the image documents of
//! a platform.
//!
//! A [`RegistryClient`] keeps one hyper client per distinct TLS setting of
//! its hosts; redirects (to blob storage, say) and token requests use the
//! client of the host that led to them.
//!
//! Credentials (user and password, identity and registry tokens) go only
//! where they belong, as containerd's CRI decides it and stricter:
//!
//! - to the host named by the auth's `server_address`, or, when it is empty,
//!   to the image reference's registry (and the `server` its hosts.toml
//!   names for it); `docker.io`, `index.docker.io` and `registry-1.docker.io`
//!   are one registry;
//! - to a hosts.toml mirror only when its entry says `send_credentials =
//!   true`, and then only over HTTPS;
//! - never over plain HTTP to any other host, never to a redirect target on
//!   another host (a redirect never carries an `Authorization` header to a
//!   new host, and a 401 from it is answered without credentials);
//! - to a Bearer token server (`realm`) only when the challenge came from a
//!   host that may have them, and the realm is HTTPS or that same host.
//!   Other hosts still get anonymous tokens, as public mirrors need.
//!
//! Every wait for a registry (connect and headers, each body chunk, token
//! requests) is bounded by the progress timeout (default five minutes, as
//! containerd's): a host that sends nothing for that long fails the pull
//! with [`RegistryError::Stalled`]. A blob is refused as soon as it grows
//! past the size its descriptor declares.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

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

use crate::auth::{self, normalize_authority, RegistryAuth};
use crate::error::RegistryError;
use crate::hosts::RegistryHost;
use crate::media::{self, MANIFEST_ACCEPT};
use crate::platform::pick_manifest;
use crate::reference::ReferenceExt as _;
use crate::tls::{self, TlsOptions};

/// Largest manifest or index accepted (as containerd: 4 MiB).
const MAX_MANIFEST: usize = 4 << 20;
const MAX_REDIRECTS: usize = 5;
/// How long a registry may send nothing before a pull fails (containerd's
/// `image_pull_progress_timeout`).
pub const DEFAULT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Names of Docker Hub's registry: credentials for one are for all.
const DOCKER_HUB: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];

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
    /// Normalised authorities that may be sent `auth` (see the module docs).
    credential_hosts: HashSet<String>,
    /// The image being pulled and the progress timeout, for every wait.
    watch: Watch,
    /// `Authorization` values learned per `scheme://authority`.
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

/// The hosts that may be sent credentials for `registry` (the image
/// reference's) served by `hosts`, whose last entry is the registry's own
/// server (as [`hosts_for`](crate::hosts::hosts_for) orders them).
fn credential_hosts(
    auth: Option<&RegistryAuth>,
    registry: &str,
    hosts: &[RegistryHost],
) -> HashSet<String> {
    let mut out = HashSet::new();
    let Some(auth) = auth.filter(|a| !a.is_empty()) else {
        return out;
    };
    let registry = normalize_authority(None, registry);
    let named = auth.server_authority().unwrap_or_else(|| registry.clone());
    let hub = |a: &str| DOCKER_HUB.contains(&a);
    if hub(&named) {
        out.extend(DOCKER_HUB.iter().map(|h| (*h).to_owned()));
    } else {
        out.insert(named.clone());
    }
    // The registry's configured server stands for the registry itself.
    if named == registry || (hub(&named) && hub(&registry)) {
        if let Some(server) = hosts.last() {
            out.insert(normalize_authority(
                Some(server.scheme.as_str()),
                &server.authority,
            ));
        }
    }
    out
}

impl RegistryClient {
    /// A client for `reference`'s repository served by `hosts` (see
    /// [`hosts_for`](crate::hosts::hosts_for); the last is the registry's own server), with the
    /// default progress timeout. Fails only if a host's TLS configuration
    /// cannot be built.
    pub fn new(
        hosts: Vec<RegistryHost>,
        reference: &Reference,
        auth: Option<RegistryAuth>,
    ) -> Result<Self, RegistryError> {
        let mut clients = HashMap::new();
        for h in &hosts {
            if !clients.contains_key(h.tls()) {
                clients.insert(h.tls().clone(), https_client(&h.tls_config()?));
            }
        }
        let credential_hosts = credential_hosts(auth.as_ref(), reference.registry(), &hosts);
        Ok(Self {
            clients,
            hosts,
            repository: reference.repository().to_owned(),
            auth,
            credential_hosts,
            watch: Watch {
                image: reference.to_string(),
                timeout: Some(DEFAULT_PROGRESS_TIMEOUT),
            },
            authorization: Mutex::new(HashMap::new()),
            plain_http: Mutex::new(HashSet::new()),
        })
    }

    /// Fails a request when a host sends nothing for `timeout` (connect and
    /// headers, each body chunk); `None` or zero waits for ever.
    pub fn with_progress_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.watch.timeout = timeout.filter(|t| !t.is_zero());
        self
    }

    /// Whether a request to `uri`, made for `host`, may carry credentials.
    fn may_send_credentials(&self, host: &RegistryHost, uri: &http::Uri) -> bool {
        let Some(authority) = uri.authority() else {
            return false;
        };
        let scheme = uri.scheme_str().unwrap_or("https");
        let key = normalize_authority(Some(scheme), authority.as_str());
        let configured = authority.as_str() == host.authority;
        if scheme == "http" && !configured {
            return false; // plain HTTP only to the host as configured
        }
        if scheme == "http" && host.scheme == "https" && !self.is_plain(authority.as_str()) {
            return false; // a downgrade by redirect
        }
        if self.credential_hosts.contains(&key) {
            return true;
        }
        configured && host.send_credentials && scheme == "https"
    }

    fn is_plain(&self, authority: &str) -> bool {
        self.plain_http
            .lock()
            .is_ok_and(|set| set.contains(authority))
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
        let resp = self.check_status(&url, resp).await?;
        let media_type = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_owned())
            .unwrap_or_default();
        let data = self
            .watch
            .read_limited(&url, resp.into_body(), MAX_MANIFEST)
            .await?;
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

    /// Fetches a small blob (a config) of `size` bytes whole and checks its
    /// digest.
    pub async fn blob_bytes(
        &self,
        host: usize,
        digest: &str,
        size: u64,
    ) -> Result<Bytes, RegistryError> {
        let limit = usize::try_from(size)
            .unwrap_or(usize::MAX)
            .min(MAX_MANIFEST * 4);
        let (url, body) = self.blob(host, digest, size).await?;
        let data = self.watch.read_limited(&url, body, limit).await?;
        if data.len() as u64 != size {
            return Err(RegistryError::TooSmall {
                digest: digest.to_owned(),
                url,
                declared: size,
                received: data.len() as u64,
            });
        }
        let actual = media::sha256_digest(&data);
        if actual != digest {
            return Err(RegistryError::DigestMismatch {
                digest: digest.to_owned(),
                actual,
            });
        }
        Ok(data)
    }

    /// Starts downloading blob `digest` of the declared `size` from host
    /// `host`: a stream of its bytes, which the caller verifies against the
    /// digest. The stream fails as soon as more than `size` bytes arrive,
    /// and when the host sends nothing for the progress timeout.
    pub async fn blob_stream(
        &self,
        host: usize,
        digest: &str,
        size: u64,
    ) -> Result<impl Stream<Item = Result<Bytes, RegistryError>> + Send, RegistryError> {
        let (url, body) = self.blob(host, digest, size).await?;
        Ok(body_stream(
            self.watch.clone(),
            url,
            digest.to_owned(),
            size,
            body,
        ))
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
            .blob_bytes(
                host,
                parsed.config().digest().as_ref(),
                parsed.config().size(),
            )
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

    /// Starts downloading blob `digest` of the declared `size`; the caller
    /// reads the body. A `Content-Length` above `size` is refused at once.
    async fn blob(
        &self,
        host: usize,
        digest: &str,
        size: u64,
    ) -> Result<(String, Incoming), RegistryError> {
        let h = self.host(host)?;
        let url = h.url(&self.repository, "blobs", digest);
        let resp = self.send(h, &url, None).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(RegistryError::NotFound {
                kind: "blob",
                id: url,
            });
        }
        let resp = self.check_status(&url, resp).await?;
        let length = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(length) = length.filter(|l| *l > size) {
            return Err(RegistryError::TooLarge {
                digest: digest.to_owned(),
                url,
                declared: size,
                received: length,
            });
        }
        Ok((url, resp.into_body()))
    }

    async fn check_status(
        &self,
        url: &str,
        resp: Response<Incoming>,
    ) -> Result<Response<Incoming>, RegistryError> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = self.watch.body_text(url, resp.into_body()).await?;
        Err(RegistryError::Status {
            url: url.to_owned(),
            status,
            body,
        })
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

    fn cached_auth(&self, origin: &str) -> Option<String> {
        self.authorization
            .lock()
            .ok()
            .and_then(|m| m.get(origin).cloned())
    }

    /// GET `url` following redirects and answering one auth challenge.
    /// Credentials go only where [`Self::may_send_credentials`] allows; an
    /// `Authorization` value is kept per origin and never follows a
    /// redirect to another one.
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
        // The HTTPS attempt a fallback to plain HTTP followed, and its cause.
        let mut https_failed: Option<(String, String)> = None;
        loop {
            url = self.after_fallback(url);
            let uri: http::Uri =
                url.parse()
                    .map_err(|e: http::uri::InvalidUri| RegistryError::Http {
                        url: url.clone(),
                        source: e.into(),
                    })?;
            let authority = uri.authority().map(|a| a.to_string()).unwrap_or_default();
            let creds_ok = self.may_send_credentials(host, &uri);
            let origin = format!(
                "{}://{authority} {creds_ok}",
                uri.scheme_str().unwrap_or("https")
            );
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
            if let Some(a) = self.cached_auth(&origin) {
                req = req.header(http::header::AUTHORIZATION, a);
            }
            let req = req
                .body(Full::new(Bytes::new()))
                .map_err(|e| RegistryError::Http {
                    url: url.clone(),
                    source: e.into(),
                })?;
            let resp = match self.watch.within(&url, client.request(req)).await? {
                Ok(resp) => resp,
                Err(e) => {
                    let may_fall_back = host.http_fallback
                        && authority == host.authority
                        && uri.scheme_str() == Some("https");
                    if may_fall_back && speaks_no_tls(&e, uri.port().is_some()) {
                        // Once per pull for every plain local registry: not news.
                        tracing::debug!(
                            host = %authority,
                            "registry does not speak TLS; using plain HTTP"
                        );
                        if let Ok(mut set) = self.plain_http.lock() {
                            set.insert(authority);
                        }
                        https_failed = Some((url.clone(), innermost_cause(&e)));
                        url = format!("http://{}", url.trim_start_matches("https://"));
                        continue;
                    }
                    if may_fall_back && is_refused(&e) {
                        // As containerd: a local registry whose HTTPS port
                        // refuses is tried over plain HTTP too, so that the
                        // error, if that fails as well, names both tries.
                        https_failed = Some((url.clone(), innermost_cause(&e)));
                        url = format!("http://{}", url.trim_start_matches("https://"));
                        continue;
                    }
                    if uri.scheme_str() == Some("http") {
                        if let Some((https_url, https_cause)) = https_failed.take() {
                            return Err(RegistryError::Unreachable {
                                authority,
                                https_url,
                                https_cause,
                                http_url: url,
                                http_cause: innermost_cause(&e),
                            });
                        }
                    }
                    return Err(request_error(&url, e));
                }
            };
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && !authed {
                authed = true;
                let challenge = resp
                    .headers()
                    .get(http::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(auth::parse_challenge);
                if !creds_ok && self.auth.as_ref().is_some_and(|a| !a.is_empty()) {
                    tracing::debug!(
                        host = %authority,
                        "registry asks for auth; the pull's credentials are not for this host"
                    );
                }
                let value = self.answer(client, &url, &uri, challenge, creds_ok).await?;
                if let Ok(mut m) = self.authorization.lock() {
                    m.insert(origin, value);
                }
                continue;
            }
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                let body = self.watch.body_text(&url, resp.into_body()).await?;
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

    /// Computes the `Authorization` value answering `challenge` from
    /// `challenger`, asking token servers through `client` (that of the
    /// challenged host). Without `creds_ok`, no credential or token of the
    /// pull is used: Basic fails, Bearer asks for an anonymous token.
    async fn answer(
        &self,
        client: &HttpsClient,
        url: &str,
        challenger: &http::Uri,
        challenge: Option<auth::Challenge>,
        creds_ok: bool,
    ) -> Result<String, RegistryError> {
        let none = RegistryAuth::default();
        let auth = match &self.auth {
            Some(a) if creds_ok => a,
            _ => &none,
        };
        if !auth.registry_token.is_empty() {
            return Ok(format!("Bearer {}", auth.registry_token));
        }
        match challenge {
            Some(auth::Challenge::Basic) => auth.basic_header().ok_or_else(|| {
                let withheld = !creds_ok && self.auth.as_ref().is_some_and(|a| !a.is_empty());
                RegistryError::Unauthorized {
                    url: url.to_owned(),
                    reason: if withheld {
                        "registry wants Basic auth; the pull's credentials are only sent to \
                         their server_address (or a mirror with send_credentials = true \
                         over HTTPS)"
                            .to_owned()
                    } else {
                        "registry wants Basic auth and no credentials were given".to_owned()
                    },
                }
            }),
            Some(auth::Challenge::Bearer {
                realm,
                service,
                scope,
            }) => {
                let scope = scope.unwrap_or_else(|| format!("repository:{}:pull", self.repository));
                let auth = if realm_may_get_credentials(challenger, &realm) {
                    auth
                } else {
                    tracing::debug!(%realm, "token server gets no credentials");
                    &none
                };
                let token = self
                    .fetch_token(client, &realm, service.as_deref(), &scope, auth)
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
        let resp = self
            .watch
            .within(realm, client.request(req))
            .await?
            .map_err(|e| request_error(realm, e))?;
        if matches!(
            resp.status(),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            let body = self.watch.body_text(realm, resp.into_body()).await?;
            return Err(RegistryError::Unauthorized {
                url: realm.to_owned(),
                reason: body,
            });
        }
        let resp = self.check_status(realm, resp).await?;
        let data = self
            .watch
            .read_limited(realm, resp.into_body(), 1 << 20)
            .await?;
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

/// Whether a token server at `realm`, named in a challenge from
/// `challenger`, may be sent credentials: over HTTPS, or the challenging
/// origin itself.
fn realm_may_get_credentials(challenger: &http::Uri, realm: &str) -> bool {
    let Ok(realm) = realm.parse::<http::Uri>() else {
        return false;
    };
    match realm.scheme_str() {
        Some("https") => true,
        Some(scheme) => {
            Some(scheme) == challenger.scheme_str()
                && realm.authority().is_some()
                && realm.authority() == challenger.authority()
        }
        None => false,
    }
}

/// The image a client pulls and its progress timeout: every wait for a
/// registry goes through [`Watch::within`].
#[derive(Debug, Clone)]
struct Watch {
    image: String,
    timeout: Option<Duration>,
}

impl Watch {
    /// `f`, or [`RegistryError::Stalled`] if it does not finish within the
    /// progress timeout.
    async fn within<F: Future>(&self, url: &str, f: F) -> Result<F::Output, RegistryError> {
        match self.timeout {
            None => Ok(f.await),
            Some(t) => tokio::time::timeout(t, f).await.map_err(|_| {
                let host = url
                    .split_once("://")
                    .map_or(url, |(_, rest)| rest)
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                RegistryError::Stalled {
                    image: self.image.clone(),
                    host,
                    url: url.to_owned(),
                    timeout: t,
                }
            }),
        }
    }

    /// The next data chunk of `body` (`None` at its end).
    async fn chunk(&self, url: &str, body: &mut Incoming) -> Result<Option<Bytes>, RegistryError> {
        loop {
            match self.within(url, body.frame()).await? {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(RegistryError::Http {
                        url: url.to_owned(),
                        source: e.into(),
                    })
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// Reads `body` whole, failing past `limit` bytes.
    async fn read_limited(
        &self,
        url: &str,
        mut body: Incoming,
        limit: usize,
    ) -> Result<Bytes, RegistryError> {
        let mut buf = Vec::new();
        while let Some(data) = self.chunk(url, &mut body).await? {
            if buf.len() + data.len() > limit {
                return Err(RegistryError::Status {
                    url: url.to_owned(),
                    status: 200,
                    body: format!("response larger than {limit} bytes"),
                });
            }
            buf.extend_from_slice(&data);
        }
        Ok(Bytes::from(buf))
    }

    /// The first 512 bytes of an error body, for messages; a stall is
    /// still an error.
    async fn body_text(&self, url: &str, body: Incoming) -> Result<String, RegistryError> {
        match self.read_limited(url, body, 64 << 10).await {
            Ok(b) => Ok(String::from_utf8_lossy(&b[..b.len().min(512)])
                .trim()
                .to_owned()),
            Err(e @ RegistryError::Stalled { .. }) => Err(e),
            Err(_) => Ok(String::new()),
        }
    }
}

/// Turns a hyper body into a stream of byte chunks that fails once more
/// than `size` bytes came, or when the host stalls.
fn body_stream(
    watch: Watch,
    url: String,
    digest: String,
    size: u64,
    body: Incoming,
) -> impl Stream<Item = Result<Bytes, RegistryError>> + Send {
    futures::stream::unfold(Some((body, 0u64)), move |state| {
        let url = url.clone();
        let digest = digest.clone();
        let watch = watch.clone();
        async move {
            let (mut body, received) = state?;
            match watch.chunk(&url, &mut body).await {
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
                Ok(Some(data)) => {
                    let received = received + data.len() as u64;
                    if received > size {
                        return Some((
                            Err(RegistryError::TooLarge {
                                digest,
                                url,
                                declared: size,
                                received,
                            }),
                            None,
                        ));
                    }
                    Some((Ok(data), Some((body, received))))
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

/// The innermost cause of a failed request (`Connection refused (os error
/// 111)`), which hyper's outer errors ("client error (Connect)") hide.
fn innermost_cause(e: &hyper_util::client::legacy::Error) -> String {
    tls::error_chain(e)
        .last()
        .map_or_else(|| e.to_string(), |c| c.to_string())
}

/// True when nothing listens where the request went.
fn is_refused(e: &hyper_util::client::legacy::Error) -> bool {
    tls::error_chain(e).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
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

    /// A local registry's closed port: HTTPS then plain HTTP are tried and
    /// the error names both, each once, with the cause.
    #[tokio::test]
    async fn a_closed_local_port_names_both_https_and_http() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = format!("127.0.0.1:{}", closed.local_addr().unwrap().port());
        drop(closed);
        let dir = tempfile::tempdir().unwrap();
        let hosts = crate::hosts_for(dir.path(), &a).unwrap();
        let reference = crate::parse_reference(&format!("{a}/r:t")).unwrap();
        let c = RegistryClient::new(hosts, &reference, None).unwrap();
        let err = c.manifest(0, "t").await.unwrap_err();
        assert!(matches!(err, RegistryError::Unreachable { .. }), "{err:?}");
        let msg = cubelet_chain(&err);
        assert_eq!(msg.matches(&format!("https://{a}/")).count(), 1, "{msg}");
        assert_eq!(msg.matches(&format!("http://{a}/")).count(), 1, "{msg}");
        assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    }

    /// `a: b: c` of an error and its sources (the engine's `chain`).
    fn cubelet_chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut cur = e.source();
        while let Some(s) = cur {
            out.push_str(": ");
            out.push_str(&s.to_string());
            cur = s.source();
        }
        out
    }

    /// What a fake registry does with one request.
    enum Reply {
        /// Write these bytes (a whole HTTP response) and close.
        Full(Vec<u8>),
        /// Write these bytes, then send nothing more while holding the
        /// connection open.
        Stall(Vec<u8>),
    }

    fn reply(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut out = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        {
            out.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        bytes.extend_from_slice(body);
        Reply::Full(bytes)
    }

    fn challenge(value: &str) -> Reply {
        reply("401 Unauthorized", &[("WWW-Authenticate", value)], b"{}")
    }

    /// Each request's path and `Authorization` header.
    type Seen = std::sync::Arc<Mutex<Vec<(String, Option<String>)>>>;

    /// A registry on 127.0.0.1 answering by `handler(path, authorization)`;
    /// every request's `Authorization` header (or `None`) is recorded.
    struct Fake {
        port: u16,
        seen: Seen,
        task: tokio::task::JoinHandle<()>,
    }

    impl Fake {
        async fn start<F>(handler: F) -> Fake
        where
            F: Fn(&str, Option<&str>) -> Reply + Send + Sync + 'static,
        {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let seen = Seen::default();
            let handler = std::sync::Arc::new(handler);
            let log = seen.clone();
            let task = tokio::spawn(async move {
                loop {
                    let Ok((mut conn, _)) = listener.accept().await else {
                        return;
                    };
                    let handler = handler.clone();
                    let log = log.clone();
                    tokio::spawn(async move {
                        let mut head = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match conn.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        let head = String::from_utf8_lossy(&head).into_owned();
                        let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                        let auth = head.lines().find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("authorization")
                                .then(|| v.trim().to_owned())
                        });
                        log.lock().unwrap().push((path.clone(), auth.clone()));
                        match handler(&path, auth.as_deref()) {
                            Reply::Full(bytes) => {
                                let _ = conn.write_all(&bytes).await;
                            }
                            Reply::Stall(bytes) => {
                                let _ = conn.write_all(&bytes).await;
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                            }
                        }
                    });
                }
            });
            Fake { port, seen, task }
        }

        fn authority(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }

        /// The `Authorization` headers this server was sent.
        fn authorizations(&self) -> Vec<String> {
            self.seen
                .lock()
                .unwrap()
                .iter()
                .filter_map(|(_, a)| a.clone())
                .collect()
        }

        fn requests(&self) -> usize {
            self.seen.lock().unwrap().len()
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    const MANIFEST: &[u8] =
        br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}"#;

    fn manifest_reply() -> Reply {
        reply(
            "200 OK",
            &[("Content-Type", "application/vnd.oci.image.manifest.v1+json")],
            MANIFEST,
        )
    }

    fn creds(server_address: &str) -> RegistryAuth {
        RegistryAuth {
            username: "user".into(),
            password: "secret".into(),
            server_address: server_address.into(),
            ..Default::default()
        }
    }

    const BASIC: &str = "Basic dXNlcjpzZWNyZXQ=";

    /// A client for `registry/r:t` whose hosts.toml is `toml`.
    fn client(registry: &str, toml: &str, auth: Option<RegistryAuth>) -> RegistryClient {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(registry)).unwrap();
        std::fs::write(dir.path().join(registry).join("hosts.toml"), toml).unwrap();
        let hosts = crate::hosts_for(dir.path(), registry).unwrap();
        let reference = crate::parse_reference(&format!("{registry}/r:t")).unwrap();
        RegistryClient::new(hosts, &reference, auth).unwrap()
    }

    /// A registry that wants Basic auth and serves the manifest with it.
    async fn basic_registry() -> Fake {
        Fake::start(|_, auth| match auth {
            Some(BASIC) => manifest_reply(),
            _ => challenge(r#"Basic realm="r""#),
        })
        .await
    }

    #[tokio::test]
    async fn credentials_go_only_to_the_host_of_server_address() {
        let registry = basic_registry().await;
        let a = registry.authority();
        let toml = format!("server = \"http://{a}\"\n");
        // Named by server_address (with a scheme and path, or bare), or
        // implied by the reference when server_address is empty.
        for address in [a.clone(), format!("http://{a}/v2/"), String::new()] {
            let c = client(&a, &toml, Some(creds(&address)));
            let got = c.manifest(0, "t").await.unwrap();
            assert!(got.is_some(), "{address:?}");
        }
        assert!(registry.authorizations().iter().all(|h| h == BASIC));
        // Credentials for another registry are not sent here.
        let before = registry.authorizations().len();
        let c = client(&a, &toml, Some(creds("other.example")));
        let err = c.manifest(0, "t").await.unwrap_err();
        assert!(matches!(err, RegistryError::Unauthorized { .. }), "{err:?}");
        assert!(err.to_string().contains("server_address"), "{err}");
        assert_eq!(registry.authorizations().len(), before);
    }

    #[tokio::test]
    async fn mirrors_never_get_credentials_unless_opted_in_over_https() {
        let mirror = Fake::start(|_, _| challenge(r#"Basic realm="m""#)).await;
        let registry = basic_registry().await;
        let (m, a) = (mirror.authority(), registry.authority());
        for opt_in in ["", "  send_credentials = true\n"] {
            let toml = format!(
                "server = \"http://{a}\"\n[host.\"http://{m}\"]\n  capabilities = [\"pull\", \"resolve\"]\n{opt_in}"
            );
            let c = client(&a, &toml, Some(creds(&a)));
            let (host, _) = c.resolve("t").await.unwrap().unwrap();
            assert_eq!(c.hosts()[host].authority, a, "the registry answered");
            assert!(mirror.requests() > 0, "the mirror was asked first");
            // Plain HTTP: never, even when the mirror is opted in.
            assert_eq!(mirror.authorizations(), Vec::<String>::new(), "{opt_in:?}");
        }
        // Over HTTPS an opted-in mirror may have them; a mirror without the
        // key may not.
        let toml = "server = \"https://r.example\"\n\
             [host.\"https://in.example\"]\n  send_credentials = true\n\
             [host.\"https://out.example\"]\n";
        let c = client("r.example", toml, Some(creds("")));
        let uri = |u: &str| u.parse::<http::Uri>().unwrap();
        assert!(c.may_send_credentials(&c.hosts()[0], &uri("https://in.example/v2/x")));
        assert!(!c.may_send_credentials(&c.hosts()[1], &uri("https://out.example/v2/x")));
        assert!(c.may_send_credentials(&c.hosts()[2], &uri("https://r.example/v2/x")));
        // A redirect from the registry down to plain HTTP, or to another host.
        assert!(!c.may_send_credentials(&c.hosts()[2], &uri("http://r.example/v2/x")));
        assert!(!c.may_send_credentials(&c.hosts()[2], &uri("https://cdn.example/b")));
    }

    #[tokio::test]
    async fn docker_hub_names_are_one_registry() {
        let c = client("docker.io", "", Some(creds("https://index.docker.io/v1/")));
        let uri = "https://registry-1.docker.io/v2/x".parse().unwrap();
        assert!(c.may_send_credentials(&c.hosts()[0], &uri));
        let c = client("docker.io", "", Some(creds("ghcr.io")));
        assert!(!c.may_send_credentials(&c.hosts()[0], &uri));
    }

    #[tokio::test]
    async fn a_redirect_to_another_host_carries_no_credentials() {
        let target = Fake::start(|_, _| challenge(r#"Basic realm="cdn""#)).await;
        let to = target.authority();
        let registry = Fake::start(move |path, auth| match auth {
            Some(BASIC) if path.contains("/blobs/") => reply(
                "307 Temporary Redirect",
                &[("Location", &format!("http://{to}/blob"))],
                b"",
            ),
            Some(BASIC) => manifest_reply(),
            _ => challenge(r#"Basic realm="r""#),
        })
        .await;
        let a = registry.authority();
        let c = client(&a, &format!("server = \"http://{a}\"\n"), Some(creds(&a)));
        // Authorised with the registry first, so the blob request carries
        // its Authorization and the redirect target's 401 is the first
        // challenge of that request.
        assert!(c.manifest(0, "t").await.unwrap().is_some());
        let digest = format!("sha256:{}", "0".repeat(64));
        let err = c.blob_bytes(0, &digest, 10).await.unwrap_err();
        assert!(matches!(err, RegistryError::Unauthorized { .. }), "{err:?}");
        assert!(target.requests() > 0, "the redirect was followed");
        assert_eq!(target.authorizations(), Vec::<String>::new());
        assert!(registry.authorizations().iter().all(|h| h == BASIC));
    }

    #[tokio::test]
    async fn a_token_server_on_another_plain_http_host_gets_no_credentials() {
        let tokens = Fake::start(|_, _| reply("200 OK", &[], br#"{"token":"anon"}"#)).await;
        let realm = format!("http://{}/token", tokens.authority());
        let registry = Fake::start(move |path, auth| match (path, auth) {
            (p, Some(BASIC)) if p.starts_with("/token") => {
                reply("200 OK", &[], br#"{"token":"full"}"#)
            }
            (_, Some("Bearer anon" | "Bearer full")) => manifest_reply(),
            _ => challenge(&format!(r#"Bearer realm="{realm}",service="r""#)),
        })
        .await;
        let a = registry.authority();
        let toml = format!("server = \"http://{a}\"\n");
        let c = client(&a, &toml, Some(creds(&a)));
        assert!(c.manifest(0, "t").await.unwrap().is_some());
        assert!(tokens.requests() > 0, "an anonymous token was asked for");
        assert_eq!(tokens.authorizations(), Vec::<String>::new());
        // The challenging host itself, as its own plain-HTTP realm, may
        // have them.
        let own_realm = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
        let cell = own_realm.clone();
        let own = Fake::start(move |path, auth| match (path, auth) {
            (p, Some(BASIC)) if p.starts_with("/token") => {
                reply("200 OK", &[], br#"{"token":"full"}"#)
            }
            (_, Some("Bearer full")) => manifest_reply(),
            _ => challenge(&format!(
                r#"Bearer realm="{}""#,
                cell.get().map_or("", String::as_str)
            )),
        })
        .await;
        let o = own.authority();
        own_realm.set(format!("http://{o}/token")).unwrap();
        let c = client(&o, &format!("server = \"http://{o}\"\n"), Some(creds(&o)));
        assert!(c.manifest(0, "t").await.unwrap().is_some());
        assert!(own.authorizations().contains(&BASIC.to_owned()));
        // Any HTTPS realm may; a relative or plain-HTTP foreign one may not.
        let from = format!("http://{o}/v2/x").parse().unwrap();
        assert!(realm_may_get_credentials(
            &from,
            "https://auth.example/token"
        ));
        assert!(!realm_may_get_credentials(
            &from,
            "http://auth.example/token"
        ));
        assert!(!realm_may_get_credentials(&from, "/token"));
    }

    #[tokio::test]
    async fn a_stalled_host_fails_after_the_progress_timeout() {
        // Accepts and reads the request, never answers.
        let silent = Fake::start(|_, _| Reply::Stall(Vec::new())).await;
        let a = silent.authority();
        let c = client(&a, &format!("server = \"http://{a}\"\n"), None)
            .with_progress_timeout(Some(Duration::from_millis(300)));
        let err = c.manifest(0, "t").await.unwrap_err();
        assert!(matches!(err, RegistryError::Stalled { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&format!("{a}/r:t")), "names the image: {msg}");
        assert!(msg.contains(&format!("registry host {a}")), "{msg}");
        assert!(msg.contains("pull_progress_timeout"), "{msg}");

        // Headers and part of a blob, then nothing.
        let partial = Fake::start(|_, _| {
            Reply::Stall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789".to_vec())
        })
        .await;
        let p = partial.authority();
        let c = client(&p, &format!("server = \"http://{p}\"\n"), None)
            .with_progress_timeout(Some(Duration::from_millis(300)));
        let digest = format!("sha256:{}", "0".repeat(64));
        let stream = c.blob_stream(0, &digest, 100).await.unwrap();
        let chunks: Vec<_> = futures::StreamExt::collect(stream).await;
        let last = chunks.last().unwrap().as_ref().unwrap_err();
        assert!(matches!(last, RegistryError::Stalled { .. }), "{last:?}");
    }

    #[tokio::test]
    async fn a_document_smaller_than_declared_is_refused_though_its_digest_matches() {
        let data = b"{\"architecture\":\"amd64\"}".to_vec();
        let digest = media::sha256_digest(&data);
        let served = data.clone();
        let registry = Fake::start(move |_, _| reply("200 OK", &[], &served)).await;
        let a = registry.authority();
        let c = client(&a, &format!("server = \"http://{a}\"\n"), None);
        let n = data.len() as u64;
        assert_eq!(c.blob_bytes(0, &digest, n).await.unwrap(), data);
        let err = c.blob_bytes(0, &digest, n + 5).await.unwrap_err();
        assert!(
            matches!(err, RegistryError::TooSmall { declared, received, .. } if declared == n + 5 && received == n),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("smaller than its declared"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_blob_larger_than_declared_is_refused() {
        let digest = format!("sha256:{}", "0".repeat(64));
        // Announced too large: refused before any byte is read.
        let big = Fake::start(|_, _| reply("200 OK", &[], &[7u8; 64])).await;
        let b = big.authority();
        let c = client(&b, &format!("server = \"http://{b}\"\n"), None);
        let err = c.blob_stream(0, &digest, 16).await.err().unwrap();
        assert!(
            matches!(
                err,
                RegistryError::TooLarge {
                    declared: 16,
                    received: 64,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = c.blob_bytes(0, &digest, 16).await.unwrap_err();
        assert!(matches!(err, RegistryError::TooLarge { .. }), "{err:?}");
        // Chunked, so no length is announced: cut off at the first byte
        // past the declared size.
        let chunked = Fake::start(|_, _| {
            let mut r =
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    .to_vec();
            for _ in 0..4 {
                r.extend_from_slice(b"10\r\n0123456789abcdef\r\n");
            }
            r.extend_from_slice(b"0\r\n\r\n");
            Reply::Full(r)
        })
        .await;
        let k = chunked.authority();
        let c = client(&k, &format!("server = \"http://{k}\"\n"), None);
        let stream = c.blob_stream(0, &digest, 40).await.unwrap();
        let chunks: Vec<_> = futures::StreamExt::collect(stream).await;
        let got: usize = chunks
            .iter()
            .filter_map(|c| c.as_ref().ok())
            .map(Bytes::len)
            .sum();
        assert!(got <= 40, "{got} bytes passed the cap");
        let last = chunks.last().unwrap().as_ref().unwrap_err();
        assert!(
            matches!(last, RegistryError::TooLarge { declared: 40, .. }),
            "{last:?}"
        );
    }
}
