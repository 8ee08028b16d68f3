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
pub mod bound;
pub mod client;
pub mod diagnostic_pull;
pub mod failure;
mod health;
pub mod response;

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
pub use failure::PeerFailure;
use health::PeerHealth;
use response::PeerResponse;

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
        .offering_zero_copy(config.zero_copy);
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
        let method = if req.head { Method::HEAD } else { Method::GET };
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
                    self.health.failed(&peer, &failure);
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
                    self.health.failed(&peer, &PeerFailure::Status(status));
                }
                continue;
            }
            if req.head {
                return built(forward_headers(&response, Body::empty()));
            }
            let Some(fetch) = Fetch::from_response(&response, digest.clone()) else {
                self.health.failed(&peer, &PeerFailure::Extent);
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
                        self.health.failed(&peer, &failure);
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
        None
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
                    return Response::builder()
                        .status(StatusCode::OK)
                        .header(header::CONTENT_TYPE, media_type)
                        .header(header::CONTENT_LENGTH, len)
                        .header(oci::DOCKER_CONTENT_DIGEST, digest.to_string())
                        .body(body)
                        .ok();
                }
                Err(failure) => self.health.failed(&peer, &failure),
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

/// A peer's answer, or none when it could not be built (a header value that is not valid
/// HTTP): the pull goes on as if the peer had not answered, never with an empty success.
fn built(answer: Result<Response, axum::http::Error>) -> Option<Response> {
    answer
        .inspect_err(|e| tracing::warn!(error = %e, "a peer's answer could not be passed on"))
        .ok()
}

/// The peer's status and the headers that describe the content, with our body.
fn forward_headers(response: &PeerResponse, body: Body) -> Result<Response, axum::http::Error> {
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
    out.body(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{PeerStream, RoutingError};
    use crate::store::memory::MemoryStore;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A router whose lookups take a while and are counted; with `provider`, each finds it
    /// after that long, else each ends after 50 ms with nobody.
    #[derive(Default)]
    struct SlowRouter {
        lookups: AtomicUsize,
        provider: Option<Duration>,
    }

    #[async_trait::async_trait]
    impl ContentRouting for SlowRouter {
        fn ready(&self) -> bool {
            true
        }
        fn local(&self) -> Peer {
            Peer {
                id: "me".into(),
                addr: "127.0.0.1:1".parse().unwrap_or_else(|_| unreachable!()),
            }
        }
        fn members(&self) -> Arc<Vec<Peer>> {
            Arc::new(Vec::new())
        }
        async fn lookup(&self, _key: &str) -> PeerStream {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let provider = self.provider;
            let me = self.local();
            tokio::spawn(async move {
                match provider {
                    Some(after) => {
                        tokio::time::sleep(after).await;
                        let _ = tx.send(me).await;
                    }
                    None => tokio::time::sleep(Duration::from_millis(50)).await,
                }
                drop(tx);
            });
            rx
        }
        async fn advertise(&self, _keys: Vec<String>) -> Result<(), RoutingError> {
            Ok(())
        }
        async fn withdraw(&self, _keys: Vec<String>) -> Result<(), RoutingError> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn concurrent_misses_of_one_digest_share_one_lookup() {
        let router = Arc::new(SlowRouter::default());
        let fetcher = PeerFetcher::new(
            router.clone(),
            PeerFetchConfig::with_resolve_timeout(Duration::from_secs(1)),
            None,
            Arc::new(Metrics::new()),
            Arc::new(MemoryStore::new()),
        )
        .expect("client");
        let digest = Digest::sha256_of(b"a layer nobody has");
        let req = PeerRequest {
            name: "team/app",
            ns: Some("registry.test"),
            head: false,
            range: None,
        };
        let (a, b, c) = tokio::join!(
            fetcher.blob(req, digest.clone()),
            fetcher.blob(req, digest.clone()),
            fetcher.blob(req, Digest::sha256_of(b"another layer")),
        );
        assert!(a.is_none() && b.is_none() && c.is_none());
        assert_eq!(
            router.lookups.load(Ordering::SeqCst),
            2,
            "one lookup per digest, however many ask at once"
        );
        // A miss is remembered for NOT_FOUND_TTL: the GET after a HEAD, or a retry, asks
        // nobody; after that, the DHT is asked again (the digest may have been announced).
        fetcher.blob(req, digest.clone()).await;
        assert_eq!(router.lookups.load(Ordering::SeqCst), 2);
        tokio::time::sleep(NOT_FOUND_TTL).await;
        fetcher.blob(req, digest).await;
        assert_eq!(router.lookups.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_lookup_still_walking_at_the_resolve_timeout_is_counted_apart_from_a_miss() {
        // The router's walk ends after 50 ms with nobody: within a 1 s bound that is a miss,
        // past a 10 ms bound the pull went upstream while the walk was still going.
        for (bound, counted) in [
            (Duration::from_secs(1), "none"),
            (Duration::from_millis(10), "timed_out"),
        ] {
            let metrics = Arc::new(Metrics::new());
            let fetcher = PeerFetcher::new(
                Arc::new(SlowRouter::default()),
                PeerFetchConfig::with_resolve_timeout(bound),
                None,
                metrics.clone(),
                Arc::new(MemoryStore::new()),
            )
            .expect("client");
            let req = PeerRequest {
                name: "team/app",
                ns: Some("registry.test"),
                head: false,
                range: None,
            };
            let digest = Digest::sha256_of(b"a layer nobody has");
            assert!(fetcher.blob(req, digest).await.is_none());
            for result in ["found", "none", "timed_out"] {
                let n = metrics
                    .peer_lookups
                    .get_or_create(&ResultLabels { result })
                    .get();
                assert_eq!(n, u64::from(result == counted), "{result}, bound {bound:?}");
            }
        }
    }

    #[tokio::test]
    async fn a_node_whose_lookups_are_slower_than_the_bound_learns_to_wait_for_them() {
        // Every lookup finds its provider after 200 ms, past the 20 ms floor: the first ones
        // are cut (the pull goes upstream) and read on; once enough of them have come in late,
        // the wait covers them (200 ms and half again, under the 1 s ceiling: 100 ms to spare
        // on a loaded machine).
        let after = Duration::from_millis(200);
        let router = Arc::new(SlowRouter {
            provider: Some(after),
            ..SlowRouter::default()
        });
        let metrics = Arc::new(Metrics::new());
        let config = PeerFetchConfig {
            resolve_timeout_max: Duration::from_secs(1),
            ..PeerFetchConfig::with_resolve_timeout(Duration::from_millis(20))
        };
        let fetcher = PeerFetcher::new(
            router,
            config,
            None,
            metrics.clone(),
            Arc::new(MemoryStore::new()),
        )
        .expect("client");
        let count = |result: &'static str| {
            metrics
                .peer_lookups
                .get_or_create(&ResultLabels { result })
                .get()
        };
        assert_eq!(metrics.peer_resolve_wait.get(), 0.02);
        let mut cut = 0;
        for i in 0..40u32 {
            let key = format!("sha256:{i:064x}");
            let found = fetcher.providers(&key).await;
            if count("found") > 0 {
                assert_eq!(found.len(), 1, "a lookup waited for finds its provider");
                break;
            }
            assert!(found.is_empty());
            cut += 1;
            // Its walk goes on and finds the provider; the wait learns of it.
            let late = metrics.peer_lookups_found_late.get();
            tokio::time::timeout(Duration::from_secs(5), async {
                while metrics.peer_lookups_found_late.get() == late {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("the walk cut short is read on to its provider");
        }
        assert_eq!(cut, 10, "the floor stands until 10 lookups say otherwise");
        assert_eq!(count("timed_out"), 10);
        let wait = metrics.peer_resolve_wait.get();
        assert!((0.3..1.0).contains(&wait), "waits {wait} s now");
        // Lookups that are fast again do not keep it up forever: a window of them brings
        // the floor back (`bound`'s own tests).
    }
}
