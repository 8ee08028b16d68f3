//! Fetching from other nodes on a local miss: find providers in the DHT (bounded by
//! `--resolve-timeout`), then ask their peer addresses over HTTP, one after the other, until one
//! answers. Blobs stream through and resume on the next provider if a peer fails mid-transfer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;

use super::HOP_HEADER;
use super::resume::{Fetch, ResumingBody};
use crate::coalesce::leases::Grant;
use crate::coalesce::{CLAIM_PATH, ClaimSender, FOLLOW_HEADER};
use crate::metrics::{Metrics, ResultLabels, SourceLabels, StageLabels};
use crate::oci::manifest::{MAX_MANIFEST_BYTES, is_manifest_media_type, sniff_media_type};
use crate::oci::{self, Digest, Reference};
use crate::routing::{Peer, Router, digest_key, tag_key};
use crate::store::ContentStore;
use crate::trust::{ClusterSecret, TOKEN_HEADER, token};

/// Providers found are reused this long: a pull asks for a handful of blobs in a burst.
const LOOKUP_CACHE_TTL: Duration = Duration::from_secs(5);
/// A peer that just failed (unreachable, slow, cut off) is tried last for this long.
const FAILED_PEER_BACKOFF: Duration = Duration::from_secs(30);
/// A peer that served bytes not matching their digest is not asked at all for this long.
const QUARANTINE: Duration = Duration::from_secs(600);
/// Providers arriving this soon after the first are kept as failover candidates.
const MORE_PROVIDERS_GRACE: Duration = Duration::from_millis(2);
/// Manifest media types we accept from peers, most specific first.
const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

/// What the mirror was asked, as it is forwarded to peers.
#[derive(Debug, Clone, Copy)]
pub struct PeerRequest<'a> {
    pub name: &'a str,
    pub ns: Option<&'a str>,
    pub head: bool,
    pub range: Option<&'a str>,
}

#[derive(Debug, Clone, Copy)]
pub struct PeerFetchConfig {
    /// How long a lookup may take before the miss goes upstream.
    pub resolve_timeout: Duration,
    /// Bound on the TCP connect to a peer.
    pub connect_timeout: Duration,
    /// Bound from sending a request to a peer's response headers.
    pub first_byte_timeout: Duration,
    /// Longest silence in a peer's body before moving to the next provider.
    pub idle_timeout: Duration,
    /// Blobs up to this size are fetched whole and verified before the first byte is served.
    pub verify_before_serving: u64,
}

impl PeerFetchConfig {
    /// The documented defaults (see `config/ferry.toml`), for tests and embedding.
    pub fn with_resolve_timeout(resolve_timeout: Duration) -> Self {
        PeerFetchConfig {
            resolve_timeout,
            connect_timeout: Duration::from_millis(500),
            first_byte_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(5),
            verify_before_serving: MAX_MANIFEST_BYTES,
        }
    }
}

/// Peers to skip: until when, per peer ID. Shared by the fetcher and the bodies it starts.
type Skips = Arc<Mutex<HashMap<String, Instant>>>;

pub struct PeerFetcher {
    router: Arc<dyn Router>,
    client: reqwest::Client,
    config: PeerFetchConfig,
    secret: Option<ClusterSecret>,
    metrics: Arc<Metrics>,
    /// This node's store, to drop what a lying peer left in containerd's partial downloads.
    store: Arc<dyn ContentStore>,
    /// One owner each: the cache of recent lookups and the peers that failed recently.
    cache: Mutex<HashMap<String, (Instant, Vec<Peer>)>>,
    failed: Skips,
}

impl std::fmt::Debug for PeerFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerFetcher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PeerFetcher {
    pub fn new(
        router: Arc<dyn Router>,
        config: PeerFetchConfig,
        secret: Option<ClusterSecret>,
        metrics: Arc<Metrics>,
        store: Arc<dyn ContentStore>,
    ) -> Self {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            // Peers are addressed by IP on the node network; never through a proxy.
            .no_proxy()
            .build()
            .unwrap_or_default();
        PeerFetcher {
            router,
            client,
            config,
            secret,
            metrics,
            store,
            cache: Mutex::new(HashMap::new()),
            failed: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A blob (or one range of it) from the first provider that answers. Blobs up to
    /// `verify_before_serving` are fetched whole and checked before the first byte is sent;
    /// larger ones stream through, hashed on the way.
    pub async fn blob(&self, req: PeerRequest<'_>, digest: Digest) -> Option<Response> {
        let providers = self.providers(&digest_key(&digest)).await;
        self.blob_from(req, digest, providers, None).await
    }

    /// A blob from `leader`, whose containerd is downloading it now: its Ferry streams the
    /// download as it lands (after waiting up to `wait` for it to start).
    pub async fn blob_following(
        &self,
        req: PeerRequest<'_>,
        digest: Digest,
        leader: &Peer,
        wait: Duration,
    ) -> Option<Response> {
        self.blob_from(req, digest, vec![leader.clone()], Some(wait))
            .await
    }

    async fn blob_from(
        &self,
        req: PeerRequest<'_>,
        digest: Digest,
        providers: Vec<Peer>,
        follow: Option<Duration>,
    ) -> Option<Response> {
        let path = format!("/v2/{}/blobs/{digest}", req.name);
        let mut candidates = providers.into_iter();
        while let Some(peer) = candidates.next() {
            // The list may predate a verification failure seen by another request.
            if quarantined(&self.failed, &peer) {
                continue;
            }
            let method = if req.head { "HEAD" } else { "GET" };
            let Some(response) = self
                .send(&peer, method, &path, req.ns, req.range, follow)
                .await
            else {
                continue;
            };
            let status = response.status();
            if status == StatusCode::RANGE_NOT_SATISFIABLE {
                // The peer has the blob; the range is wrong for everyone.
                return Some(forward_headers(&response, Body::empty()));
            }
            if status != StatusCode::OK && status != StatusCode::PARTIAL_CONTENT {
                if status != StatusCode::NOT_FOUND {
                    self.peer_failed(&peer, "status", status.as_str());
                }
                continue;
            }
            if req.head {
                return Some(forward_headers(&response, Body::empty()));
            }
            let Some(fetch) = Fetch::from_response(&response, digest.clone()) else {
                self.peer_failed(&peer, "status", "response without a usable length");
                continue;
            };
            if fetch.total <= self.config.verify_before_serving {
                match self
                    .verified_whole(&peer, response, &fetch, &path, req.ns)
                    .await
                {
                    Ok(whole) => {
                        let start = fetch.start as usize;
                        let part = whole.slice(start..start + fetch.len as usize);
                        self.count_peer_bytes("blob", part.len());
                        return Some(fetch.response(Body::from(part)));
                    }
                    Err((stage, reason)) => {
                        self.peer_failed(&peer, stage, &reason);
                        continue;
                    }
                }
            }
            let first = response.bytes_stream().boxed();
            let remaining: Vec<Peer> = candidates.collect();
            let body = ResumingBody::new(
                fetch.clone(),
                peer.clone(),
                first,
                remaining,
                self.resumer(path.clone(), req.ns.map(str::to_string)),
            );
            let metrics = self.metrics.clone();
            let counted = body.into_stream().inspect(move |chunk| {
                if let Ok(c) = chunk {
                    metrics
                        .bytes_served
                        .get_or_create(&SourceLabels {
                            kind: "blob",
                            source: "peer",
                        })
                        .inc_by(c.len() as u64);
                }
            });
            return Some(fetch.response(Body::from_stream(counted)));
        }
        None
    }

    /// The whole blob from `peer`, checked against its digest. `response` is used when it
    /// already carries the whole blob; for a range, the whole blob is asked for again.
    async fn verified_whole(
        &self,
        peer: &Peer,
        response: reqwest::Response,
        fetch: &Fetch,
        path: &str,
        ns: Option<&str>,
    ) -> Result<Bytes, (&'static str, String)> {
        let response = if fetch.partial {
            drop(response);
            match self.send(peer, "GET", path, ns, None, None).await {
                Some(r) if r.status() == StatusCode::OK => r,
                Some(r) => return Err(("status", r.status().to_string())),
                None => return Err(("connect", "no whole blob".into())),
            }
        } else {
            response
        };
        let bytes = read_capped(response, fetch.total, self.config.idle_timeout).await?;
        if bytes.len() as u64 != fetch.total {
            return Err(("body", "body ended early".into()));
        }
        if !fetch.digest.matches(&bytes) {
            tracing::error!(peer = %peer.id, addr = %peer.addr, digest = %fetch.digest, "peer served bytes that do not match their digest; quarantined");
            return Err(("verify", "bytes do not match the digest".into()));
        }
        Ok(bytes)
    }

    /// One request to a peer, signed when the cluster has a secret. `None` (and the peer
    /// marked as failed) when it cannot be sent or no headers come back in time.
    async fn send(
        &self,
        peer: &Peer,
        method: &str,
        path: &str,
        ns: Option<&str>,
        range: Option<&str>,
        follow: Option<Duration>,
    ) -> Option<reqwest::Response> {
        let target = path_and_query(path, ns);
        let url = format!("http://{}{target}", peer.addr);
        let mut request = match method {
            "HEAD" => self.client.head(&url),
            _ => self.client.get(&url),
        };
        request = request.header(HOP_HEADER, "1");
        // A leader answers once its download has started: its wait is part of ours.
        let first_byte = match follow {
            Some(wait) => {
                request = request.header(FOLLOW_HEADER, "1");
                wait + self.config.first_byte_timeout
            }
            None => self.config.first_byte_timeout,
        };
        let started = Instant::now();
        if let Some(secret) = &self.secret {
            request = request.header(TOKEN_HEADER, token::sign(secret, method, &target));
        }
        if let Some(range) = range {
            request = request.header(header::RANGE, range);
        }
        if path.contains("/manifests/") {
            request = request.header(header::ACCEPT, MANIFEST_ACCEPT);
        }
        match tokio::time::timeout(first_byte, request.send()).await {
            Ok(Ok(r)) => {
                if follow.is_some() {
                    self.metrics
                        .follow_wait
                        .observe(started.elapsed().as_secs_f64());
                }
                Some(r)
            }
            Ok(Err(e)) => {
                self.peer_failed(peer, "connect", &e.to_string());
                None
            }
            Err(_) => {
                self.peer_failed(peer, "first_byte", "no response headers in time");
                None
            }
        }
    }

    fn count_peer_bytes(&self, kind: &'static str, n: usize) {
        self.metrics
            .bytes_served
            .get_or_create(&SourceLabels {
                kind,
                source: "peer",
            })
            .inc_by(n as u64);
    }

    /// A manifest from the first provider whose bytes match the digest (asked for, or the
    /// one the peer names for a tag). Manifests are small: verified whole before serving.
    pub async fn manifest(&self, req: PeerRequest<'_>, reference: Reference) -> Option<Response> {
        let key = match &reference {
            Reference::Digest(d) => digest_key(d),
            // Whether a tag may be resolved here at all is the mirror's decision (tags.rs).
            Reference::Tag(tag) => tag_key(req.ns?, req.name, tag),
        };
        let providers = self.providers(&key).await;
        self.manifest_from(req, reference, providers, None).await
    }

    /// A manifest by digest from `leader`, whose containerd is downloading it now.
    pub async fn manifest_following(
        &self,
        req: PeerRequest<'_>,
        digest: Digest,
        leader: &Peer,
        wait: Duration,
    ) -> Option<Response> {
        let reference = Reference::Digest(digest);
        self.manifest_from(req, reference, vec![leader.clone()], Some(wait))
            .await
    }

    async fn manifest_from(
        &self,
        req: PeerRequest<'_>,
        reference: Reference,
        providers: Vec<Peer>,
        follow: Option<Duration>,
    ) -> Option<Response> {
        let path = format!("/v2/{}/manifests/{reference}", req.name);
        for peer in providers {
            match self
                .fetch_manifest(&peer, &path, req.ns, &reference, follow)
                .await
            {
                Ok((media_type, digest, bytes)) => {
                    let len = bytes.len();
                    let body = if req.head {
                        Body::empty()
                    } else {
                        Body::from(bytes)
                    };
                    if !req.head {
                        self.metrics
                            .bytes_served
                            .get_or_create(&SourceLabels {
                                kind: "manifest",
                                source: "peer",
                            })
                            .inc_by(len as u64);
                    }
                    return Response::builder()
                        .status(StatusCode::OK)
                        .header(header::CONTENT_TYPE, media_type)
                        .header(header::CONTENT_LENGTH, len)
                        .header(oci::DOCKER_CONTENT_DIGEST, digest.to_string())
                        .body(body)
                        .ok();
                }
                Err((stage, reason)) => self.peer_failed(&peer, stage, &reason),
            }
        }
        None
    }

    async fn fetch_manifest(
        &self,
        peer: &Peer,
        path: &str,
        ns: Option<&str>,
        reference: &Reference,
        follow: Option<Duration>,
    ) -> Result<(String, Digest, Bytes), (&'static str, String)> {
        let response = self
            .send(peer, "GET", path, ns, None, follow)
            .await
            .ok_or(("connect", "no response".to_string()))?;
        if response.status() != StatusCode::OK {
            return Err(("status", response.status().to_string()));
        }
        let named = response
            .headers()
            .get(oci::DOCKER_CONTENT_DIGEST)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<Digest>().ok());
        let declared = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = read_capped(response, MAX_MANIFEST_BYTES, self.config.idle_timeout).await?;
        let digest = match reference {
            Reference::Digest(d) => d.clone(),
            Reference::Tag(_) => named.ok_or(("verify", "no Docker-Content-Digest".to_string()))?,
        };
        if !digest.matches(&bytes) {
            return Err(("verify", format!("bytes do not match {digest}")));
        }
        let media_type = declared
            .filter(|t| is_manifest_media_type(t))
            .or_else(|| sniff_media_type(&bytes).map(str::to_string))
            .ok_or(("verify", "not a manifest".to_string()))?;
        Ok((media_type, digest, bytes))
    }

    /// Providers of `key`: cached if recent, else from the router, waiting at most
    /// `resolve_timeout` for the first one. Peers that failed recently go last.
    async fn providers(&self, key: &str) -> Vec<Peer> {
        if let Some(peers) = self.cached(key) {
            return peers;
        }
        let started = Instant::now();
        let mut stream = self.router.lookup(key).await;
        let mut found = Vec::new();
        // The latency that matters is the time to the first provider: the grace wait for
        // failover candidates below is not part of it.
        let mut took = None;
        if let Ok(Some(first)) =
            tokio::time::timeout(self.config.resolve_timeout, stream.recv()).await
        {
            took = Some(started.elapsed());
            found.push(first);
            // Others that arrive right behind the first are failover candidates.
            while let Ok(Some(more)) =
                tokio::time::timeout(MORE_PROVIDERS_GRACE, stream.recv()).await
            {
                if !found.contains(&more) {
                    found.push(more);
                }
            }
        }
        self.metrics
            .peer_lookup_duration
            .observe(took.unwrap_or_else(|| started.elapsed()).as_secs_f64());
        let result = if found.is_empty() { "none" } else { "found" };
        self.metrics
            .peer_lookups
            .get_or_create(&ResultLabels { result })
            .inc();
        if !found.is_empty() {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.retain(|_, (at, _)| at.elapsed() < LOOKUP_CACHE_TTL);
            cache.insert(key.to_string(), (Instant::now(), found.clone()));
        }
        self.order_by_health(found)
    }

    fn cached(&self, key: &str) -> Option<Vec<Peer>> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (at, peers) = cache.get(key)?;
        (at.elapsed() < LOOKUP_CACHE_TTL).then(|| self.order_by_health(peers.clone()))
    }

    fn order_by_health(&self, mut peers: Vec<Peer>) -> Vec<Peer> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let recently_failed = |p: &Peer| {
            failed
                .get(&p.id)
                .is_some_and(|at| at.elapsed() < FAILED_PEER_BACKOFF)
        };
        peers.sort_by_key(recently_failed);
        peers
    }

    fn peer_failed(&self, peer: &Peer, stage: &'static str, reason: &str) {
        record_failure(&self.metrics, &self.failed, peer, stage, reason);
    }

    /// What the resuming body needs to ask the next provider for the rest.
    fn resumer(&self, path: String, ns: Option<String>) -> Resumer {
        Resumer {
            client: self.client.clone(),
            target: path_and_query(&path, ns.as_deref()),
            secret: self.secret.clone(),
            timeouts: (self.config.first_byte_timeout, self.config.idle_timeout),
            metrics: self.metrics.clone(),
            failed: self.failed.clone(),
            store: self.store.clone(),
        }
    }
}

/// Asks a provider for the rest of a blob (`Range: bytes=<offset>-<end>`).
#[derive(Clone)]
pub(super) struct Resumer {
    client: reqwest::Client,
    target: String,
    secret: Option<ClusterSecret>,
    /// First byte, idle.
    timeouts: (Duration, Duration),
    metrics: Arc<Metrics>,
    failed: Skips,
    store: Arc<dyn ContentStore>,
}

/// containerd retries a broken transfer itself (with a Range, on the same or the next host)
/// and may reopen its partial download after we drop it: drop it again a little later.
const DISCARD_PARTIAL_AFTER: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(3),
];

impl Resumer {
    /// Bytes that did not match were streamed to this node's containerd: drop its partial
    /// download of `digest`, so the next attempt starts from zero instead of on top of them.
    pub(super) fn discard_partial(&self, digest: &Digest) {
        let store = self.store.clone();
        let digest = digest.clone();
        let detected = std::time::SystemTime::now();
        tokio::spawn(async move {
            for delay in DISCARD_PARTIAL_AFTER {
                tokio::time::sleep(delay).await;
                match store.discard_partial(&digest, detected).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::warn!(%digest, partial_downloads = n, "dropped containerd's partial download of a corrupt blob")
                    }
                    Err(e) => {
                        tracing::warn!(%digest, error = %e, "cannot drop containerd's partial download")
                    }
                }
            }
        });
    }

    pub(super) fn quarantined(&self, peer: &Peer) -> bool {
        quarantined(&self.failed, peer)
    }

    pub(super) async fn request(
        &self,
        peer: &Peer,
        start: u64,
        end: u64,
    ) -> Option<reqwest::Response> {
        let mut request = self
            .client
            .get(format!("http://{}{}", peer.addr, self.target))
            .header(HOP_HEADER, "1")
            .header(header::RANGE, format!("bytes={start}-{end}"));
        if let Some(secret) = &self.secret {
            request = request.header(TOKEN_HEADER, token::sign(secret, "GET", &self.target));
        }
        match tokio::time::timeout(self.timeouts.0, request.send()).await {
            Ok(Ok(r)) if r.status() == StatusCode::PARTIAL_CONTENT => Some(r),
            Ok(Ok(r)) => {
                self.failed(peer, "status", r.status().as_str());
                None
            }
            Ok(Err(e)) => {
                self.failed(peer, "connect", &e.to_string());
                None
            }
            Err(_) => {
                self.failed(peer, "first_byte", "no response headers in time");
                None
            }
        }
    }

    pub(super) fn idle_timeout(&self) -> Duration {
        self.timeouts.1
    }

    pub(super) fn failed(&self, peer: &Peer, stage: &'static str, reason: &str) {
        record_failure(&self.metrics, &self.failed, peer, stage, reason);
    }
}

/// Is `peer` quarantined (it served bytes that did not match) right now?
fn quarantined(failed: &Skips, peer: &Peer) -> bool {
    let skips = failed.lock().unwrap_or_else(|e| e.into_inner());
    skips
        .get(&peer.id)
        .is_some_and(|until| *until > Instant::now() + FAILED_PEER_BACKOFF)
}

/// Marks `peer` to be skipped: quarantined after serving wrong bytes, tried last otherwise.
fn record_failure(
    metrics: &Metrics,
    failed: &Skips,
    peer: &Peer,
    stage: &'static str,
    reason: &str,
) {
    tracing::warn!(peer = %peer.id, addr = %peer.addr, stage, reason, "peer fetch failed; trying the next provider");
    metrics
        .peer_failures
        .get_or_create(&StageLabels { stage })
        .inc();
    let skip = if stage == "verify" {
        QUARANTINE
    } else {
        FAILED_PEER_BACKOFF
    };
    let now = Instant::now();
    let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
    failed.retain(|_, until| *until > now);
    let until = failed.entry(peer.id.clone()).or_insert(now);
    *until = (*until).max(now + skip);
}

/// Reads a body of at most `limit` bytes, each chunk within `idle`.
async fn read_capped(
    response: reqwest::Response,
    limit: u64,
    idle: Duration,
) -> Result<Bytes, (&'static str, String)> {
    if response.content_length().is_some_and(|l| l > limit) {
        return Err(("body", "larger than announced".into()));
    }
    let mut bytes = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = tokio::time::timeout(idle, stream.next())
        .await
        .map_err(|_| ("body", "stalled".to_string()))?
    {
        let chunk = chunk.map_err(|e| ("body", e.to_string()))?;
        if (bytes.len() + chunk.len()) as u64 > limit {
            return Err(("body", "larger than announced".into()));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(bytes))
}

/// `<path>?ns=<registry>` as sent, and as signed.
fn path_and_query(path: &str, ns: Option<&str>) -> String {
    match ns {
        Some(ns) => {
            let encoded: String = form_urlencoded::byte_serialize(ns.as_bytes()).collect();
            format!("{path}?{}={encoded}", oci::NS_PARAM)
        }
        None => path.to_string(),
    }
}

/// The peer's status and the headers that describe the content, with our body.
fn forward_headers(response: &reqwest::Response, body: Body) -> Response {
    let mut out = Response::builder().status(response.status());
    for name in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::CONTENT_RANGE,
        header::ACCEPT_RANGES,
        header::ETAG,
    ] {
        if let Some(v) = response.headers().get(&name) {
            out = out.header(name, v.clone());
        }
    }
    if let Some(v) = response.headers().get(oci::DOCKER_CONTENT_DIGEST) {
        out = out.header(oci::DOCKER_CONTENT_DIGEST, v.clone());
    }
    out.body(body).unwrap_or_default()
}

impl Fetch {
    /// The response headers for this transfer, whichever peers end up serving it.
    pub(super) fn response(&self, body: Body) -> Response {
        let mut out = Response::builder()
            .status(if self.partial {
                StatusCode::PARTIAL_CONTENT
            } else {
                StatusCode::OK
            })
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, self.len)
            .header(header::ACCEPT_RANGES, "bytes")
            .header(oci::DOCKER_CONTENT_DIGEST, self.digest.to_string());
        if self.partial
            && let Ok(v) = HeaderValue::from_str(&format!(
                "bytes {}-{}/{}",
                self.start,
                self.start + self.len - 1,
                self.total
            ))
        {
            out = out.header(header::CONTENT_RANGE, v);
        }
        out.body(body).unwrap_or_default()
    }
}

/// What the coordinator answers a claim with (JSON on the peer address).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimAnswer {
    pub lead: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub leader: Option<ClaimPeer>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimPeer {
    pub id: String,
    pub addr: std::net::SocketAddr,
}

impl ClaimAnswer {
    pub fn from_grant(grant: &Grant) -> ClaimAnswer {
        match grant {
            Grant::Lead => ClaimAnswer {
                lead: true,
                leader: None,
            },
            Grant::Follow(p) => ClaimAnswer {
                lead: false,
                leader: Some(ClaimPeer {
                    id: p.id.clone(),
                    addr: p.addr,
                }),
            },
        }
    }
}

/// `<CLAIM_PATH><digest>?peer=<id>&addr=<addr>[&failed=<id>]`, as sent and as signed.
pub fn claim_target(digest: &Digest, claimant: &Peer, failed: Option<&str>) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("peer", &claimant.id);
    query.append_pair("addr", &claimant.addr.to_string());
    if let Some(f) = failed {
        query.append_pair("failed", f);
    }
    format!("{CLAIM_PATH}{digest}?{}", query.finish())
}

#[async_trait::async_trait]
impl ClaimSender for PeerFetcher {
    async fn claim(
        &self,
        coordinator: &Peer,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
    ) -> Option<Grant> {
        let target = claim_target(digest, claimant, failed);
        let mut request = self
            .client
            .post(format!("http://{}{target}", coordinator.addr))
            .header(HOP_HEADER, "1");
        if let Some(secret) = &self.secret {
            request = request.header(TOKEN_HEADER, token::sign(secret, "POST", &target));
        }
        let response = match request.send().await {
            Ok(r) if r.status() == StatusCode::OK => r,
            Ok(r) => {
                tracing::debug!(coordinator = %coordinator.id, status = %r.status(), "claim refused");
                return None;
            }
            Err(e) => {
                tracing::debug!(coordinator = %coordinator.id, error = %e, "claim not answered");
                return None;
            }
        };
        let body = read_capped(response, 4096, self.config.idle_timeout)
            .await
            .ok()?;
        let answer: ClaimAnswer = serde_json::from_slice(&body).ok()?;
        match (answer.lead, answer.leader) {
            (true, _) => Some(Grant::Lead),
            (false, Some(p)) => Some(Grant::Follow(Peer {
                id: p.id,
                addr: p.addr,
            })),
            (false, None) => None,
        }
    }
}
