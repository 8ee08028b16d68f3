//! Around both addresses' policies, in axum's terms: the [`counted`] middleware parses the
//! path once and counts and logs every answer; the [`Pull`] extractor gives a policy what it
//! reads. Invariant: a policy never calls back into them.

use std::sync::Arc;

use futures::StreamExt;
use std::time::Instant;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper::upgrade::OnUpgrade;

use super::zero_copy::Upgrade;
use crate::net::limits::Hold;

use super::{ApiError, Source};
use crate::metrics::{KindLabels, Metrics, RequestLabels, SourceLabels};
use crate::oci::registry::{Registries, registry_host};
use crate::oci::{self, ApiPath, PathError, path};

#[derive(Debug)]
pub(super) struct Pull {
    pub path: ApiPath,
    pub head: bool,
    /// The upstream registry (`?ns=`), already checked against the mirrored registries.
    pub ns: Option<String>,
    pub headers: HeaderMap,
    /// The connection, for a blob sent with `sendfile` (`zero_copy.rs`).
    pub upgrade: Option<Upgrade>,
}

impl Pull {
    pub(super) fn base() -> Response {
        (
            StatusCode::OK,
            [
                (oci::API_VERSION_HEADER, "registry/2.0"),
                (header::CONTENT_TYPE.as_str(), "application/json"),
            ],
            "{}",
        )
            .into_response()
    }
}

/// The path as [`counted`] parsed it, so it is parsed once.
#[derive(Debug, Clone)]
struct Parsed(Result<ApiPath, PathError>);

pub(super) trait Mirrored {
    fn registries(&self) -> &Registries;
}

impl<S> FromRequestParts<S> for Pull
where
    S: Mirrored + Send + Sync,
{
    type Rejection = ApiError;

    /// Pulls only (GET and HEAD), of mirrored registries only.
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let head = match parts.method {
            Method::GET => false,
            Method::HEAD => true,
            _ => return Err(ApiError::MethodNotAllowed),
        };
        let ns = registry_param(&parts.uri)?;
        if let Some(ns) = &ns
            && !state.registries().includes(ns)
        {
            return Err(ApiError::NotMirrored(ns.clone()));
        }
        let parsed = match parts.extensions.remove::<Parsed>() {
            Some(Parsed(parsed)) => parsed,
            None => path::parse(parts.uri.path()),
        }?;
        // containerd always names the registry to a mirror: without `ns`, `--registries` could
        // not keep an unmirrored registry's content from a local reader (M2a).
        if ns.is_none()
            && matches!(state.registries(), Registries::Only(_))
            && parsed != ApiPath::Base
        {
            return Err(ApiError::NotMirrored(String::new()));
        }
        Ok(Pull {
            path: parsed,
            head,
            ns,
            headers: std::mem::take(&mut parts.headers),
            upgrade: parts
                .extensions
                .remove::<OnUpgrade>()
                .map(|on_upgrade| Upgrade {
                    on_upgrade,
                    hold: parts.extensions.remove::<Hold>(),
                }),
        })
    }
}

/// The metrics' `listener` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Listener {
    Mirror,
    Peer,
}

impl Listener {
    fn label(self) -> &'static str {
        match self {
            Listener::Mirror => "mirror",
            Listener::Peer => "peer",
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Counting {
    pub listener: Listener,
    pub metrics: Arc<Metrics>,
}

/// `response`, with `guard` kept alive until its body has been sent, not just the handler.
pub(super) fn holding<T: Send + 'static>(response: Response, guard: T) -> Response {
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _ = &guard;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// A policy's answer; with no source set, the store answered ([`Source::Local`]).
pub(super) fn answered(result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(mut response) => {
            if response.extensions().get::<Source>().is_none() {
                response.extensions_mut().insert(Source::Local);
            }
            response
        }
        // Nobody had it (this node, its peers, a leader).
        Err(e @ (ApiError::ManifestUnknown | ApiError::BlobUnknown)) => {
            sourced(e.into_response(), Source::Miss)
        }
        Err(e) => e.into_response(),
    }
}

/// `response`, marked with its `source` for [`counted`].
pub(super) fn sourced(mut response: Response, source: Source) -> Response {
    response.extensions_mut().insert(source);
    response
}

pub(super) async fn counted(
    State(counting): State<Counting>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let (method, uri) = (request.method().clone(), request.uri().clone());
    let parsed = path::parse(uri.path());
    let kind = match &parsed {
        Ok(ApiPath::Manifest { .. }) => "manifest",
        Ok(ApiPath::Blob { .. }) => "blob",
        Ok(ApiPath::Base) => "base",
        _ => "other",
    };
    request.extensions_mut().insert(Parsed(parsed));
    let response = next.run(request).await;
    let metrics = &counting.metrics;
    let listener = counting.listener.label();
    let source = response.extensions().get::<Source>().copied();
    let response = match (kind, source) {
        ("manifest" | "blob", Some(source)) => {
            let head = method == Method::HEAD;
            count_served(metrics, listener, kind, source, head, response)
        }
        _ => response,
    };
    let status = response.status().as_u16();
    metrics
        .requests
        .get_or_create(&RequestLabels {
            listener,
            kind,
            // A fixed set: a label per spelling of a method would grow without bound.
            method: match method {
                Method::GET => "GET",
                Method::HEAD => "HEAD",
                _ => "other",
            }
            .to_string(),
            status,
        })
        .inc();
    let elapsed = started.elapsed();
    metrics
        .request_duration
        .get_or_create(&KindLabels { listener, kind })
        .observe(elapsed.as_secs_f64());
    tracing::debug!(
        listener,
        %method,
        source = source.map_or("-", Source::label),
        path = uri.path(),
        query = uri.query().unwrap_or(""),
        status,
        length = response.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).unwrap_or("-"),
        micros = elapsed.as_micros() as u64,
        "served"
    );
    response
}

/// Counts an answer, and the bytes of it that reached the client.
fn count_served(
    metrics: &Metrics,
    listener: &'static str,
    kind: &'static str,
    source: Source,
    head: bool,
    response: Response,
) -> Response {
    let labels = SourceLabels {
        listener,
        kind,
        source: source.label(),
    };
    metrics.served.get_or_create(&labels).inc();
    if head || source == Source::Miss {
        return response;
    }
    let counter = metrics.served_bytes.get_or_create(&labels).clone();
    let (parts, body) = response.into_parts();
    let counted = body.map_frame(move |frame| {
        if let Some(data) = frame.data_ref() {
            counter.inc_by(data.len() as u64);
        }
        frame
    });
    Response::from_parts(parts, axum::body::Body::new(counted))
}

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
