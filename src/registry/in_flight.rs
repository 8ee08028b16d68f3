//! Answers out of a download in progress, to a follower (peer address) or to a second request
//! of this node's containerd (mirror). Invariant: one place opens a download ([`open`]) and
//! one answers from it ([`respond`]).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use futures::TryStreamExt;
use prometheus_client::metrics::counter::Counter;

use tokio::time::Instant;

use super::ApiError;
use crate::oci::manifest::{MAX_MANIFEST_BYTES, sniff_media_type};
use crate::oci::range::{self, ByteRange};
use crate::oci::{DOCKER_CONTENT_DIGEST, Digest};
use crate::store::downloads::{self, InFlight};
use crate::store::{ByteStream, ContentStore, StoreError};

/// A download landing nothing this long is given up on (as `--peer-idle-timeout`).
pub(super) const IDLE: Duration = Duration::from_secs(5);

/// containerd renames a download into place before it records the commit, so a landed blob
/// may be unknown to it for a moment: asked again this often, this many times.
pub(super) const COMMIT_RECORD_POLL: Duration = Duration::from_millis(10);
pub(super) const COMMIT_RECORD_TRIES: usize = 50;

/// Only ranges to the end (containerd resumes with `bytes=<offset>-`) come from a download.
pub(super) fn range_to_end(headers: &HeaderMap, total: u64) -> Result<Option<ByteRange>, ApiError> {
    let Some(v) = headers.get(header::RANGE) else {
        return Ok(None);
    };
    let v = v
        .to_str()
        .map_err(|_| crate::oci::RangeError::Malformed("not ASCII"))?;
    let r = range::parse(v, total)?;
    if r.start + r.len() != total {
        return Err(ApiError::BlobUnknown);
    }
    Ok(Some(r))
}

pub(super) struct InFlightBody {
    pub stream: ByteStream,
    pub total: u64,
    pub range: Option<ByteRange>,
}

pub(super) enum Opened {
    Body(InFlightBody),
    /// Landed before it could be opened: answer from the landed blob.
    Landed,
    /// Nothing landed before the deadline: not to be followed.
    Stalled,
}

/// Opens `download` from the request's range on. With `alive_by`, only a download alive by
/// then: a follower whose leader has nothing hears so in time to go upstream itself.
pub(super) async fn open(
    download: &InFlight,
    headers: &HeaderMap,
    alive_by: Option<Instant>,
) -> Result<Opened, ApiError> {
    let total = download.total();
    let range = range_to_end(headers, total)?;
    let start = range.map_or(0, |r| r.start);
    if let Some(deadline) = alive_by
        && !downloads::alive(download.as_ref(), start, IDLE, deadline).await
    {
        return Ok(if download.landed().await.is_none() {
            Opened::Landed
        } else {
            Opened::Stalled
        });
    }
    match download.read_from(start, IDLE).await {
        Ok(stream) => Ok(Opened::Body(InFlightBody {
            stream,
            total,
            range,
        })),
        // Committed between being found and being opened, as a small blob often is.
        Err(e) => {
            tracing::debug!(error = %e, "the download landed before it was opened");
            Ok(Opened::Landed)
        }
    }
}

/// A landed blob, in any containerd namespace, from the request's range on.
pub(super) async fn open_landed(
    store: &dyn ContentStore,
    digest: &Digest,
    headers: &HeaderMap,
) -> Result<InFlightBody, ApiError> {
    let total = store.landed(digest).await.ok_or(ApiError::BlobUnknown)?;
    let range = range_to_end(headers, total)?;
    let start = range.map_or(0, |r| r.start);
    let (stream, total) = store
        .open_landed(digest, start)
        .await
        .map_err(ApiError::blob)?;
    Ok(InFlightBody {
        stream,
        total,
        range,
    })
}

/// With `verify`, a blob is hashed on the way.
pub(super) async fn respond(
    head: bool,
    manifest: bool,
    digest: &Digest,
    body: InFlightBody,
    verify: bool,
    counter: Counter,
) -> Result<Response, ApiError> {
    if manifest {
        return self::manifest(head, digest, body.stream, body.total).await;
    }
    blob(head, digest, body, verify, counter)
}

/// A blob streamed as it lands; Content-Length is set, so an error cuts the connection.
fn blob(
    head: bool,
    digest: &Digest,
    body: InFlightBody,
    verify: bool,
    counter: Counter,
) -> Result<Response, ApiError> {
    let InFlightBody {
        stream,
        total,
        range,
    } = body;
    let len = range.map_or(total, |r| r.len());
    let mut response = Response::builder()
        .status(if range.is_some() {
            StatusCode::PARTIAL_CONTENT
        } else {
            StatusCode::OK
        })
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, len)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(DOCKER_CONTENT_DIGEST, digest.to_string());
    if let Some(r) = range
        && let Ok(v) = HeaderValue::from_str(&r.content_range(total))
    {
        response = response.header(header::CONTENT_RANGE, v);
    }
    if head {
        return Ok(response.body(Body::empty())?);
    }
    let stream = if verify && range.is_none() {
        downloads::verified(stream, digest.clone(), total)
    } else {
        stream
    };
    let body = Body::from_stream(stream.inspect_ok(move |c| {
        counter.inc_by(c.len() as u64);
    }));
    Ok(response.body(body)?)
}

/// Manifests are small: read whole and checked.
async fn manifest(
    head: bool,
    digest: &Digest,
    stream: ByteStream,
    total: u64,
) -> Result<Response, ApiError> {
    if total > MAX_MANIFEST_BYTES {
        return Err(ApiError::ManifestUnknown);
    }
    let bytes: Vec<u8> = stream
        .try_fold(Vec::new(), |mut all, c| async move {
            all.extend_from_slice(&c);
            Ok(all)
        })
        .await
        .map_err(|e| ApiError::manifest(StoreError::Io(e)))?;
    if !digest.matches(&bytes) {
        return Err(ApiError::ManifestUnknown);
    }
    let media_type = sniff_media_type(&bytes).ok_or(ApiError::ManifestUnknown)?;
    let response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, media_type)
        .header(header::CONTENT_LENGTH, bytes.len())
        .header(DOCKER_CONTENT_DIGEST, digest.to_string());
    let body = if head {
        Body::empty()
    } else {
        Body::from(bytes)
    };
    Ok(response.body(body)?)
}
