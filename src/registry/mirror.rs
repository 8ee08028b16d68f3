//! The mirror address: what this node's containerd may ask, and the only place Ferry asks
//! other nodes. By digest: this node's store, peers, a coalescing leader's download, else a
//! 404 at once. A tag: upstream or through peers (`tags.rs`), never this node's store.
//! Invariant: a request with the hop header is never forwarded, so requests travel one hop.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::middleware;
use axum::response::Response;

use super::in_flight::{self, Opened};
use super::local::Local;
use super::peer::{PeerFetcher, PeerRequest};
use super::recent::RecentPulls;
use super::request::{self, Counting, Listener, Mirrored, Pull};
use super::tags::{ResolveTags, TagRoute};
use super::upstream::{UpstreamWatch, Verdict};
use super::{ApiError, Source};
use crate::coalesce::transfers::Transfer;
use crate::coalesce::{Coalescer, Decision};
use crate::keep::Keeper;
use crate::metrics::{Metrics, TagLabels};
use crate::oci::registry::{Registries, RegistryFilters};
use crate::oci::{ApiPath, Digest, Reference};
use crate::store::ContentStore;
use crate::store::downloads::Landing;
use crate::wire::HOP_HEADER;

#[derive(Clone)]
pub struct MirrorState {
    pub store: Arc<dyn ContentStore>,
    pub registries: Registries,
    pub metrics: Arc<Metrics>,
    /// Asked on a local miss; `None` when peer-to-peer is off.
    pub peers: Option<Arc<PeerFetcher>>,
    pub tags: ResolveTags,
    /// For `WhenUpstreamFails` (`None`: every registry answers).
    pub upstream: Option<UpstreamWatch>,
    /// Only images shared with peers are coalesced.
    pub filters: RegistryFilters,
    pub coalesce: Option<Arc<Coalescer>>,
    /// For `ferry status`.
    pub recent: Arc<RecentPulls>,
    /// Holds what containerd asks for in Ferry's lease; `None` with `--keep-budget 0`.
    pub keep: Option<Keeper>,
}

impl std::fmt::Debug for MirrorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorState")
            .field("registries", &self.registries)
            .field("tags", &self.tags)
            .finish_non_exhaustive()
    }
}

struct Mirror {
    state: MirrorState,
    local: Local,
}

/// One handler parses the raw path itself: names contain slashes, and percent-decoding must
/// not happen before validation.
pub(crate) fn router(state: MirrorState) -> Router {
    let local = Local {
        store: state.store.clone(),
        metrics: state.metrics.clone(),
    };
    let counting = Counting {
        listener: Listener::Mirror,
        metrics: state.metrics.clone(),
    };
    Router::new()
        .fallback(handle)
        .layer(middleware::from_fn_with_state(counting, request::counted))
        .with_state(Arc::new(Mirror { state, local }))
}

impl Mirrored for Arc<Mirror> {
    fn registries(&self) -> &Registries {
        &self.state.registries
    }
}

async fn handle(State(mirror): State<Arc<Mirror>>, pull: Pull) -> Response {
    request::answered(answer(&mirror, pull).await)
}

async fn answer(mirror: &Mirror, req: Pull) -> Result<Response, ApiError> {
    match &req.path {
        ApiPath::Base => Ok(Pull::base()),
        ApiPath::Manifest {
            name,
            reference: Reference::Tag(tag),
        } => resolve_tag(mirror, &req, name, tag).await,
        ApiPath::Manifest {
            name,
            reference: Reference::Digest(digest),
        } => by_digest(mirror, &req, name, digest, Kind::Manifest).await,
        ApiPath::Blob { name, digest } => by_digest(mirror, &req, name, digest, Kind::Blob).await,
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
    }
}

/// A tag: upstream (a 404 at once) or through peers, as `--resolve-tags` says.
async fn resolve_tag(
    mirror: &Mirror,
    req: &Pull,
    name: &str,
    tag: &str,
) -> Result<Response, ApiError> {
    let state = &mirror.state;
    let what = || format!("{}/{name}:{tag}", req.ns.as_deref().unwrap_or("-"));
    let count = |answer, source, response: Option<&Response>| {
        state
            .metrics
            .tag_requests
            .get_or_create(&TagLabels { answer })
            .inc();
        remember(state, req, what(), "manifest", source, response);
    };
    // No `ns`: ambiguous across registries. No peers, or a peer's request: nobody to ask.
    let (Some(peers), Some(ns), false) = (
        state.peers.as_deref(),
        req.ns.as_deref(),
        req.headers.contains_key(HOP_HEADER),
    ) else {
        count("upstream", Source::Miss, None);
        return Err(ApiError::ManifestUnknown);
    };
    let verdict = || {
        state
            .upstream
            .as_ref()
            .map_or(Verdict::Unknown, |w| w.verdict(ns))
    };
    if state.tags.route(verdict) == TagRoute::Upstream {
        count("upstream", Source::Miss, None);
        return Err(ApiError::ManifestUnknown);
    }
    let request = PeerRequest {
        name,
        ns: Some(ns),
        head: req.head,
        range: None,
    };
    match peers
        .manifest(request, Reference::Tag(tag.to_string()))
        .await
    {
        Ok(response) => {
            count("peers", Source::Peer, Some(&response));
            let response = request::sourced(response, Source::Peer);
            tracing::info!(
                registry = ns,
                name,
                tag,
                digest = response.headers().get(crate::oci::DOCKER_CONTENT_DIGEST).and_then(|v| v.to_str().ok()).unwrap_or("-"),
                policy = ?state.tags,
                "answered a tag from peers (the registry is not answering, or resolve-tags = always)"
            );
            Ok(response)
        }
        Err(miss) => {
            tracing::debug!(registry = ns, name, tag, %miss, "no peer resolved the tag");
            count("none", Source::Miss, None);
            Err(ApiError::ManifestUnknown)
        }
    }
}

/// Sources one request follows before it goes upstream: a stall down a chain costs a few
/// (its own source, the stalled one above it, the new leader). Together they wait twice the
/// follow timeout, what two sources could cost before, and one more source `LAST_CHANCE`.
const MAX_SOURCES: usize = 4;
/// What the one source named after that budget is still given: one that has the blob answers
/// in milliseconds, and going upstream instead is a fetch behind the coordinator's back.
const LAST_CHANCE: Duration = Duration::from_secs(1);

/// A miss nobody holds: lead (a 404) or follow a download; a failed source is reported.
async fn follow(
    mirror: &Mirror,
    req: &Pull,
    name: &str,
    digest: &Digest,
    kind: Kind,
) -> Result<Response, ApiError> {
    let miss = || Err(kind.unknown());
    let state = &mirror.state;
    let (Some(coalesce), Some(peers), Some(ns)) = (
        coalescing(state, req, name),
        state.peers.as_deref(),
        req.ns.as_deref(),
    ) else {
        return miss();
    };
    let range = req.headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let request = PeerRequest {
        name,
        ns: Some(ns),
        head: req.head,
        range,
    };
    let wait = coalesce.config().follow_timeout;
    // Each failed source is reported in the next claim, so a node goes upstream only when the
    // coordinator says it leads. A source that cut the last transfer is asked again first: a
    // leader whose download paused is still the leader. A source that failed once may be named
    // again, and is followed: a relay that was not progressing can be the new leader since.
    let mut failed = None;
    let give_up = tokio::time::Instant::now() + wait * 2;
    // One source past the budget, unless following is off (a zero wait).
    let mut last_chance = !wait.is_zero();
    for _ in 0..MAX_SOURCES {
        if tokio::time::Instant::now() >= give_up && !last_chance {
            break;
        }
        let source = match coalesce.decide(digest, failed.as_ref()).await {
            Decision::Follow(source) => source,
            Decision::Lead | Decision::Alone => return miss(),
        };
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        let wait = if left.is_zero() {
            last_chance = false;
            LAST_CHANCE
        } else {
            wait.min(left)
        };
        let got = if kind == Kind::Blob {
            peers
                .blob_following(request, digest.clone(), &source, wait)
                .await
        } else {
            peers
                .manifest_following(request, digest.clone(), &source, wait)
                .await
        };
        match got {
            Ok(response) => {
                coalesce.count("follower", "served");
                let response = if kind == Kind::Blob && !req.head {
                    coalesce.relaying(digest, response)
                } else {
                    response
                };
                let what = format!("{ns}/{name}@{digest}");
                tracing::debug!(%digest, source = %source.id, "following a download in progress");
                return Ok(served_by(
                    state,
                    req,
                    what,
                    kind,
                    Source::InFlight,
                    response,
                ));
            }
            Err(why) => {
                coalesce.count("follower", "failed");
                tracing::info!(%digest, source = %source.id, %why, "the source gave nothing in time; reporting it");
                failed = Some(source);
            }
        }
    }
    // Out of sources: the last one is reported too, so no one else is sent to it; this node
    // goes upstream whatever the answer (as the leader, if it is made one).
    coalesce.decide(digest, failed.as_ref()).await;
    miss()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Manifest,
    Blob,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Manifest => "manifest",
            Kind::Blob => "blob",
        }
    }

    fn unknown(self) -> ApiError {
        match self {
            Kind::Manifest => ApiError::ManifestUnknown,
            Kind::Blob => ApiError::BlobUnknown,
        }
    }
}

/// By digest: store, own transfer, peers (not for a peer), a leader's download, else a 404.
async fn by_digest(
    mirror: &Mirror,
    req: &Pull,
    name: &str,
    digest: &Digest,
    kind: Kind,
) -> Result<Response, ApiError> {
    let state = &mirror.state;
    // Held for peers only where it is shared with them: the lease serves no one else.
    if let Some(keep) = &state.keep
        && shared(state, req, name)
    {
        keep.asked(digest);
    }
    let what = || format!("{}/{name}@{digest}", req.ns.as_deref().unwrap_or("-"));
    match local(mirror, req, name, digest, kind).await {
        Ok(response) => return Ok(served_by(state, req, what(), kind, Source::Local, response)),
        Err(ApiError::ManifestUnknown | ApiError::BlobUnknown) => {}
        Err(other) => return Err(other),
    }
    if !forwardable_range(&req.headers) {
        // Malformed, or several ranges: no peer would answer it (and each would be charged for
        // refusing); the registry does.
        remember(state, req, what(), kind.label(), Source::Miss, None);
        return Err(match kind {
            Kind::Blob => ApiError::BlobUnknown,
            Kind::Manifest => ApiError::ManifestUnknown,
        });
    }
    let mut transfer = None;
    if let (Some(coalesce), false) = (coalescing(state, req, name), req.head) {
        let (mine, shared) = coalesce.share_local(digest).await;
        if !matches!(shared, Landing::Nothing)
            && let Some(response) = share(state, req, digest, kind, shared).await
        {
            let response = served_by(state, req, what(), kind, Source::InFlight, response);
            return Ok(keep(response, Some(mine)));
        }
        transfer = Some(mine);
    }
    let ns = req.ns.as_deref();
    let from_peer = req.headers.contains_key(HOP_HEADER);
    if let (Some(peers), false) = (state.peers.as_deref(), from_peer) {
        let request = PeerRequest {
            name,
            ns,
            head: req.head,
            range: req.headers.get(header::RANGE).and_then(|v| v.to_str().ok()),
        };
        let got = match kind {
            Kind::Blob => peers.blob(request, digest.clone()).await,
            Kind::Manifest => {
                let request = PeerRequest {
                    range: None,
                    ..request
                };
                let reference = Reference::Digest(digest.clone());
                peers.manifest(request, reference).await
            }
        };
        match got {
            Ok(response) => {
                let response = served_by(state, req, what(), kind, Source::Peer, response);
                return Ok(keep(response, transfer));
            }
            Err(why) => tracing::debug!(%digest, %why, "no peer served it"),
        }
    }
    match follow(mirror, req, name, digest, kind).await {
        Ok(response) => Ok(keep(response, transfer)),
        Err(e) => {
            remember(state, req, what(), kind.label(), Source::Miss, None);
            Err(e)
        }
    }
}

/// No Range, or one single range a peer can answer.
fn forwardable_range(headers: &HeaderMap) -> bool {
    headers.get(header::RANGE).is_none_or(|v| {
        v.to_str()
            .is_ok_and(|v| crate::oci::range::parse(v, u64::MAX).is_ok())
    })
}

async fn local(
    mirror: &Mirror,
    req: &Pull,
    name: &str,
    digest: &Digest,
    kind: Kind,
) -> Result<Response, ApiError> {
    match kind {
        Kind::Manifest => {
            let reference = Reference::Digest(digest.clone());
            mirror.local.manifest(req.head, None, name, reference).await
        }
        Kind::Blob => {
            mirror
                .local
                .blob(req.head, &req.headers, digest, None)
                .await
        }
    }
}

/// The coalescer, for this node's containerd asking for an image shared with peers.
fn coalescing<'a>(state: &'a MirrorState, req: &Pull, name: &str) -> Option<&'a Coalescer> {
    let coalesce = state.coalesce.as_deref()?;
    (shared(state, req, name) && !req.headers.contains_key(HOP_HEADER)).then_some(coalesce)
}

/// Whether the image is shared with peers (`--registry-filters`).
fn shared(state: &MirrorState, req: &Pull, name: &str) -> bool {
    req.ns
        .as_deref()
        .is_some_and(|ns| state.filters.allows(&format!("{ns}/{name}")))
}

/// A second request of this node's containerd, answered from the first one's download.
async fn share(
    state: &MirrorState,
    req: &Pull,
    digest: &Digest,
    kind: Kind,
    landing: Landing,
) -> Option<Response> {
    let store = state.store.as_ref();
    let landed = || in_flight::open_landed(store, digest, &req.headers);
    let body = match landing {
        Landing::InFlight(download) => match in_flight::open(&download, &req.headers, None).await {
            Ok(Opened::Body(body)) => body,
            // Landed between being found growing and being opened, as a small blob often does.
            Ok(Opened::Landed | Opened::Stalled) => landed().await.ok()?,
            Err(_) => return None,
        },
        Landing::Committed => landed().await.ok()?,
        Landing::Nothing => return None,
    };
    tracing::debug!(%digest, total = body.total, "sharing a download on this node");
    let counter = state.metrics.inflight_bytes.clone();
    let manifest = kind == Kind::Manifest;
    let answer = in_flight::respond(false, manifest, digest, body, true, counter);
    answer.await.ok()
}

fn keep(response: Response, transfer: Option<Transfer>) -> Response {
    match transfer {
        Some(transfer) => request::holding(response, transfer),
        None => response,
    }
}

/// Keeps an answer for `ferry status`; HEADs are existence checks, not pulls.
fn remember(
    state: &MirrorState,
    req: &Pull,
    what: String,
    kind: &'static str,
    source: Source,
    response: Option<&Response>,
) {
    if req.head {
        return;
    }
    let bytes = response
        .and_then(|r| r.headers().get(header::CONTENT_LENGTH))
        .and_then(|v| v.to_str().ok()?.parse().ok());
    state.recent.record(kind, what, source.label(), bytes);
}

fn served_by(
    state: &MirrorState,
    req: &Pull,
    what: String,
    kind: Kind,
    source: Source,
    response: Response,
) -> Response {
    remember(state, req, what, kind.label(), source, Some(&response));
    request::sourced(response, source)
}
