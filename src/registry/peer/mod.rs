//! Fetching from other nodes: find providers in the DHT (one lookup per key, waited for as
//! long as `bound` says), ask their peer addresses in turn or follow a coalescing leader's
//! download; a blob cut mid-transfer resumes on the next provider.
//!
//! Invariant: dependencies run one way, `mod` → `body` → `client` and `health`, all reporting
//! a typed `PeerFailure`.

mod body;
pub(crate) mod bound;
pub(crate) mod client;
pub(crate) mod diagnostic_pull;
pub(crate) mod failure;
mod floor;
mod health;
pub(crate) mod response;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::coalesce::ClaimSender;
use crate::coalesce::leases::Grant;
use crate::metrics::{Metrics, ResultLabels};
use crate::oci::manifest::{MAX_MANIFEST_BYTES, is_manifest_media_type, sniff_media_type};
use crate::oci::{self, Digest, Reference};
use crate::routing::{ContentRouting, Peer, digest_key, tag_key};
use crate::store::ContentStore;
use crate::store::downloads::{InFlight, Scope};
use crate::trust::ClusterSecret;
use body::{Fetch, Resume, ResumingBody};
pub use bound::ResolveBound;
pub use client::{ClaimAnswer, PeerCall, PeerClient};
pub use failure::{PeerFailure, PeerMiss};
use health::PeerHealth;
use response::PeerResponse;
use response::built;

/// The data directory's file of lookup times (`bound.rs`), kept across restarts.
pub const LOOKUP_TIMES_FILE: &str = "lookup-times";
/// How often they are saved (and once more at shutdown).
const KEEP_LEARNT_EVERY: Duration = Duration::from_secs(600);

/// Providers found are reused this long: a pull asks for a handful of blobs in a burst.
const LOOKUP_CACHE_TTL: Duration = Duration::from_secs(5);
/// A lookup that found nobody is remembered this long, so one pull's requests for a digest
/// nobody has (HEAD, GET, retries) cost one DHT walk. Short: a digest just announced goes
/// to the leader or upstream for at most this long (slower, never failed).
pub const NOT_FOUND_TTL: Duration = Duration::from_secs(1);
/// Providers arriving this soon after the first are kept as failover candidates.
const MORE_PROVIDERS_GRACE: Duration = Duration::from_millis(2);
/// How long a walk the pull stopped waiting for is read on, to teach `bound` what it cut.
const READ_ON_LIMIT: Duration = Duration::from_secs(15);
/// `--resolve-timeout-max`'s default; a miss costs up to this once per digest.
pub const DEFAULT_RESOLVE_TIMEOUT_MAX: Duration = Duration::from_millis(100);

/// The mirror's request, as forwarded to peers.
#[derive(Debug, Clone, Copy)]
pub struct PeerRequest<'a> {
    pub name: &'a str,
    pub ns: Option<&'a str>,
    pub head: bool,
    pub range: Option<&'a str>,
}

#[derive(Debug, Clone, Copy)]
pub struct PeerFetchConfig {
    /// The lookup wait where lookups are fast (the floor).
    pub resolve_timeout: Duration,
    /// The ceiling, where this node's lookups are slower (`bound`).
    pub resolve_timeout_max: Duration,
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    /// Longest silence in a peer's body before the next provider.
    pub idle_timeout: Duration,
    /// Blobs up to this size are verified whole before the first byte is served.
    pub verify_before_serving: u64,
    /// Bytes held at once by blobs verified whole: past it a whole blob is streamed (hashed on
    /// the way) and a range goes to the registry, so slow readers cannot pin memory.
    pub buffer_budget: u64,
    /// Offer and accept the zero-copy upgrade (`registry::zero_copy`).
    pub zero_copy: bool,
    /// DHT walks under way at once; a miss past it goes to the registry at once, so a flood
    /// of random digests cannot start a walk each.
    pub max_lookups: usize,
}

impl PeerFetchConfig {
    /// The documented defaults (`config/ferry.toml`).
    pub fn with_resolve_timeout(resolve_timeout: Duration) -> Self {
        PeerFetchConfig {
            resolve_timeout,
            resolve_timeout_max: DEFAULT_RESOLVE_TIMEOUT_MAX,
            connect_timeout: Duration::from_millis(500),
            first_byte_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(5),
            verify_before_serving: MAX_MANIFEST_BYTES,
            buffer_budget: BUFFER_BUDGET,
            zero_copy: true,
            max_lookups: MAX_LOOKUPS,
        }
    }
}

type SharedLookup = futures::future::Shared<futures::future::BoxFuture<'static, Vec<Peer>>>;

pub struct PeerFetcher {
    router: Arc<dyn ContentRouting>,
    client: PeerClient,
    config: PeerFetchConfig,
    metrics: Arc<Metrics>,
    /// To drop what a lying peer left in containerd's partial downloads.
    store: Arc<dyn ContentStore>,
    /// Recent lookups, and those under way (shared by concurrent requests).
    cache: Mutex<HashMap<String, (Instant, Vec<Peer>)>>,
    lookups: Mutex<HashMap<String, SharedLookup>>,
    health: Arc<PeerHealth>,
    bound: Arc<ResolveBound>,
    /// [`PeerFetchConfig::buffer_budget`], in KiB.
    buffered: Arc<Semaphore>,
}

/// Walks under way at once: far more than the layers of the pulls a node runs together
/// (containerd fetches 3 per pull).
pub const MAX_LOOKUPS: usize = 128;

/// A quarter of the chart's memory limit.
pub const BUFFER_BUDGET: u64 = 256 << 20;

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
        let budget_kib = usize::try_from(config.buffer_budget / 1024).unwrap_or(usize::MAX);
        Ok(PeerFetcher {
            buffered: Arc::new(Semaphore::new(budget_kib.min(Semaphore::MAX_PERMITS))),
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

    /// A blob (or a range) from the first provider that answers; small ones checked first.
    pub async fn blob(&self, req: PeerRequest<'_>, digest: Digest) -> Result<Response, PeerMiss> {
        let providers = self.providers(&digest_key(&digest)).await;
        self.blob_from(req, digest, providers, None).await
    }

    /// A blob from `leader`'s download, waiting up to `wait` for it to start.
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
                // Not final on one peer's word (it may lie): the next provider, else the 404
                // that sends containerd to the registry, which answers the range for sure.
                continue;
            }
            if status != StatusCode::OK && status != StatusCode::PARTIAL_CONTENT {
                if status != StatusCode::NOT_FOUND {
                    failed(&peer, PeerFailure::Status(status));
                }
                continue;
            }
            let Some(fetch) = Fetch::from_response(&response, digest.clone()) else {
                failed(&peer, PeerFailure::Extent);
                continue;
            };
            if req.head {
                // L10: only the length is the peer's word (no bytes to check it by); the
                // digest named is the one asked for, or the peer is charged.
                let stated = response.headers().get(oci::DOCKER_CONTENT_DIGEST);
                if stated.is_some_and(|v| v.as_bytes() != digest.to_string().as_bytes()) {
                    failed(
                        &peer,
                        PeerFailure::Verify(format!("a HEAD naming another digest than {digest}")),
                    );
                    continue;
                }
                return built(fetch.response(Body::empty()));
            }
            let budget = (fetch.total <= self.config.verify_before_serving)
                .then(|| self.buffer(fetch.total));
            match budget {
                Some(Some(held)) => match self
                    .verified_whole(&peer, response, &fetch, &path, req.ns, follow)
                    .await
                {
                    Ok(whole) => {
                        let start = fetch.start as usize;
                        let part = whole.slice(start..start + fetch.len as usize);
                        return built(fetch.response(budgeted(part, held)));
                    }
                    Err(failure) => {
                        failed(&peer, failure);
                        continue;
                    }
                },
                // A range streamed from a peer could not be checked: the registry answers it.
                Some(None) if fetch.partial => return Err(PeerMiss::Busy),
                Some(None) | None => {}
            }
            let prefix = self.resumed_prefix(&fetch).await;
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
            let body = ResumingBody::new(fetch.clone(), (peer.clone(), first), remaining, resume)
                .checked_with(prefix);
            return built(fetch.response(Body::from_stream(body.into_stream())));
        }
        Err(PeerMiss::after(advertised, last))
    }

    /// containerd resuming a blob asks for its tail, its partial download holding the rest:
    /// that download, so the tail can be checked against the digest with it. A range without
    /// one (a lazy-pulling snapshotter's, which checks its own chunks) has none.
    async fn resumed_prefix(&self, fetch: &Fetch) -> Option<InFlight> {
        if !fetch.partial || fetch.start == 0 || fetch.start + fetch.len != fetch.total {
            return None;
        }
        for download in self.store.downloads(&fetch.digest, Scope::Namespace).await {
            if download.landed().await.is_some_and(|n| n >= fetch.start) {
                return Some(download);
            }
        }
        None
    }

    /// `bytes` of the buffer budget, if that many are free now.
    fn buffer(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        let kib = u32::try_from(bytes.div_ceil(1024)).ok()?;
        self.buffered.clone().try_acquire_many_owned(kib).ok()
    }

    /// The whole blob from `peer`, checked; for a range, asked for again.
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

    /// A manifest from the first provider whose bytes match the digest.
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
        // The bytes are verified, the declared type is not: a right manifest under a wrong
        // type would fail every pull that asked this peer first.
        let media_type =
            sniff_media_type(&bytes).ok_or(PeerFailure::Verify("not a manifest".into()))?;
        if let Some(declared) = declared.filter(|t| is_manifest_media_type(t))
            && declared != media_type
        {
            return Err(PeerFailure::Verify(format!(
                "declared {declared}, the bytes are {media_type}"
            )));
        }
        let media_type = media_type.to_string();
        Ok((media_type, digest, bytes))
    }

    /// Providers of `key`: cached, or one lookup shared by concurrent requests; failed last.
    async fn providers(&self, key: &str) -> Vec<Peer> {
        if let Some(peers) = self.cached(key) {
            return peers;
        }
        let lookup = {
            let mut lookups = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
            if !lookups.contains_key(key) && lookups.len() >= self.config.max_lookups {
                drop(lookups);
                self.metrics
                    .peer_lookups
                    .get_or_create(&ResultLabels { result: "refused" })
                    .inc();
                return Vec::new();
            }
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

    /// Starts the wait from the lookup times an earlier run kept at `path`.
    pub fn remembering(self, path: &std::path::Path) -> Self {
        self.bound.remember(bound::load(path));
        self
    }

    /// Saves the lookup times every [`KEEP_LEARNT_EVERY`] and at cancellation.
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

    pub fn keep_learnt(&self, path: &std::path::Path) {
        let times = self.bound.times();
        if times.is_empty() {
            return;
        }
        if let Err(e) = bound::save(path, &times) {
            tracing::warn!(path = %path.display(), error = %e, "cannot keep the lookup times for the next run");
        }
    }

    /// The peers passed over now, for `ferry status`.
    pub fn passed_over(&self) -> Vec<(String, Duration, bool)> {
        self.health.passed_over()
    }

    fn cached(&self, key: &str) -> Option<Vec<Peer>> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (at, peers) = cache.get(key)?;
        (at.elapsed() < cache_ttl(peers)).then(|| self.health.order(peers.clone()))
    }
}

fn cache_ttl(peers: &[Peer]) -> Duration {
    if peers.is_empty() {
        NOT_FOUND_TTL
    } else {
        LOOKUP_CACHE_TTL
    }
}

async fn lookup(
    router: Arc<dyn ContentRouting>,
    metrics: Arc<Metrics>,
    key: String,
    bound: Arc<ResolveBound>,
) -> Vec<Peer> {
    let started = Instant::now();
    let mut stream = router.lookup(&key).await;
    let mut found = Vec::new();
    // Time to the first provider, without the failover grace below.
    let mut took = None;
    let first = tokio::time::timeout(bound.current(), stream.recv()).await;
    // "timed_out", unlike "none", is a pull a longer wait might have served from a peer.
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
            while let Ok(Some(more)) =
                tokio::time::timeout(MORE_PROVIDERS_GRACE, stream.recv()).await
            {
                if !found.contains(&more) {
                    found.push(more);
                }
            }
        }
        // The walk goes on anyway: read on, so the bound learns what it cut.
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

/// A walk the pull stopped waiting for: a provider it finds later is a lookup the bound cut.
/// Dropping the stream ends the walk at its next step.
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

/// `bytes` as a body that gives its budget back when it ends, handed to hyper 64 KiB at a time
/// so that a slow reader's queue holds one slice, not the blob.
fn budgeted(bytes: Bytes, held: OwnedSemaphorePermit) -> Body {
    const SLICE: usize = 64 * 1024;
    let slices: Vec<Bytes> = (0..bytes.len())
        .step_by(SLICE)
        .map(|at| bytes.slice(at..(at + SLICE).min(bytes.len())))
        .collect();
    let held = Arc::new(held);
    let stream = futures::stream::iter(slices).map(move |slice| {
        let _ = &held;
        Ok::<_, std::io::Error>(slice)
    });
    Body::from_stream(stream)
}
