//! A blob body fed by peers: streams the first provider's bytes and, if it fails, stalls or
//! ends early, resumes on the next one with a `Range` from the byte already sent.
//!
//! Invariant: a whole blob's last chunk, or a resumed tail's (checked with containerd's partial
//! download before it), is sent only once its digest matches, so containerd sees a cut body,
//! never a complete wrong one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};

use super::client::{PeerCall, PeerClient};
use super::failure::PeerFailure;
use super::floor::Floor;
use super::health::PeerHealth;
use super::response::PeerResponse;
use crate::metrics::Metrics;
use crate::oci::digest::Hasher;
use crate::oci::{self, Digest};
use crate::routing::Peer;
use crate::store::ContentStore;
use crate::store::downloads::InFlight;

/// containerd may reopen its partial download after we drop it: drop it again after these
/// delays (a timing assumption).
const DISCARD_PARTIAL_AFTER: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(3),
];

#[derive(Clone)]
pub(super) struct Resume {
    pub client: PeerClient,
    pub health: Arc<PeerHealth>,
    pub metrics: Arc<Metrics>,
    /// To drop what a lying peer left in containerd's partial downloads.
    pub store: Arc<dyn ContentStore>,
    pub path: String,
    pub ns: Option<String>,
}

impl Resume {
    /// `bytes=<start>-<end>` from `peer`: its 206, or why not.
    async fn request(
        &self,
        peer: &Peer,
        start: u64,
        end: u64,
    ) -> Result<PeerResponse, PeerFailure> {
        let range = format!("bytes={start}-{end}");
        let call = PeerCall {
            method: &Method::GET,
            path: &self.path,
            ns: self.ns.as_deref(),
            range: Some(&range),
            follow: None,
        };
        let response = self.client.send(peer, call, &self.metrics).await?;
        if response.status() != StatusCode::PARTIAL_CONTENT {
            return Err(PeerFailure::Status(response.status()));
        }
        Ok(response)
    }

    /// Drops containerd's partial download of `digest`, so a retry does not build on bad bytes.
    pub(super) fn discard_partial(&self, digest: &Digest) {
        let store = self.store.clone();
        let digest = digest.clone();
        let detected = std::time::SystemTime::now();
        tokio::spawn(async move {
            for delay in DISCARD_PARTIAL_AFTER {
                tokio::time::sleep(delay).await;
                match store.discard_partial(&digest, detected).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::warn!(%digest, partial_downloads = n, "dropped containerd's partial download of a corrupt blob")
                    }
                    Err(e) => {
                        tracing::warn!(%digest, error = %e, "cannot drop containerd's partial download")
                    }
                }
            }
        });
    }
}

/// `len` bytes from `start` of a blob of `total` bytes.
#[derive(Debug, Clone)]
pub(super) struct Fetch {
    pub digest: Digest,
    pub start: u64,
    pub len: u64,
    pub total: u64,
    /// A range was asked for (206), rather than the whole blob (200).
    pub partial: bool,
}

impl Fetch {
    pub(super) fn from_response(response: &PeerResponse, digest: Digest) -> Option<Fetch> {
        let len = response.content_length()?;
        if response.status() == StatusCode::PARTIAL_CONTENT {
            let (start, end, total) =
                content_range(response.headers().get("content-range")?.to_str().ok()?)?;
            (end + 1 - start == len).then_some(Fetch {
                digest,
                start,
                len,
                total,
                partial: true,
            })
        } else {
            Some(Fetch {
                digest,
                start: 0,
                len,
                total: len,
                partial: false,
            })
        }
    }
}

impl Fetch {
    pub(super) fn response(&self, body: Body) -> Result<Response, axum::http::Error> {
        let mut out = Response::builder()
            .status(if self.partial {
                StatusCode::PARTIAL_CONTENT
            } else {
                StatusCode::OK
            })
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, self.len)
            .header(header::ACCEPT_RANGES, "bytes")
            .header(oci::DOCKER_CONTENT_DIGEST, self.digest.to_string());
        if self.partial
            && let Ok(v) = HeaderValue::from_str(&format!(
                "bytes {}-{}/{}",
                self.start,
                self.start + self.len - 1,
                self.total
            ))
        {
            out = out.header(header::CONTENT_RANGE, v);
        }
        out.body(body)
    }
}

/// `bytes a-b/total` -> (a, b, total).
pub(super) fn content_range(v: &str) -> Option<(u64, u64, u64)> {
    let (range, total) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b, total) = (a.parse().ok()?, b.parse().ok()?, total.parse().ok()?);
    (a <= b && b < total).then_some((a, b, total))
}

pub(super) struct ResumingBody {
    fetch: Fetch,
    peer: Peer,
    current: BoxStream<'static, std::io::Result<Bytes>>,
    remaining: VecDeque<Peer>,
    resumer: Resume,
    sent: u64,
    /// For whole blobs and resumed tails: another range cannot be checked against the digest.
    hasher: Option<Hasher>,
    /// The partial download whose bytes come before a resumed tail, hashed first.
    prefix: Option<InFlight>,
    floor: Floor,
}

impl ResumingBody {
    pub(super) fn new(
        fetch: Fetch,
        (peer, first): (Peer, BoxStream<'static, std::io::Result<Bytes>>),
        remaining: Vec<Peer>,
        resumer: Resume,
    ) -> Self {
        let hasher = (!fetch.partial).then(|| fetch.digest.hasher());
        let floor = Floor::new(resumer.client.idle);
        ResumingBody {
            fetch,
            peer,
            current: first,
            remaining: remaining.into(),
            resumer,
            sent: 0,
            hasher,
            prefix: None,
            floor,
        }
    }

    /// A tail checked with the partial download that holds the bytes before it.
    pub(super) fn checked_with(mut self, prefix: Option<InFlight>) -> Self {
        if prefix.is_some() {
            self.hasher = Some(self.fetch.digest.hasher());
            self.prefix = prefix;
        }
        self
    }

    /// Hashes the first `fetch.start` bytes of the partial download.
    async fn hash_prefix(&mut self, download: InFlight) -> std::io::Result<()> {
        let Some(hasher) = self.hasher.as_mut() else {
            return Ok(());
        };
        let mut stream = download.read_from(0, self.resumer.client.idle).await?;
        let mut left = self.fetch.start;
        while left > 0 {
            let chunk = stream
                .next()
                .await
                .ok_or_else(|| std::io::Error::other("the partial download ended early"))??;
            let take = chunk.len().min(left as usize);
            hasher.update(&chunk[..take]);
            left -= take as u64;
        }
        Ok(())
    }

    pub(super) fn into_stream(self) -> impl Stream<Item = std::io::Result<Bytes>> + Send + 'static {
        futures::stream::unfold(Some(self), |state| async move {
            let mut body = state?;
            match body.next_chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), Some(body))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
    }

    async fn next_chunk(&mut self) -> std::io::Result<Option<Bytes>> {
        if let Some(download) = self.prefix.take() {
            self.hash_prefix(download).await?;
        }
        loop {
            if self.sent == self.fetch.len {
                return self.finish().map(|()| None);
            }
            let failure = match tokio::time::timeout(self.resumer.client.idle, self.current.next())
                .await
            {
                Ok(Some(Ok(chunk))) if chunk.is_empty() => continue,
                // Dropped: the next provider resumes from what was sent.
                Ok(Some(Ok(chunk))) if !self.floor.keeps_up(chunk.len()) => "too slow".to_string(),
                Ok(Some(Ok(chunk))) => {
                    // Never more than was announced, whatever a peer sends.
                    let room = (self.fetch.len - self.sent) as usize;
                    let chunk = if chunk.len() > room {
                        chunk.slice(..room)
                    } else {
                        chunk
                    };
                    self.sent += chunk.len() as u64;
                    if let Some(h) = self.hasher.as_mut() {
                        h.update(&chunk);
                    }
                    // The last chunk waits for the digest: once every announced
                    // byte is sent, a reset comes too late.
                    if self.sent == self.fetch.len {
                        self.finish()?;
                    }
                    return Ok(Some(chunk));
                }
                Ok(Some(Err(e))) => e.to_string(),
                Ok(None) => "ended early".to_string(),
                Err(_) => "stalled".to_string(),
            };
            self.resumer
                .health
                .failed(&self.peer, &PeerFailure::Body(failure));
            self.floor = Floor::new(self.resumer.client.idle);
            self.resume().await?;
        }
    }

    async fn resume(&mut self) -> std::io::Result<()> {
        let from = self.fetch.start + self.sent;
        let to = self.fetch.start + self.fetch.len - 1;
        while let Some(next) = self.remaining.pop_front() {
            if self.resumer.health.quarantined(&next) {
                continue;
            }
            let response = match self.resumer.request(&next, from, to).await {
                Ok(r) => r,
                Err(failure) => {
                    self.resumer.health.failed(&next, &failure);
                    continue;
                }
            };
            let extent = response
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(content_range);
            if extent != Some((from, to, self.fetch.total)) {
                self.resumer.health.failed(&next, &PeerFailure::Extent);
                continue;
            }
            tracing::info!(digest = %self.fetch.digest, offset = from, peer = %next.id, "resuming blob on the next provider");
            self.current = response.bytes_stream();
            self.peer = next;
            return Ok(());
        }
        Err(std::io::Error::other(format!(
            "{}: every provider failed mid-transfer at byte {from}",
            self.fetch.digest
        )))
    }

    fn finish(&mut self) -> std::io::Result<()> {
        let Some(hasher) = self.hasher.take() else {
            return Ok(());
        };
        if hasher.matches(&self.fetch.digest) {
            return Ok(());
        }
        self.resumer.health.failed(
            &self.peer,
            &PeerFailure::Verify(self.fetch.digest.to_string()),
        );
        self.resumer.discard_partial(&self.fetch.digest);
        tracing::error!(digest = %self.fetch.digest, "blob from peers does not match its digest; transfer aborted");
        Err(std::io::Error::other("digest mismatch"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges() {
        assert_eq!(content_range("bytes 0-9/100"), Some((0, 9, 100)));
        assert_eq!(content_range("bytes 9-0/100"), None);
        assert_eq!(content_range("bytes 0-100/100"), None);
        assert_eq!(content_range("bytes */100"), None);
        assert_eq!(content_range("items 0-1/2"), None);
    }
}
