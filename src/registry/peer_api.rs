//! The peer address: what other nodes may ask, after a token signed with the cluster secret
//! (else a 401 that reveals nothing): what this node advertises (tags too, for a node whose
//! registry is down), downloads it leads or relays, to followers, and claims it coordinates.
//! Invariant: nothing is asked of other nodes from here, so a request travels one hop at most.

use std::sync::Arc;
use std::time::Duration;

use std::collections::HashMap;
use std::net::SocketAddr;

use axum::extract::Request;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use tokio::sync::watch;

use super::in_flight::{self, Opened};
use super::integrity::{Check, Integrity};
use super::local::Local;
use super::peer::ClaimAnswer;
use super::request::{self, Counting, Listener, Mirrored, Pull};
use super::zero_copy;
use super::{ApiError, Source};
use crate::coalesce::relay::Relayed;
use crate::coalesce::{Coalescer, Role};
use crate::keep::Keeper;
use crate::metrics::{Metrics, ReasonLabels};
use crate::net::limits::{self, LogEvery};
use crate::net::pace::{self, Pace};
use crate::net::server::ConnAddrs;
use crate::oci::Digest;
use crate::oci::registry::Registries;
use crate::oci::{ApiPath, Reference};
use crate::routing::Peer;
use crate::routing::sync::Exposed;
use crate::routing::{digest_key, plausible_peer_id, plausible_peer_ip, tag_key};
use crate::store::ContentStore;
use crate::store::downloads::{self, Landing};
use crate::trust::{ClusterSecret, token};
use crate::wire::{CLAIM_PATH, FOLLOW_HEADER, TOKEN_HEADER};
use tokio::time::Instant;

#[derive(Clone)]
pub struct PeerApiState {
    pub store: Arc<dyn ContentStore>,
    pub registries: Registries,
    pub metrics: Arc<Metrics>,
    /// `None` serves anyone (Ferry warns loudly at start).
    pub secret: Option<ClusterSecret>,
    /// Nothing else is served, but downloads in progress to followers.
    pub exposed: watch::Receiver<Exposed>,
    pub coalesce: Option<Arc<Coalescer>>,
    /// `None`: blobs are served unchecked.
    pub integrity: Option<Arc<Integrity>>,
    pub zero_copy: bool,
    /// Paces every answer's body; then no zero-copy, since `sendfile` bypasses the pacing.
    pub(crate) upload_limit: Option<Arc<Pace>>,
    /// Told what peers are served, so it is kept longest.
    pub keep: Option<Keeper>,
}

impl std::fmt::Debug for PeerApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerApiState")
            .field("registries", &self.registries)
            .field("secret", &self.secret.is_some())
            .finish_non_exhaustive()
    }
}

struct PeerApi {
    state: PeerApiState,
    local: Local,
}

/// Claims, and pulls through one handler; the token is checked first.
pub(crate) fn router(state: PeerApiState) -> Router {
    let local = Local {
        store: state.store.clone(),
        metrics: state.metrics.clone(),
    };
    let counting = Counting {
        listener: Listener::Peer,
        metrics: state.metrics.clone(),
    };
    let api = Arc::new(PeerApi { state, local });
    let auth = middleware::from_fn_with_state(api.clone(), authorized);
    let mut pulls = Router::new()
        .fallback(handle)
        .layer(auth.clone())
        .layer(middleware::from_fn_with_state(counting, request::counted));
    if let Some(pace) = api.state.upload_limit.clone() {
        pulls = pulls.layer(middleware::map_response(move |response: Response| {
            let pace = pace.clone();
            async move {
                let (parts, body) = response.into_parts();
                Response::from_parts(parts, pace::paced(body, pace))
            }
        }));
    }
    let pulls = pulls.with_state(api.clone());
    Router::new()
        .route(&format!("{CLAIM_PATH}{{digest}}"), post(claim))
        .route_layer(auth)
        .fallback_service(pulls)
        .with_state(api)
}

impl Mirrored for Arc<PeerApi> {
    fn registries(&self) -> &Registries {
        &self.state.registries
    }
}

async fn claim(
    State(api): State<Arc<PeerApi>>,
    Path(digest): Path<String>,
    conn: Option<Extension<ConnAddrs>>,
    uri: Uri,
) -> Response {
    let state = &api.state;
    let Some(coalesce) = &state.coalesce else {
        return ApiError::Unsupported.into_response();
    };
    let digest = match digest.parse::<Digest>() {
        Ok(d) => d,
        Err(e) => return ApiError::Path(crate::oci::PathError::DigestInvalid(e)).into_response(),
    };
    let query: HashMap<String, String> =
        form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let seen_from = conn.map(|Extension(c)| c.remote.ip());
    let claimant = match (
        query.get("peer"),
        query.get("addr").and_then(|a| a.parse::<SocketAddr>().ok()),
    ) {
        (Some(id), Some(addr))
            if plausible_peer_id(id)
                && seen_from.is_none_or(|from| plausible_peer_ip(addr.ip(), from)) =>
        {
            Peer {
                id: id.clone(),
                addr,
            }
        }
        _ => return ApiError::Unsupported.into_response(),
    };
    let failed = query.get("failed").map(String::as_str);
    if failed.is_some_and(|f| !plausible_peer_id(f)) {
        return ApiError::Unsupported.into_response();
    }
    let grant = coalesce.claim(&digest, &claimant, failed);
    axum::Json(ClaimAnswer::from_grant(&grant)).into_response()
}

async fn handle(State(api): State<Arc<PeerApi>>, pull: Pull) -> Response {
    request::answered(answer(&api, pull).await)
}

async fn answer(api: &PeerApi, mut req: Pull) -> Result<Response, ApiError> {
    let follower = (req.headers.get(FOLLOW_HEADER))
        .and_then(|v| v.to_str().ok())
        .filter(|f| plausible_peer_id(f));
    if let (Some(coalesce), Some(digest), Some(follower)) =
        (&api.state.coalesce, by_digest(&req.path), follower)
        && let Some(role) = coalesce.role_soon(digest).await
    {
        let serving = coalesce.serving(digest, follower);
        let response = in_flight(api, coalesce, &req, digest, role, follower).await?;
        // A follower is one while its body streams, not only while its answer is found.
        return Ok(request::holding(response, serving));
    }
    if !exposed(&api.state, &req.path, req.ns.as_deref()) {
        return Err(match req.path {
            ApiPath::Manifest { .. } => ApiError::ManifestUnknown,
            _ => ApiError::BlobUnknown,
        });
    }
    match &req.path {
        ApiPath::Base => Ok(Pull::base()),
        ApiPath::Manifest { name, reference } => {
            api.local
                .manifest(req.head, req.ns.as_deref(), name, reference.clone())
                .await
        }
        ApiPath::Blob { digest, .. } => {
            let offered = api.state.zero_copy
                && api.state.upload_limit.is_none()
                && zero_copy::offered(&req.headers);
            let zero_copy = req.upgrade.take().filter(|_| offered);
            stored_blob(api, &req, digest, zero_copy).await
        }
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
    }
}

/// A stored blob, unless its file no longer matches its digest: then a 404 (`integrity.rs`).
async fn stored_blob(
    api: &PeerApi,
    req: &Pull,
    digest: &Digest,
    zero_copy: Option<zero_copy::Upgrade>,
) -> Result<Response, ApiError> {
    if let Some(integrity) = &api.state.integrity
        && !req.head
        && integrity.check(digest).await == Check::Bad
    {
        return Err(ApiError::BlobUnknown);
    }
    if let Some(keep) = &api.state.keep {
        keep.served(digest);
    }
    api.local
        .blob(req.head, &req.headers, digest, zero_copy)
        .await
}

fn by_digest(path: &ApiPath) -> Option<&Digest> {
    match path {
        ApiPath::Blob { digest, .. } => Some(digest),
        ApiPath::Manifest {
            reference: Reference::Digest(d),
            ..
        } => Some(d),
        _ => None,
    }
}

/// What this node leads or relays: stored, else out of containerd's download as it lands.
async fn in_flight(
    api: &PeerApi,
    coalesce: &Coalescer,
    req: &Pull,
    digest: &Digest,
    role: Role,
    follower: &str,
) -> Result<Response, ApiError> {
    let complete = || async {
        match &req.path {
            ApiPath::Manifest { name, reference } => {
                api.local
                    .manifest(req.head, None, name, reference.clone())
                    .await
            }
            _ => stored_blob(api, req, digest, None).await,
        }
    };
    if let Ok(response) = complete().await {
        return Ok(response);
    }
    let wait = coalesce.config().follow_timeout;
    let deadline = Instant::now() + wait;
    let store = api.state.store.as_ref();
    let landing = downloads::wait_for(store, digest, wait).await;
    // containerd records a commit after the rename: a landed blob may briefly be unknown.
    let settled = || async {
        for _ in 0..in_flight::COMMIT_RECORD_TRIES {
            match complete().await {
                Ok(response) => return Ok(response),
                Err(_) if store.landed(digest).await.is_some() => {
                    tokio::time::sleep(in_flight::COMMIT_RECORD_POLL).await
                }
                Err(e) => return Err(e),
            }
        }
        complete().await
    };
    let download = match landing {
        // A relay serves what it has received, not only what its containerd has written.
        // A follower often asks before this node's own answer has come: the window is made
        // now, else every byte would wait for containerd's next mebibyte write.
        Landing::InFlight(ingest) => match (&role, &req.path) {
            (Role::Follow(_), ApiPath::Blob { .. }) => {
                match coalesce.window(digest, ingest.total()) {
                    // Sent away as too slow for this relay: it reports this node and is
                    // re-attached elsewhere.
                    Some(received) if received.gave_up(follower) => {
                        return Err(ApiError::BlobUnknown);
                    }
                    Some(received) => Arc::new(Relayed {
                        ingest,
                        received,
                        follower: follower.to_string(),
                        slow: coalesce.counter("relay", "slow_follower"),
                    }) as crate::store::downloads::InFlight,
                    None => ingest,
                }
            }
            _ => ingest,
        },
        // Committed meanwhile, or never started (the follower goes elsewhere).
        Landing::Committed | Landing::Nothing => return settled().await,
    };
    let body = match in_flight::open(&download, &req.headers, Some(deadline)).await? {
        Opened::Body(body) => body,
        Opened::Landed => return settled().await,
        Opened::Stalled => {
            tracing::debug!(%digest, "not following a download that is not progressing");
            return complete().await;
        }
    };
    let manifest = matches!(req.path, ApiPath::Manifest { .. });
    tracing::debug!(%digest, total = body.total, ?role, "serving a follower from the download in progress");
    let metrics = &api.state.metrics;
    let counter = match role {
        Role::Lead => metrics.inflight_bytes.clone(),
        Role::Follow(_) => metrics.relayed_bytes.clone(),
    };
    // The follower checks a blob's digest itself: not hashed twice.
    let answer = in_flight::respond(req.head, manifest, digest, body, false, counter).await?;
    Ok(request::sourced(answer, Source::InFlight))
}

/// Middleware: the token comes first, so a caller without one learns nothing.
async fn authorized(State(api): State<Arc<PeerApi>>, request: Request, next: Next) -> Response {
    match authorize(
        &api.state,
        request.method(),
        request.uri(),
        request.headers(),
    ) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// Refused requests are logged at most this often: anyone who reaches the port can send them.
static REFUSED_LOG: LogEvery = LogEvery::new(Duration::from_secs(10));

fn authorize(
    state: &PeerApiState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    let Some(secret) = &state.secret else {
        return Ok(());
    };
    let token = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok());
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    token::verify(secret, method.as_str(), path, token).map_err(|e| {
        if let Some(refused) = REFUSED_LOG.tick() {
            let path = limits::shortened(path, 200);
            tracing::warn!(reason = e.reason(), %method, path, refused, "peer requests refused (the last one shown; logged at most every 10 s)");
        }
        state
            .metrics
            .peer_auth_failures
            .get_or_create(&ReasonLabels { reason: e.reason() })
            .inc();
        ApiError::Unauthorized
    })
}

/// The peer address serves only what this node advertises.
fn exposed(state: &PeerApiState, path: &ApiPath, ns: Option<&str>) -> bool {
    let exposed = state.exposed.borrow();
    match path {
        ApiPath::Base => true,
        ApiPath::Blob { digest, .. } => exposed.contains(&digest_key(digest)),
        ApiPath::Manifest {
            reference: Reference::Digest(d),
            ..
        } => exposed.contains(&digest_key(d)),
        ApiPath::Manifest {
            name,
            reference: Reference::Tag(tag),
        } => ns.is_some_and(|ns| exposed.contains(&tag_key(ns, name, tag))),
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => false,
    }
}
