//! Fetching from other nodes, in one room: find providers in the DHT (bounded by
//! `--resolve-timeout`, or longer where this node's lookups are slower (`bound`), one lookup
//! per key however many ask at once), then ask their peer
//! addresses, one after the other, until one answers; or follow a coalescing leader's download.
//! Blobs stream through and resume on the next provider if a peer fails mid-transfer.
//!
//! Dependencies run one way: `mod` (orchestration) → `body` (the verifying, resuming blob
//! body) → `client` (every request to a peer) and `health` (who to pass over), all reporting
//! a typed `PeerFailure`.

mod body;
pub(crate) mod bound;
pub(crate) mod client;
pub(crate) mod diagnostic_pull;
pub(crate) mod failure;
mod health;
pub(crate) mod response;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::FutureExt;

use crate::coalesce::ClaimSender;
use crate::coalesce::leases::Grant;
use crate::metrics::{Metrics, ResultLabels};
use crate::oci::manifest::{MAX_MANIFEST_BYTES, is_manifest_media_type, sniff_media_type};
use crate::oci::{self, Digest, Reference};
use crate::routing::{ContentRouting, Peer, digest_key, tag_key};
use crate::store::ContentStore;
use crate::trust::ClusterSecret;
use body::{Fetch, Resume, ResumingBody};
pub use bound::ResolveBound;
pub use client::{ClaimAnswer, PeerCall, PeerClient};
pub use failure::{PeerFailure, PeerMiss};
use health::PeerHealth;
use response::PeerResponse;
use response::{built, forward_headers};

/// The lookup times the wait for a lookup comes from (`bound.rs`), in the data directory: a
/// restarted node waits as it had learnt to.
pub const LOOKUP_TIMES_FILE: &str = "lookup-times";
/// How often they are kept while running (and once more at shutdown).
const KEEP_LEARNT_EVERY: Duration = Duration::from_secs(600);

/// Providers found are reused this long: a pull asks for a handful of blobs in a burst.
const LOOKUP_CACHE_TTL: Duration = Duration::from_secs(5);
/// A lookup that found nobody is remembered this long: the requests of one pull for a
/// digest no node has (a HEAD, then the GET, then containerd's retries) cost one DHT walk, not
/// one each. Short, because a digest another node has just committed is findable as soon as
/// it is announced: for at most this long after, it still goes to the coalescing leader or
/// upstream (a slower pull, never a failed one).
pub const NOT_FOUND_TTL: Duration = Duration::from_secs(1);
/// Providers arriving this soon after the first are kept as failover candidates.
const MORE_PROVIDERS_GRACE: Duration = Duration::from_millis(2);
/// A walk the pull stopped waiting for is read on this long at most, to learn when its first
/// provider came (`bound`). A walk ends by itself sooner (libp2p's query timeout, 10 s); this
/// bounds a router that never closes its stream.
const READ_ON_LIMIT: Duration = Duration::from_secs(15);
/// `--resolve-timeout-max`'s default: where this node's lookups of present keys are slow, a
/// pull waits up to this long for one, so a miss costs up to this much (once per digest).
pub const DEFAULT_RESOLVE_TIMEOUT_MAX: Duration = Duration::from_millis(100);

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
    /// How long a lookup may take before the miss goes upstream, where lookups are fast.
    pub resolve_timeout: Duration,
    /// How long at most, where this node's lookups of present keys are slower (`bound`).
    pub resolve_timeout_max: Duration,
    /// Bound on the TCP connect to a peer.
    pub connect_timeout: Duration,
    /// Bound from sending a request to a peer's response headers.
    pub first_byte_timeout: Duration,
    /// Longest silence in a peer's body before moving to the next provider.
    pub idle_timeout: Duration,
    /// Blobs up to this size are fetched whole and verified before the first byte is served.
    pub verify_before_serving: u64,
    /// Offer other nodes the zero-copy upgrade for blobs, and accept it when they offer it
    /// (`registry::zero_copy`).
    pub zero_copy: bool,
}

impl PeerFetchConfig {
    /// The documented defaults (see `config/ferry.toml`), for tests and embedding.
    pub fn with_resolve_timeout(resolve_timeout: Duration) -> Self {
        PeerFetchConfig {
            resolve_timeout,
            resolve_timeout_max: DEFAULT_RESOLVE_TIMEOUT_MAX,
            connect_timeout: Duration::from_millis(500),
            first_byte_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(5),
            verify_before_serving: MAX_MANIFEST_BYTES,
            zero_copy: true,
        }
    }
}

type SharedLookup = futures::future::Shared<futures::future::BoxFuture<'static, Vec<Peer>>>;

pub struct PeerFetcher {
    router: Arc<dyn ContentRouting>,
    client: PeerClient,
    config: PeerFetchConfig,
    metrics: Arc<Metrics>,
    /// This node's store, to drop what a lying peer left in containerd's partial downloads.
    store: Arc<dyn ContentStore>,
    /// One owner each: recent lookups, lookups under way (shared by concurrent requests for
    /// the same key), and the peers to pass over.
    cache: Mutex<HashMap<String, (Instant, Vec<Peer>)>>,
    lookups: Mutex<HashMap<String, SharedLookup>>,
    health: Arc<PeerHealth>,
    /// How long a lookup is waited for, learnt from the lookups before it.
    bound: Arc<ResolveBound>,
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
        router: Arc<dyn ContentRouting>,
        config: PeerFetchConfig,
        secret: Option<ClusterSecret>,
        metrics: Arc<Metrics>,
        store: Arc<dyn ContentStore>,
    ) -> Result<Self, reqwest::Error> {
        let client = PeerClient::new(
            config.connect_timeout,
            config.first_byte_timeout,
            config.idle_timeout,
            secret,
        )?
        .offering_zero_copy(config.zero_copy)
        .sent_by(router.local().id);
        let bound = Arc::new(
            ResolveBound::new(config.resolve_timeout, config.resolve_timeout_max)
                .shown_in(metrics.peer_resolve_wait.clone()),
        );
        Ok(PeerFetcher {
            bound,
            router,
            client,
            config,
            health: Arc::new(PeerHealth::new(metrics.clone())),
            metrics,
            store,
            cache: Mutex::new(HashMap::new()),
            lookups: Mutex::new(HashMap::new()),
        })
    }

    /// A blob (or one range of it) from the first provider that answers. Blobs up to
    /// `verify_before_serving` are fetched whole and checked before the first byte is sent;
    /// larger ones stream through, hashed on the way.
    pub async fn blob(&self, req: PeerRequest<'_>, digest: Digest) -> Result<Response, PeerMiss> {
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
    ) -> Result<Response, PeerMiss> {
        self.blob_from(req, digest, vec![leader.clone()], Some(wait))
            .await
    }

    async fn blob_from(
        &self,
        req: PeerRequest<'_>,
        digest: Digest,
        providers: Vec<Peer>,
        follow: Option<Duration>,
    ) -> Result<Response, PeerMiss> {
        let path = format!("/v2/{}/blobs/{digest}", req.name);
        let method = if req.head { Method::HEAD } else { Method::GET };
        let (advertised, mut last) = (providers.len(), None);
        let mut failed = |peer: &Peer, failure: PeerFailure| {
            self.health.failed(peer, &failure);
            last = Some(failure);
        };
        let mut candidates = providers.into_iter();
        while let Some(peer) = candidates.next() {
            // The list may predate a verification failure seen by another request.
            if self.health.quarantined(&peer) {
                continue;
            }
            let call = PeerCall {
                method: &method,
                path: &path,
                ns: req.ns,
                range: req.range,
                follow,
            };
            let response = match self.client.send(&peer, call, &self.metrics).await {
                Ok(r) => r,
                Err(failure) => {
                    failed(&peer, failure);
                    continue;
                }
            };
            let status = response.status();
            if status == StatusCode::RANGE_NOT_SATISFIABLE {
                // The peer has the blob; the range is wrong for everyone.
                return built(forward_headers(&response, Body::empty()));
            }
            if status != StatusCode::OK && status != StatusCode::PARTIAL_CONTENT {
                if status != StatusCode::NOT_FOUND {
                    failed(&peer, PeerFailure::Status(status));
                }
                continue;
            }
            if req.head {
                return built(forward_headers(&response, Body::empty()));
            }
            let Some(fetch) = Fetch::from_response(&response, digest.clone()) else {
                failed(&peer, PeerFailure::Extent);
                continue;
            };
            if fetch.total <= self.config.verify_before_serving {
                match self
                    .verified_whole(&peer, response, &fetch, &path, req.ns, follow)
                    .await
                {
                    Ok(whole) => {
                        let start = fetch.start as usize;
                        let part = whole.slice(start..start + fetch.len as usize);
                        return built(fetch.response(Body::from(part)));
                    }
                    Err(failure) => {
                        failed(&peer, failure);
                        continue;
                    }
                }
            }
            let first = response.bytes_stream();
            let remaining: Vec<Peer> = candidates.collect();
            let resume = Resume {
                client: self.client.clone(),
                health: self.health.clone(),
                metrics: self.metrics.clone(),
                store: self.store.clone(),
                path: path.clone(),
                ns: req.ns.map(str::to_string),
            };
            let body = ResumingBody::new(fetch.clone(), peer.clone(), first, remaining, resume);
            return built(fetch.response(Body::from_stream(body.into_stream())));
        }
        Err(PeerMiss::after(advertised, last))
    }

    /// The whole blob from `peer`, checked against its digest. `response` is used when it
    /// already carries the whole blob; for a range, the whole blob is asked for again.
    async fn verified_whole(
        &self,
        peer: &Peer,
        response: PeerResponse,
        fetch: &Fetch,
        path: &str,
        ns: Option<&str>,
        follow: Option<Duration>,
    ) -> Result<Bytes, PeerFailure> {
        let response = if fetch.partial {
            drop(response);
            let call = PeerCall {
                method: &Method::GET,
                path,
                ns,
                range: None,
                follow,
            };
            let r = self.client.send(peer, call, &self.metrics).await?;
            if r.status() != StatusCode::OK {
                return Err(PeerFailure::Status(r.status()));
            }
            r
        } else {
            response
        };
        let bytes = client::read_capped(response, fetch.total, self.config.idle_timeout).await?;
        if bytes.len() as u64 != fetch.total {
            return Err(PeerFailure::Body("ended early".into()));
        }
        if !fetch.digest.matches(&bytes) {
            tracing::error!(peer = %peer.id, addr = %peer.addr, digest = %fetch.digest, "peer served bytes that do not match their digest; quarantined");
            return Err(PeerFailure::Verify(fetch.digest.to_string()));
        }
        Ok(bytes)
    }

    /// A manifest from the first provider whose bytes match the digest (asked for, or the
    /// one the peer names for a tag). Manifests are small: verified whole before serving.
    pub async fn manifest(
        &self,
        req: PeerRequest<'_>,
        reference: Reference,
    ) -> Result<Response, PeerMiss> {
        let key = match &reference {
            Reference::Digest(d) => digest_key(d),
            // Whether a tag may be resolved here at all is the mirror's decision (tags.rs).
            Reference::Tag(tag) => tag_key(req.ns.ok_or(PeerMiss::NoRegistry)?, req.name, tag),
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
    ) -> Result<Response, PeerMiss> {
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
    ) -> Result<Response, PeerMiss> {
        let path = format!("/v2/{}/manifests/{reference}", req.name);
        let (advertised, mut last) = (providers.len(), None);
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
                    return Response::builder()
                        .status(StatusCode::OK)
                        .header(header::CONTENT_TYPE, media_type)
                        .header(header::CONTENT_LENGTH, len)
                        .header(oci::DOCKER_CONTENT_DIGEST, digest.to_string())
                        .body(body)
                        .map_err(|_| PeerMiss::Unbuildable);
                }
                Err(failure) => {
                    self.health.failed(&peer, &failure);
                    last = Some(failure);
                }
            }
        }
        Err(PeerMiss::after(advertised, last))
    }

    async fn fetch_manifest(
        &self,
        peer: &Peer,
        path: &str,
        ns: Option<&str>,
        reference: &Reference,
        follow: Option<Duration>,
    ) -> Result<(String, Digest, Bytes), PeerFailure> {
        let call = PeerCall {
            method: &Method::GET,
            path,
            ns,
            range: None,
            follow,
        };
        let response = self.client.send(peer, call, &self.metrics).await?;
        if response.status() != StatusCode::OK {
            return Err(PeerFailure::Status(response.status()));
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
        let bytes =
            client::read_capped(response, MAX_MANIFEST_BYTES, self.config.idle_timeout).await?;
        let digest = match reference {
            Reference::Digest(d) => d.clone(),
            Reference::Tag(_) => {
                named.ok_or(PeerFailure::Verify("no Docker-Content-Digest".into()))?
            }
        };
        if !digest.matches(&bytes) {
            return Err(PeerFailure::Verify(digest.to_string()));
        }
        let media_type = declared
            .filter(|t| is_manifest_media_type(t))
            .or_else(|| sniff_media_type(&bytes).map(str::to_string))
            .ok_or(PeerFailure::Verify("not a manifest".into()))?;
        Ok((media_type, digest, bytes))
    }

    /// Providers of `key`: cached if recent (nobody: for [`NOT_FOUND_TTL`]), else from the
    /// router, waiting for the first one at most as long as `bound` says. Concurrent requests
    /// for the same key (several clients of this node's containerd, a Range re-request) share
    /// one lookup. Peers that failed recently go last.
    async fn providers(&self, key: &str) -> Vec<Peer> {
        if let Some(peers) = self.cached(key) {
            return peers;
        }
        let lookup = {
            let mut lookups = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
            lookups
                .entry(key.to_string())
                .or_insert_with(|| {
                    lookup(
                        self.router.clone(),
                        self.metrics.clone(),
                        key.to_string(),
                        self.bound.clone(),
                    )
                    .boxed()
                    .shared()
                })
                .clone()
        };
        let found = lookup.clone().await;
        {
            let mut lookups = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
            if lookups.get(key).is_some_and(|l| l.ptr_eq(&lookup)) {
                lookups.remove(key);
            }
        }
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.retain(|_, (at, peers)| at.elapsed() < cache_ttl(peers));
            cache.insert(key.to_string(), (Instant::now(), found.clone()));
        }
        self.health.order(found)
    }

    /// Starts the wait from the lookup times kept at `path` by an earlier run
    /// ([`PeerFetcher::keep_learnt`]).
    pub fn remembering(self, path: &std::path::Path) -> Self {
        self.bound.remember(bound::load(path));
        self
    }

    /// Keeps the lookup times every [`KEEP_LEARNT_EVERY`] and once more when `token` is
    /// cancelled: a node that loses power loses at most that much of what it learnt.
    pub async fn keep_learnt_until(
        self: Arc<Self>,
        path: std::path::PathBuf,
        token: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = token.cancelled() => break,
                () = tokio::time::sleep(KEEP_LEARNT_EVERY) => self.keep_learnt(&path),
            }
        }
        self.keep_learnt(&path);
    }

    /// Keeps the lookup times the wait comes from at `path`, for the next run.
    pub fn keep_learnt(&self, path: &std::path::Path) {
        let times = self.bound.times();
        if times.is_empty() {
            return;
        }
        if let Err(e) = bound::save(path, &times) {
            tracing::warn!(path = %path.display(), error = %e, "cannot keep the lookup times for the next run");
        }
    }

    /// The peers passed over now (see `PeerHealth::passed_over`), for `ferry status`.
    pub fn passed_over(&self) -> Vec<(String, Duration, bool)> {
        self.health.passed_over()
    }

    fn cached(&self, key: &str) -> Option<Vec<Peer>> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (at, peers) = cache.get(key)?;
        (at.elapsed() < cache_ttl(peers)).then(|| self.health.order(peers.clone()))
    }
}

/// How long a lookup's answer is reused: found providers longer than "nobody".
fn cache_ttl(peers: &[Peer]) -> Duration {
    if peers.is_empty() {
        NOT_FOUND_TTL
    } else {
        LOOKUP_CACHE_TTL
    }
}

/// One provider lookup, shareable by concurrent requests for the same key.
async fn lookup(
    router: Arc<dyn ContentRouting>,
    metrics: Arc<Metrics>,
    key: String,
    bound: Arc<ResolveBound>,
) -> Vec<Peer> {
    let started = Instant::now();
    let mut stream = router.lookup(&key).await;
    let mut found = Vec::new();
    // The latency that matters is the time to the first provider: the grace wait for
    // failover candidates below is not part of it.
    let mut took = None;
    let first = tokio::time::timeout(bound.current(), stream.recv()).await;
    // A walk still going at the bound is told apart from one that ended with nobody: a pull
    // sent upstream that a longer wait might have served from a peer.
    let result = match &first {
        Ok(Some(_)) => "found",
        Ok(None) => "none",
        Err(_) => "timed_out",
    };
    match first {
        Ok(Some(first)) => {
            let elapsed = started.elapsed();
            took = Some(elapsed);
            bound.found_after(elapsed);
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
        // The walk goes on anyway (until it ends or finds someone): read on, so the bound
        // learns what it cut.
        Err(_) => {
            tokio::spawn(read_on(stream, started, bound, metrics.clone()));
        }
        Ok(None) => {}
    }
    metrics
        .peer_lookup_duration
        .observe(took.unwrap_or_else(|| started.elapsed()).as_secs_f64());
    metrics
        .peer_lookups
        .get_or_create(&ResultLabels { result })
        .inc();
    found
}

/// A walk the pull stopped waiting for: when (if) it finds a provider, that is a lookup the
/// bound cut. Dropping the stream then ends the walk at its next step (`event_loop` ends a
/// walk nobody reads when it next reports, as for a lookup waited for, whose stream is dropped
/// 2 ms after its first provider).
async fn read_on(
    mut stream: crate::routing::PeerStream,
    started: Instant,
    bound: Arc<ResolveBound>,
    metrics: Arc<Metrics>,
) {
    if let Ok(Some(_)) = tokio::time::timeout(READ_ON_LIMIT, stream.recv()).await {
        metrics.peer_lookups_found_late.inc();
        bound.found_after(started.elapsed());
    }
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
        self.client
            .claim(coordinator, digest, claimant, failed)
            .await
    }
}

#[cfg(test)]
mod tests;
