//! A blob body fed by peers: streams the first provider's bytes through and, if that peer
//! fails, stalls or ends early, asks the next provider for the rest with a `Range` from the
//! byte offset already sent. A whole blob is hashed on the way, and its last chunk is only
//! sent once the digest matches: otherwise containerd sees a body cut short (a reset
//! connection), never a complete body with wrong bytes.

use std::collections::VecDeque;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};

use super::peer_fetch::Resumer;
use crate::oci::Digest;
use crate::oci::digest::Hasher;
use crate::routing::Peer;

/// What is being transferred: `len` bytes from `start` of a blob of `total` bytes.
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
    /// Reads the transfer's extent from a peer's 200 or 206 response.
    pub(super) fn from_response(response: &reqwest::Response, digest: Digest) -> Option<Fetch> {
        let len = response.content_length()?;
        if response.status() == reqwest::StatusCode::PARTIAL_CONTENT {
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
    current: BoxStream<'static, reqwest::Result<Bytes>>,
    remaining: VecDeque<Peer>,
    resumer: Resumer,
    sent: u64,
    /// Only for whole blobs: a range cannot be checked against the blob's digest.
    hasher: Option<Hasher>,
}

impl ResumingBody {
    pub(super) fn new(
        fetch: Fetch,
        peer: Peer,
        first: BoxStream<'static, reqwest::Result<Bytes>>,
        remaining: Vec<Peer>,
        resumer: Resumer,
    ) -> Self {
        let hasher = (!fetch.partial).then(|| fetch.digest.hasher());
        ResumingBody {
            fetch,
            peer,
            current: first,
            remaining: remaining.into(),
            resumer,
            sent: 0,
            hasher,
        }
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
        loop {
            if self.sent == self.fetch.len {
                return self.finish().map(|()| None);
            }
            let failure = match tokio::time::timeout(
                self.resumer.idle_timeout(),
                self.current.next(),
            )
            .await
            {
                Ok(Some(Ok(chunk))) if chunk.is_empty() => continue,
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
                    // The last chunk is held back until the whole blob checks out: once every
                    // announced byte is sent the client has a complete body, and a reset after
                    // that would come too late.
                    if self.sent == self.fetch.len {
                        self.finish()?;
                    }
                    return Ok(Some(chunk));
                }
                Ok(Some(Err(e))) => e.to_string(),
                Ok(None) => "body ended early".to_string(),
                Err(_) => "stalled".to_string(),
            };
            self.resumer.failed(&self.peer, "body", &failure);
            self.resume().await?;
        }
    }

    /// Moves to the next provider for the bytes not yet sent.
    async fn resume(&mut self) -> std::io::Result<()> {
        let from = self.fetch.start + self.sent;
        let to = self.fetch.start + self.fetch.len - 1;
        while let Some(next) = self.remaining.pop_front() {
            if self.resumer.quarantined(&next) {
                continue;
            }
            let Some(response) = self.resumer.request(&next, from, to).await else {
                continue;
            };
            let extent = response
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(content_range);
            if extent != Some((from, to, self.fetch.total)) {
                self.resumer
                    .failed(&next, "status", "resumed with the wrong range");
                continue;
            }
            tracing::info!(digest = %self.fetch.digest, offset = from, peer = %next.id, "resuming blob on the next provider");
            self.current = response.bytes_stream().boxed();
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
        self.resumer
            .failed(&self.peer, "verify", "bytes do not match the digest");
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
