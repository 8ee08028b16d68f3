//! The peer address: what other nodes may ask. Its answers, explicitly:
//! - every request first shows a token signed with the cluster secret (when there is one),
//!   or gets a 401 and learns nothing;
//! - `GET /v2/`: 200;
//! - a manifest by digest or by tag, a blob: from this node's own store, and only what this
//!   node advertises (so `--registries` and `--registry-filters` hold for serving too). Tags
//!   are served here: that is how another node resolves one while its registry is down.
//! - anything else: refused. Nothing is ever asked of other nodes from here, so a request
//!   travels one hop at most.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use tokio::sync::watch;

use super::ApiError;
use super::local::Local;
use super::request::{self, Request};
use crate::metrics::{Metrics, ReasonLabels};
use crate::oci::registry::Registries;
use crate::oci::{ApiPath, Reference};
use crate::routing::sync::Exposed;
use crate::routing::{digest_key, tag_key};
use crate::store::ContentStore;
use crate::trust::{ClusterSecret, TOKEN_HEADER, token};

/// What the peer address's handler needs; shared read-only by every request.
#[derive(Clone)]
pub struct PeerApiState {
    pub store: Arc<dyn ContentStore>,
    pub registries: Registries,
    pub metrics: Arc<Metrics>,
    /// Who may ask: `None` serves anyone (Ferry warns loudly at start).
    pub secret: Option<ClusterSecret>,
    /// What this node advertises: the peer address serves nothing else.
    pub exposed: watch::Receiver<Exposed>,
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

/// The peer address's router (one handler, for the same reason as the mirror's).
pub fn router(state: PeerApiState) -> Router {
    let local = Local {
        store: state.store.clone(),
        metrics: state.metrics.clone(),
    };
    Router::new()
        .fallback(handle)
        .with_state(Arc::new(PeerApi { state, local }))
}

async fn handle(
    State(api): State<Arc<PeerApi>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let state = &api.state;
    request::handle(
        &state.metrics,
        &state.registries,
        (&method, &uri, &headers),
        || authorize(state, &method, &uri, &headers),
        |req| answer(&api, req),
    )
    .await
}

async fn answer(api: &PeerApi, req: Request<'_>) -> Result<Response, ApiError> {
    if !exposed(&api.state, &req.path, req.ns.as_deref()) {
        return Err(match req.path {
            ApiPath::Manifest { .. } => ApiError::ManifestUnknown,
            _ => ApiError::BlobUnknown,
        });
    }
    match req.path {
        ApiPath::Base => Ok(Request::base()),
        ApiPath::Manifest { name, reference } => {
            api.local
                .manifest(req.head, req.ns.as_deref(), &name, reference)
                .await
        }
        ApiPath::Blob { digest, .. } => api.local.blob(req.head, req.headers, &digest).await,
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
    }
}

/// Peer requests carry a token signed with the cluster secret (when there is one). Checked
/// before anything else, so an unauthenticated caller learns nothing about what exists.
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
        tracing::warn!(reason = e.reason(), %method, path, "peer request refused");
        state
            .metrics
            .peer_auth_failures
            .get_or_create(&ReasonLabels { reason: e.reason() })
            .inc();
        ApiError::Unauthorized
    })
}

/// Does this node advertise what is asked? The peer address serves nothing else.
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
