//! What both addresses do with a request before and after their own policy: parse the path
//! and the method, read `?ns=`, and count and log the answer.

use std::future::Future;
use std::time::Instant;

use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use super::{ApiError, Source};
use crate::metrics::{KindLabels, Metrics, RequestLabels, SourceLabels};
use crate::oci::registry::{Registries, registry_host};
use crate::oci::{self, ApiPath, path};

/// One parsed request, as both routers' policies see it.
#[derive(Debug)]
pub(super) struct Request<'a> {
    pub path: ApiPath,
    pub head: bool,
    /// The upstream registry containerd is pulling from (`?ns=`), already checked against
    /// the mirrored registries.
    pub ns: Option<String>,
    pub headers: &'a HeaderMap,
}

impl Request<'_> {
    /// The `/v2/` answer: both addresses speak the registry API.
    pub fn base() -> Response {
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

/// `response`, marked as coming from `source`, for [`handle`], the one place that counts
/// answers and their bytes. An answer without a mark came from this node's store.
pub(super) fn sourced(mut response: Response, source: Source) -> Response {
    response.extensions_mut().insert(source);
    response
}

/// Runs `precheck` (the peer address's token check, before anything is looked at), parses
/// `method`, `uri` and `?ns=` into a [`Request`] (pulls only; registries not mirrored are
/// refused), runs `answer` on it, and counts and logs what it answered.
pub(super) async fn handle<'a, F, Fut>(
    listener: Listener,
    metrics: &Metrics,
    registries: &Registries,
    (method, uri, headers): (&Method, &Uri, &'a HeaderMap),
    precheck: impl FnOnce() -> Result<(), ApiError>,
    answer: F,
) -> Response
where
    F: FnOnce(Request<'a>) -> Fut,
    Fut: Future<Output = Result<Response, ApiError>>,
{
    let started = Instant::now();
    let parsed = path::parse(uri.path());
    let kind = match &parsed {
        Ok(ApiPath::Manifest { .. }) => "manifest",
        Ok(ApiPath::Blob { .. }) => "blob",
        Ok(ApiPath::Base) => "base",
        _ => "other",
    };
    let request = (|| {
        precheck()?;
        let head = match *method {
            Method::GET => false,
            Method::HEAD => true,
            _ => return Err(ApiError::MethodNotAllowed),
        };
        let ns = registry_param(uri)?;
        if let Some(ns) = &ns
            && !registries.includes(ns)
        {
            return Err(ApiError::NotMirrored(ns.clone()));
        }
        Ok(Request {
            path: parsed?,
            head,
            ns,
            headers,
        })
    })();
    let head = *method == Method::HEAD;
    let (response, source) = match request {
        Ok(request) => match answer(request).await {
            Ok(r) => {
                let source = r.extensions().get::<Source>().copied();
                let source = source.unwrap_or(Source::Local);
                (r, Some(source))
            }
            // Nobody had it (this node, its peers, a leader): what `source="miss"` counts.
            Err(e @ (ApiError::ManifestUnknown | ApiError::BlobUnknown)) => {
                (e.into_response(), Some(Source::Miss))
            }
            Err(e) => (e.into_response(), None),
        },
        Err(e) => (e.into_response(), None),
    };
    let listener = listener.label();
    let response = match (kind, source) {
        ("manifest" | "blob", Some(source)) => {
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
            method: match *method {
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
