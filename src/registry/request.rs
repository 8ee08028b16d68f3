//! What both addresses do with a request before and after their own policy: parse the path
//! and the method, read `?ns=`, and count and log the answer.

use std::future::Future;
use std::time::Instant;

use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::metrics::{KindLabels, Metrics, RequestLabels};
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

/// Runs `precheck` (the peer address's token check, before anything is looked at), parses
/// `method`, `uri` and `?ns=` into a [`Request`] (pulls only; registries not mirrored are
/// refused), runs `answer` on it, and counts and logs what it answered.
pub(super) async fn handle<'a, F, Fut>(
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
    let response = match request {
        Ok(request) => answer(request).await.unwrap_or_else(|e| e.into_response()),
        Err(e) => e.into_response(),
    };
    let status = response.status().as_u16();
    metrics
        .requests
        .get_or_create(&RequestLabels {
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
