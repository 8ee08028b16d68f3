//! Every way a registry request can fail, as a status and the spec's JSON body, in one place.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::oci::{ErrorCode, PathError, RangeError, error_body};
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error(transparent)]
    Range(#[from] RangeError),
    #[error("manifest unknown")]
    ManifestUnknown,
    #[error("blob unknown")]
    BlobUnknown,
    #[error("registry {0:?} is not mirrored by this node")]
    NotMirrored(String),
    #[error("invalid ns parameter: {0}")]
    BadNamespace(&'static str),
    #[error("a pull-through mirror does not support this operation")]
    Unsupported,
    #[error("ferry serves pulls only: method not allowed")]
    MethodNotAllowed,
    /// The same answer whatever was wrong: nothing about what exists.
    #[error("authentication required")]
    Unauthorized,
    /// A header value is not valid HTTP: a miss, never an empty success.
    #[error("the answer could not be built: {0}")]
    Build(#[from] axum::http::Error),
}

impl ApiError {
    /// A store failure is a miss, so containerd moves on at once.
    pub fn manifest(e: StoreError) -> Self {
        log_store_error(&e);
        ApiError::ManifestUnknown
    }

    pub fn blob(e: StoreError) -> Self {
        log_store_error(&e);
        ApiError::BlobUnknown
    }

    fn status_and_code(&self) -> (StatusCode, ErrorCode) {
        match self {
            ApiError::Path(PathError::UnknownEndpoint) => {
                (StatusCode::NOT_FOUND, ErrorCode::Unsupported)
            }
            ApiError::Path(PathError::NameInvalid(_)) => {
                (StatusCode::BAD_REQUEST, ErrorCode::NameInvalid)
            }
            ApiError::Path(PathError::TagInvalid(_)) => {
                (StatusCode::BAD_REQUEST, ErrorCode::ManifestInvalid)
            }
            ApiError::Path(PathError::DigestInvalid(_)) => {
                (StatusCode::BAD_REQUEST, ErrorCode::DigestInvalid)
            }
            ApiError::Range(RangeError::Unsatisfiable { .. }) => {
                (StatusCode::RANGE_NOT_SATISFIABLE, ErrorCode::Unsupported)
            }
            ApiError::Range(_) => (StatusCode::BAD_REQUEST, ErrorCode::Unsupported),
            ApiError::ManifestUnknown => (StatusCode::NOT_FOUND, ErrorCode::ManifestUnknown),
            ApiError::BlobUnknown => (StatusCode::NOT_FOUND, ErrorCode::BlobUnknown),
            ApiError::NotMirrored(_) => (StatusCode::NOT_FOUND, ErrorCode::NameUnknown),
            ApiError::BadNamespace(_) => (StatusCode::BAD_REQUEST, ErrorCode::NameInvalid),
            ApiError::Unsupported => (StatusCode::NOT_FOUND, ErrorCode::Unsupported),
            ApiError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, ErrorCode::Unsupported),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized),
            ApiError::Build(_) => (StatusCode::NOT_FOUND, ErrorCode::BlobUnknown),
        }
    }
}

fn log_store_error(e: &StoreError) {
    match e {
        StoreError::NotFound => {}
        StoreError::Unavailable(reason) => {
            tracing::debug!(%reason, "content store unavailable; answering 404")
        }
        StoreError::Io(err) => {
            tracing::warn!(error = %err, "content store I/O error; answering 404")
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Build(e) = &self {
            tracing::error!(error = %e, "an answer could not be built; answering 404");
        }
        let (status, code) = self.status_and_code();
        let mut response = (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            error_body(code, &self.to_string()),
        )
            .into_response();
        if let ApiError::Range(RangeError::Unsatisfiable { size }) = self
            && let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}"))
        {
            response.headers_mut().insert(header::CONTENT_RANGE, v);
        }
        if matches!(self, ApiError::MethodNotAllowed) {
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        response
    }
}
