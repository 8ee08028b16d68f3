//! Request handling: parse, look up, answer. Misses are fast 404s so containerd moves on.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

use super::peer_fetch::{PeerFetcher, PeerRequest};
use super::{ApiError, HOP_HEADER, PeerGuard, RegistryState, local};
use crate::config::registry_host;
use crate::metrics::{KindLabels, ReasonLabels, RequestLabels, SourceLabels};
use crate::oci::Reference;
use crate::oci::{self, ApiPath, path};
use crate::routing::{digest_key, tag_key};
use crate::trust::{TOKEN_HEADER, token};

type Shared = Arc<RegistryState>;

pub async fn handle(
    State(state): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let started = Instant::now();
    let parsed = path::parse(uri.path());
    let kind = match &parsed {
        Ok(ApiPath::Manifest { .. }) => "manifest",
        Ok(ApiPath::Blob { .. }) => "blob",
        Ok(ApiPath::Base) => "base",
        _ => "other",
    };
    let response = match dispatch(&state, &method, &uri, &headers, parsed).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    let status = response.status().as_u16();
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            kind,
            method: method.as_str().to_string(),
            status,
        })
        .inc();
    let elapsed = started.elapsed();
    state
        .metrics
        .request_duration
        .get_or_create(&KindLabels { kind })
        .observe(elapsed.as_secs_f64());
    tracing::debug!(
        %method,
        path = uri.path(),
        query = uri.query().unwrap_or(""),
        status,
        length = response.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).unwrap_or("-"),
        micros = elapsed.as_micros() as u64,
        "served"
    );
    response
}

async fn dispatch(
    state: &RegistryState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    parsed: Result<ApiPath, path::PathError>,
) -> Result<Response, ApiError> {
    if let Some(guard) = &state.guard {
        authorize(state, guard, method, uri, headers)?;
    }
    let head = match *method {
        Method::GET => false,
        Method::HEAD => true,
        _ => return Err(ApiError::MethodNotAllowed),
    };
    let ns = registry_param(uri)?;
    if let (Some(guard), Ok(path)) = (&state.guard, &parsed)
        && !exposed(guard, path, ns.as_deref())
    {
        return Err(match path {
            ApiPath::Manifest { .. } => ApiError::ManifestUnknown,
            _ => ApiError::BlobUnknown,
        });
    }
    if let Some(ns) = &ns
        && !state.registries.includes(ns)
    {
        return Err(ApiError::NotMirrored(ns.clone()));
    }
    match parsed? {
        ApiPath::Base => Ok((
            StatusCode::OK,
            [
                (oci::API_VERSION_HEADER, "registry/2.0"),
                (header::CONTENT_TYPE.as_str(), "application/json"),
            ],
            "{}",
        )
            .into_response()),
        ApiPath::Manifest { name, reference } => {
            let local = local::manifest(state, head, ns.as_deref(), &name, reference.clone()).await;
            let request = PeerRequest {
                name: &name,
                ns: ns.as_deref(),
                head,
                range: None,
            };
            with_peers(state, headers, "manifest", local, |peers| {
                peers.manifest(request, reference)
            })
            .await
        }
        ApiPath::Blob { name, digest } => {
            let local = local::blob(state, head, headers, &digest).await;
            let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
            let request = PeerRequest {
                name: &name,
                ns: ns.as_deref(),
                head,
                range,
            };
            with_peers(state, headers, "blob", local, |peers| {
                peers.blob(request, digest)
            })
            .await
        }
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
    }
}

/// Local first; on a local miss, other nodes (unless this request came from a peer: a peer
/// serves only its own content, so requests never travel further than one hop); then a 404.
async fn with_peers<'a, F, Fut>(
    state: &'a RegistryState,
    headers: &HeaderMap,
    kind: &'static str,
    local: Result<Response, ApiError>,
    ask_peers: F,
) -> Result<Response, ApiError>
where
    F: FnOnce(&'a PeerFetcher) -> Fut,
    Fut: std::future::Future<Output = Option<Response>>,
{
    let count = |source| {
        state
            .metrics
            .served
            .get_or_create(&SourceLabels { kind, source })
            .inc();
    };
    let miss = match local {
        Ok(response) => {
            count("local");
            return Ok(response);
        }
        Err(e @ (ApiError::ManifestUnknown | ApiError::BlobUnknown)) => e,
        Err(other) => return Err(other),
    };
    let from_peer = headers.contains_key(HOP_HEADER);
    if let (Some(peers), false) = (state.peers.as_deref(), from_peer)
        && let Some(response) = ask_peers(peers).await
    {
        count("peer");
        return Ok(response);
    }
    count("miss");
    Err(miss)
}

/// Peer requests carry a token signed with the cluster secret (when there is one). Checked
/// before anything else, so an unauthenticated caller learns nothing about what exists.
fn authorize(
    state: &RegistryState,
    guard: &PeerGuard,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    let Some(secret) = &guard.secret else {
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
fn exposed(guard: &PeerGuard, path: &ApiPath, ns: Option<&str>) -> bool {
    let exposed = guard.exposed.borrow();
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

/// The upstream registry containerd is pulling from, from `?ns=`.
fn registry_param(uri: &Uri) -> Result<Option<String>, ApiError> {
    let Some(query) = uri.query() else {
        return Ok(None);
    };
    let ns = form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == oci::NS_PARAM)
        .map(|(_, v)| v.into_owned());
    match ns {
        Some(ns) => {
            registry_host(&ns).map_err(ApiError::BadNamespace)?;
            Ok(Some(ns))
        }
        None => Ok(None),
    }
}
