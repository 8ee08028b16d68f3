//! The mirror address: what this node's containerd may ask, and the only place Ferry asks
//! other nodes. Its answers, explicitly:
//! - `GET /v2/`: 200.
//! - a manifest by digest, a blob: this node's store, then peers that hold it, then (when
//!   several nodes miss it at once) the node downloading it as the leader (`coalesce`), then
//!   a 404 at once;
//! - a manifest by tag: never from this node's store (containerd already has that record and
//!   asks only to hear the registry's); `--resolve-tags` sends it upstream (a 404 at once) or
//!   through peers (see `tags.rs`);
//! - anything else (pushes, tag lists, other methods): refused.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri, header};
use axum::response::Response;

use super::local::Local;
use super::peer::{PeerFetcher, PeerRequest};
use super::request::{self, Request};
use super::tags::{ResolveTags, TagRoute};
use super::upstream::{UpstreamWatch, Verdict};
use super::{ApiError, HOP_HEADER};
use crate::coalesce::{Coalescer, Decision};
use crate::metrics::{Metrics, SourceLabels, TagLabels};
use crate::oci::registry::{Registries, RegistryFilters};
use crate::oci::{ApiPath, Digest, Reference};
use crate::store::ContentStore;

/// What the mirror's handler needs; shared read-only by every request.
#[derive(Clone)]
pub struct MirrorState {
    pub store: Arc<dyn ContentStore>,
    pub registries: Registries,
    pub metrics: Arc<Metrics>,
    /// Other nodes, asked on a local miss; `None` when peer-to-peer is off.
    pub peers: Option<Arc<PeerFetcher>>,
    /// When tags are resolved through peers.
    pub tags: ResolveTags,
    /// Whether each registry answers; consulted for `ResolveTags::WhenUpstreamFails` only
    /// (`None`: every registry counts as answering).
    pub upstream: Option<UpstreamWatch>,
    /// Which images are shared with peers: only those are coalesced.
    pub filters: RegistryFilters,
    /// Leader/follower coordination of simultaneous misses; `None` when off.
    pub coalesce: Option<Arc<Coalescer>>,
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

/// The mirror address's router. Every path goes to one handler that parses the raw path
/// itself: names contain slashes, and percent-decoding must not happen before validation.
pub fn router(state: MirrorState) -> Router {
    let local = Local {
        store: state.store.clone(),
        metrics: state.metrics.clone(),
    };
    Router::new()
        .fallback(handle)
        .with_state(Arc::new(Mirror { state, local }))
}

async fn handle(
    State(mirror): State<Arc<Mirror>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let state = &mirror.state;
    request::handle(
        &state.metrics,
        &state.registries,
        (&method, &uri, &headers),
        || Ok(()),
        |req| answer(&mirror, req),
    )
    .await
}

async fn answer(mirror: &Mirror, req: Request<'_>) -> Result<Response, ApiError> {
    let peer_request = |name| PeerRequest {
        name,
        ns: req.ns.as_deref(),
        head: req.head,
        range: None,
    };
    match &req.path {
        ApiPath::Base => Ok(Request::base()),
        ApiPath::Manifest {
            name,
            reference: Reference::Tag(tag),
        } => resolve_tag(mirror, &req, name, tag).await,
        ApiPath::Manifest {
            name,
            reference: reference @ Reference::Digest(_),
        } => {
            let local = mirror
                .local
                .manifest(req.head, None, name, reference.clone())
                .await;
            let miss = with_peers(mirror, &req, "manifest", local, |peers| {
                peers.manifest(peer_request(name), reference.clone())
            })
            .await;
            match (miss, reference) {
                (Err(ApiError::ManifestUnknown), Reference::Digest(digest)) => {
                    follow(mirror, &req, name, digest, "manifest").await
                }
                (other, _) => other,
            }
        }
        ApiPath::Blob { name, digest } => {
            let local = mirror.local.blob(req.head, req.headers, digest).await;
            let range = req.headers.get(header::RANGE).and_then(|v| v.to_str().ok());
            let request = PeerRequest {
                range,
                ..peer_request(name)
            };
            match with_peers(mirror, &req, "blob", local, |peers| {
                peers.blob(request, digest.clone())
            })
            .await
            {
                Err(ApiError::BlobUnknown) => follow(mirror, &req, name, digest, "blob").await,
                other => other,
            }
        }
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
    }
}

/// A tag: upstream (a 404 at once, so containerd asks the next host and finally the
/// registry) or through peers, as `--resolve-tags` and the registry's state say.
async fn resolve_tag(
    mirror: &Mirror,
    req: &Request<'_>,
    name: &str,
    tag: &str,
) -> Result<Response, ApiError> {
    let state = &mirror.state;
    let count = |answer, source| {
        state
            .metrics
            .tag_requests
            .get_or_create(&TagLabels { answer })
            .inc();
        count_served(state, "manifest", source);
    };
    // Without the registry (`ns`), a tag is ambiguous across registries; without peers, or
    // for a request from a peer, there is no one to ask.
    let (Some(peers), Some(ns), false) = (
        state.peers.as_deref(),
        req.ns.as_deref(),
        req.headers.contains_key(HOP_HEADER),
    ) else {
        count("upstream", "miss");
        return Err(ApiError::ManifestUnknown);
    };
    let verdict = || {
        state
            .upstream
            .as_ref()
            .map_or(Verdict::Unknown, |w| w.verdict(ns))
    };
    if state.tags.route(verdict) == TagRoute::Upstream {
        count("upstream", "miss");
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
        Some(response) => {
            count("peers", "peer");
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
        None => {
            count("none", "miss");
            Err(ApiError::ManifestUnknown)
        }
    }
}

/// A miss nobody holds: coordinate with the nodes missing it too. This node leads (a 404, its
/// containerd goes upstream), or follows the leader's download; a leader that gives nothing
/// is reported and the decision taken again, once. Anything else is a 404, as without.
async fn follow(
    mirror: &Mirror,
    req: &Request<'_>,
    name: &str,
    digest: &Digest,
    kind: &'static str,
) -> Result<Response, ApiError> {
    let miss = || {
        Err(if kind == "blob" {
            ApiError::BlobUnknown
        } else {
            ApiError::ManifestUnknown
        })
    };
    let state = &mirror.state;
    let (Some(coalesce), Some(peers), Some(ns)) = (
        state.coalesce.as_deref(),
        state.peers.as_deref(),
        req.ns.as_deref(),
    ) else {
        return miss();
    };
    // Not shared with peers (filters): not coordinated either. From a peer: never forwarded.
    if req.headers.contains_key(HOP_HEADER) || !state.filters.allows(&format!("{ns}/{name}")) {
        return miss();
    }
    let range = req.headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let request = PeerRequest {
        name,
        ns: Some(ns),
        head: req.head,
        range,
    };
    let wait = coalesce.config().follow_timeout;
    let mut failed = None;
    for _ in 0..2 {
        let leader = match coalesce.decide(digest, ns, name, failed.as_ref()).await {
            Decision::Follow(leader) => leader,
            Decision::Lead | Decision::Alone => return miss(),
        };
        let got = if kind == "blob" {
            peers
                .blob_following(request, digest.clone(), &leader, wait)
                .await
        } else {
            peers
                .manifest_following(request, digest.clone(), &leader, wait)
                .await
        };
        if let Some(response) = got {
            coalesce.count("follower", "served");
            count_served(state, kind, "inflight");
            tracing::debug!(%digest, leader = %leader.id, "following the leader's download");
            return Ok(response);
        }
        coalesce.count("follower", "failed");
        tracing::info!(%digest, leader = %leader.id, "the leader gave nothing in time; reporting it");
        failed = Some(leader);
    }
    miss()
}

/// Local first; on a local miss, other nodes (unless this request came from a peer: a peer
/// serves only its own content, so requests never travel further than one hop); then a 404.
async fn with_peers<'a, F, Fut>(
    mirror: &'a Mirror,
    req: &Request<'_>,
    kind: &'static str,
    local: Result<Response, ApiError>,
    ask_peers: F,
) -> Result<Response, ApiError>
where
    F: FnOnce(&'a PeerFetcher) -> Fut,
    Fut: std::future::Future<Output = Option<Response>>,
{
    let state = &mirror.state;
    let miss = match local {
        Ok(response) => {
            count_served(state, kind, "local");
            return Ok(response);
        }
        Err(e @ (ApiError::ManifestUnknown | ApiError::BlobUnknown)) => e,
        Err(other) => return Err(other),
    };
    let from_peer = req.headers.contains_key(HOP_HEADER);
    if let (Some(peers), false) = (state.peers.as_deref(), from_peer)
        && let Some(response) = ask_peers(peers).await
    {
        count_served(state, kind, "peer");
        return Ok(response);
    }
    count_served(state, kind, "miss");
    Err(miss)
}

fn count_served(state: &MirrorState, kind: &'static str, source: &'static str) {
    state
        .metrics
        .served
        .get_or_create(&SourceLabels { kind, source })
        .inc();
}
