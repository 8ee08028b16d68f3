//! Serving from this node's own content store, for both addresses.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::TryStreamExt;

use super::ApiError;

use super::zero_copy;
use crate::metrics::{LookupLabels, Metrics, SourceLabels};
use crate::oci::manifest::{MAX_MANIFEST_BYTES, is_manifest_media_type, sniff_media_type};
use crate::oci::{self, Digest, Reference};
use crate::store::{ContentStore, StoreError};

#[derive(Clone)]
pub(super) struct Local {
    pub store: Arc<dyn ContentStore>,
    pub metrics: Arc<Metrics>,
}

impl Local {
    /// A manifest by digest, or by tag (the peer address only).
    pub(super) async fn manifest(
        &self,
        head: bool,
        ns: Option<&str>,
        name: &str,
        reference: Reference,
    ) -> Result<Response, ApiError> {
        let (digest, declared) = match reference {
            Reference::Tag(tag) => {
                // Without the registry, `name:tag` is ambiguous: a miss.
                let ns = ns.ok_or(ApiError::ManifestUnknown)?;
                let found = self.store.resolve(ns, name, &tag).await;
                self.record("manifest", &found);
                let desc = found.map_err(ApiError::manifest)?;
                (desc.digest, desc.media_type)
            }
            Reference::Digest(digest) => (digest, None),
        };
        self.manifest_by_digest(head, digest, declared).await
    }

    async fn manifest_by_digest(
        &self,
        head: bool,
        digest: Digest,
        declared: Option<String>,
    ) -> Result<Response, ApiError> {
        let found = self.store.descriptor(&digest).await;
        if declared.is_none() {
            self.record("manifest", &found);
        }
        let desc = found.map_err(ApiError::manifest)?;
        if desc.size > MAX_MANIFEST_BYTES {
            return Err(ApiError::ManifestUnknown);
        }
        let stream = self
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
            return Ok(response.body(Body::empty())?);
        }
        response = response.header(header::ETAG, format!("\"{digest}\""));
        Ok(response.body(Body::from(bytes))?)
    }

    /// A blob, whole or a range; by `sendfile` when `zero_copy` was offered and it is large.
    pub(super) async fn blob(
        &self,
        head: bool,
        headers: &HeaderMap,
        digest: &Digest,
        zero_copy: Option<zero_copy::Upgrade>,
    ) -> Result<Response, ApiError> {
        let found = self.store.descriptor(digest).await;
        self.record("blob", &found);
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
            return Ok(response.body(Body::empty())?);
        }
        if let Some(upgrade) = zero_copy
            && length >= zero_copy::MIN_BYTES
            && let Some(file) = self.file(digest, desc.size).await
        {
            let send = zero_copy::FileSend {
                file,
                offset: range.map_or(0, |r| r.start),
                len: length,
                idle: zero_copy::SEND_IDLE,
                counters: [self.peer_bytes(), self.metrics.zero_copy_bytes.clone()],
            };
            return Ok(zero_copy::switch(status, response, upgrade, send)?);
        }
        let stream = self
            .store
            .open(digest, range)
            .await
            .map_err(ApiError::blob)?;
        // Content-Length is set: a stream that errors drops the connection, never a short blob.
        let body = Body::from_stream(stream);
        Ok(response.body(body)?)
    }

    /// The blob's committed file, if it is the size the store says.
    async fn file(&self, digest: &Digest, size: u64) -> Option<std::fs::File> {
        let path = self.store.blob_file(digest)?;
        let file = tokio::fs::File::open(path).await.ok()?;
        let actual = file.metadata().await.ok()?.len();
        (actual == size).then_some(file.into_std().await)
    }

    /// The peer address's served bytes of local blobs, counted past hyper.
    fn peer_bytes(&self) -> prometheus_client::metrics::counter::Counter {
        self.metrics
            .served_bytes
            .get_or_create(&SourceLabels {
                listener: "peer",
                kind: "blob",
                source: "local",
            })
            .clone()
    }

    fn record<T>(&self, kind: &'static str, found: &Result<T, StoreError>) {
        let result = match found {
            Ok(_) => "hit",
            Err(StoreError::NotFound) => "miss",
            Err(_) => "unavailable",
        };
        self.metrics
            .lookups
            .get_or_create(&LookupLabels { kind, result })
            .inc();
    }
}
