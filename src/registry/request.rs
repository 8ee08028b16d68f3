//! What both addresses do around their own policy, in axum's terms: the [`counted`] middleware
//! parses the path once, then counts and logs every answer; the [`Pull`] extractor turns the
//! request into what a policy reads (method, path, `?ns=`). A request goes down through these
//! and comes back up; the policy never calls back into them.

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

use super::{ApiError, Source};
use crate::metrics::{KindLabels, Metrics, RequestLabels, SourceLabels};
use crate::oci::registry::{Registries, registry_host};
use crate::oci::{self, ApiPath, PathError, path};

/// One parsed pull request, as both routers' policies see it.
#[derive(Debug)]
pub(super) struct Pull {
    pub path: ApiPath,
    pub head: bool,
    /// The upstream registry containerd is pulling from (`?ns=`), already checked against
    /// the mirrored registries.
    pub ns: Option<String>,
    pub headers: HeaderMap,
    /// The connection itself, for a blob the asker takes with `sendfile` (`zero_copy.rs`).
    pub upgrade: Option<OnUpgrade>,
}

impl Pull {
    /// The `/v2/` answer: both addresses speak the registry API.
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

/// The path as [`counted`] parsed it, handed to the extractor so it is parsed once.
#[derive(Debug, Clone)]
struct Parsed(Result<ApiPath, PathError>);

/// A router's state that knows which registries its address mirrors.
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
        };
        Ok(Pull {
            path: parsed?,
            head,
            ns,
            headers: std::mem::take(&mut parts.headers),
            upgrade: parts.extensions.remove::<OnUpgrade>(),
        })
    }
}

/// Which address a request came in on, as the metrics' `listener` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Listener {
    /// This node's containerd asks.
    Mirror,
    /// Another node asks.
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

/// What [`counted`] needs.
#[derive(Debug, Clone)]
pub(super) struct Counting {
    pub listener: Listener,
    pub metrics: Arc<Metrics>,
}

/// `response`, with `guard` kept alive until its body has been sent (a transfer, a follower
/// being served: what must last as long as the stream, not the handler).
pub(super) fn holding<T: Send + 'static>(response: Response, guard: T) -> Response {
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _ = &guard;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// A policy's answer as a response: marked [`Source::Local`] when the policy set no source
/// (the store answered), [`Source::Miss`] when nobody had it.
pub(super) fn answered(result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(mut response) => {
            if response.extensions().get::<Source>().is_none() {
                response.extensions_mut().insert(Source::Local);
            }
            response
        }
        // Nobody had it (this node, its peers, a leader): what `source="miss"` counts.
        Err(e @ (ApiError::ManifestUnknown | ApiError::BlobUnknown)) => {
            sourced(e.into_response(), Source::Miss)
        }
        Err(e) => e.into_response(),
    }
}

/// `response`, marked as coming from `source`, for [`counted`], the one place that counts
/// answers and their bytes.
pub(super) fn sourced(mut response: Response, source: Source) -> Response {
    response.extensions_mut().insert(source);
    response
}

/// Middleware: parses the path once, and counts and logs what the address answered.
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
            // A fixed set: any other token is a valid HTTP method, and a label per spelling
            // would grow without bound.
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

/// Counts an answer (`ferry_served_total`) and, as its body is sent, its bytes
/// (`ferry_served_bytes_total`): bytes that reached the client, not bytes promised.
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
