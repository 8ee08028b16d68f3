//! A peer's answer, as a plain HTTP response or the raw bytes after a `101` of `zero_copy.rs`
//! with the status and headers the peer would have sent: callers handle both alike.

use std::io;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use tokio::io::AsyncReadExt;
use tokio_util::io::ReaderStream;

use super::failure::{PeerFailure, PeerMiss};

/// Large reads keep per-chunk work small next to the bytes.
const RAW_READ_BYTES: usize = 256 * 1024;

pub struct PeerResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: BoxStream<'static, io::Result<Bytes>>,
}

impl std::fmt::Debug for PeerResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerResponse")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl PeerResponse {
    /// A 101 of the zero-copy protocol is taken over; anything else is kept.
    pub async fn read(response: reqwest::Response) -> Result<PeerResponse, PeerFailure> {
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            return Ok(PeerResponse {
                status: response.status(),
                headers: response.headers().clone(),
                body: response.bytes_stream().map_err(io::Error::other).boxed(),
            });
        }
        let mut headers = response.headers().clone();
        let number = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        };
        let protocol = headers.get(header::UPGRADE).and_then(|v| v.to_str().ok());
        let (Some(status), Some(len), true) = (
            number(crate::wire::ZERO_COPY_STATUS_HEADER)
                .and_then(|s| StatusCode::from_u16(s as u16).ok()),
            number(crate::wire::ZERO_COPY_LENGTH_HEADER),
            protocol.is_some_and(|p| p.eq_ignore_ascii_case(crate::wire::ZERO_COPY_PROTOCOL)),
        ) else {
            return Err(PeerFailure::Status(StatusCode::SWITCHING_PROTOCOLS));
        };
        let upgraded = response
            .upgrade()
            .await
            .map_err(|e| PeerFailure::Connect(e.to_string()))?;
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        for name in [
            crate::wire::ZERO_COPY_STATUS_HEADER,
            crate::wire::ZERO_COPY_LENGTH_HEADER,
        ] {
            headers.remove(name);
        }
        for name in [header::UPGRADE, header::CONNECTION] {
            headers.remove(name);
        }
        // Exactly the announced bytes; a short body ends early (the caller resumes elsewhere).
        let body = ReaderStream::with_capacity(upgraded.take(len), RAW_READ_BYTES).boxed();
        Ok(PeerResponse {
            status,
            headers,
            body,
        })
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    pub fn content_length(&self) -> Option<u64> {
        self.headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }

    pub fn bytes_stream(self) -> BoxStream<'static, io::Result<Bytes>> {
        self.body
    }
}

/// A peer's answer, or a miss when it could not be built: never an empty success.
pub(super) fn built(answer: Result<Response, axum::http::Error>) -> Result<Response, PeerMiss> {
    answer.map_err(|e| {
        tracing::warn!(error = %e, "a peer's answer could not be passed on");
        PeerMiss::Unbuildable
    })
}
