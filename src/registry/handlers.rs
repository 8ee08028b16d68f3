//! Request handling: parse, look up, answer. Misses are fast 404s so containerd moves on.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use super::{ApiError, RegistryState};
use crate::config::registry_host;
use crate::metrics::{KindLabels, LookupLabels, RequestLabels};
use crate::oci::manifest::{MAX_MANIFEST_BYTES, is_manifest_media_type, sniff_media_type};
use crate::oci::{self, ApiPath, Digest, Reference, path};
use crate::store::StoreError;

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
    let head = match *method {
        Method::GET => false,
        Method::HEAD => true,
        _ => return Err(ApiError::MethodNotAllowed),
    };
    let ns = registry_param(uri)?;
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
            manifest(state, head, ns.as_deref(), &name, reference).await
        }
        ApiPath::Blob { digest, .. } => blob(state, head, headers, &digest).await,
        ApiPath::Upload { .. } | ApiPath::TagsList { .. } => Err(ApiError::Unsupported),
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

async fn manifest(
    state: &RegistryState,
    head: bool,
    ns: Option<&str>,
    name: &str,
    reference: Reference,
) -> Result<Response, ApiError> {
    let (digest, declared) = match reference {
        Reference::Tag(tag) => {
            // Without the registry, `name:tag` is ambiguous across registries: a miss.
            let ns = ns.ok_or(ApiError::ManifestUnknown)?;
            let found = state.store.resolve(ns, name, &tag).await;
            record(state, "manifest", &found);
            let desc = found.map_err(ApiError::manifest)?;
            (desc.digest, desc.media_type)
        }
        Reference::Digest(digest) => (digest, None),
    };
    let found = state.store.descriptor(&digest).await;
    if declared.is_none() {
        record(state, "manifest", &found);
    }
    let desc = found.map_err(ApiError::manifest)?;
    if desc.size > MAX_MANIFEST_BYTES {
        return Err(ApiError::ManifestUnknown);
    }
    let stream = state
        .store
        .open(&digest, None)
        .await
        .map_err(ApiError::manifest)?;
    let chunks: Vec<Bytes> = stream
        .try_collect()
        .await
        .map_err(|e| ApiError::manifest(StoreError::Io(e)))?;
    let bytes = Bytes::from(chunks.concat());
    if !digest.matches(&bytes) {
        tracing::error!(%digest, "stored manifest does not match its digest; not serving it");
        return Err(ApiError::ManifestUnknown);
    }
    let media_type = declared
        .filter(|t| is_manifest_media_type(t))
        .or_else(|| sniff_media_type(&bytes).map(str::to_string))
        .ok_or(ApiError::ManifestUnknown)?;
    let mut response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, media_type)
        .header(header::CONTENT_LENGTH, bytes.len())
        .header(oci::DOCKER_CONTENT_DIGEST, digest.to_string());
    if head {
        return Ok(response.body(Body::empty()).unwrap_or_default());
    }
    state
        .metrics
        .bytes_served
        .get_or_create(&KindLabels { kind: "manifest" })
        .inc_by(bytes.len() as u64);
    response = response.header(header::ETAG, format!("\"{digest}\""));
    Ok(response.body(Body::from(bytes)).unwrap_or_default())
}

async fn blob(
    state: &RegistryState,
    head: bool,
    headers: &HeaderMap,
    digest: &Digest,
) -> Result<Response, ApiError> {
    let found = state.store.descriptor(digest).await;
    record(state, "blob", &found);
    let desc = found.map_err(ApiError::blob)?;
    let range = match headers.get(header::RANGE) {
        Some(v) => {
            let v = v
                .to_str()
                .map_err(|_| oci::RangeError::Malformed("not ASCII"))?;
            Some(oci::range::parse(v, desc.size)?)
        }
        None => None,
    };
    let (status, length) = match range {
        Some(r) => (StatusCode::PARTIAL_CONTENT, r.len()),
        None => (StatusCode::OK, desc.size),
    };
    let mut response = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, length)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(oci::DOCKER_CONTENT_DIGEST, digest.to_string())
        .header(header::ETAG, format!("\"{digest}\""));
    if let Some(r) = range
        && let Ok(v) = HeaderValue::from_str(&r.content_range(desc.size))
    {
        response = response.header(header::CONTENT_RANGE, v);
    }
    if head {
        return Ok(response.body(Body::empty()).unwrap_or_default());
    }
    let stream = state
        .store
        .open(digest, range)
        .await
        .map_err(ApiError::blob)?;
    let counter = state
        .metrics
        .bytes_served
        .get_or_create(&KindLabels { kind: "blob" })
        .clone();
    // Content-Length is set, so a stream that ends early or errors makes hyper drop the
    // connection: containerd sees a failed transfer, never a short blob.
    let body = Body::from_stream(
        stream
            .inspect_ok(move |chunk| {
                counter.inc_by(chunk.len() as u64);
            })
            .boxed(),
    );
    Ok(response.body(body).unwrap_or_default())
}

fn record<T>(state: &RegistryState, kind: &'static str, found: &Result<T, StoreError>) {
    let result = match found {
        Ok(_) => "hit",
        Err(StoreError::NotFound) => "miss",
        Err(_) => "unavailable",
    };
    state
        .metrics
        .lookups
        .get_or_create(&LookupLabels { kind, result })
        .inc();
}
