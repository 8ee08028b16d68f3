//! What a relay serves its followers: its containerd's download, then a window of the bytes
//! containerd has not written yet (it buffers 1 MiB per write; `docs/design/relays.md`).
//!
//! Invariant: the window holds only bytes of this blob that passed through this node, in
//! order, at most [`WINDOW`] of them; a reader gets each byte once, from the download or the
//! window, and ends in an error, never short. A follower this relay feeds far slower than it
//! is fed itself is given up and sent away ([`Received::gave_up`]): it re-attaches elsewhere.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::store::ByteStream;
use crate::store::downloads::{Download, InFlight};

/// The newest bytes kept: containerd's unwritten 1 MiB buffer and a socket's worth, with room.
pub(crate) const WINDOW: u64 = 4 << 20;
const CHUNK: usize = 256 << 10;
/// How often a reader waiting at the window's end also checks the download.
const FILE_POLL: Duration = Duration::from_millis(50);
/// A follower is measured over this long: long enough that a link shared with a few other
/// layers for a moment does not count as slow.
const SLOW_PERIOD: Duration = Duration::from_secs(5);
/// A follower further behind what this relay has received than the window holds, ...
const SLOW_LAG: u64 = WINDOW;
/// ... and fed at under a quarter of the best rate this relay was fed itself, is given up:
/// this relay (its link or its CPU) holds its whole subtree back.
const SLOW_RATIO: u64 = 4;

/// The bytes of one blob this node is receiving as a follower, newest [`WINDOW`] of them.
#[derive(Debug)]
pub(crate) struct Received {
    total: u64,
    state: Mutex<Window>,
    end: watch::Sender<u64>,
    /// Followers given up as too slow for this relay: their next follow request is refused.
    given_up: Mutex<HashSet<String>>,
}

#[derive(Debug)]
struct Window {
    start: u64,
    chunks: VecDeque<Bytes>,
    last: Instant,
}

impl Received {
    pub(crate) fn new(total: u64, start: u64) -> Received {
        Received {
            total,
            state: Mutex::new(Window {
                start,
                chunks: VecDeque::new(),
                last: Instant::now(),
            }),
            end: watch::Sender::new(start),
            given_up: Mutex::default(),
        }
    }

    /// Whether `follower` was given up as too slow for this relay.
    pub(crate) fn gave_up(&self, follower: &str) -> bool {
        let given_up = self.given_up.lock().unwrap_or_else(|e| e.into_inner());
        given_up.contains(follower)
    }

    fn give_up(&self, follower: &str) {
        let mut given_up = self.given_up.lock().unwrap_or_else(|e| e.into_inner());
        given_up.insert(follower.to_string());
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn end(&self) -> u64 {
        *self.end.borrow()
    }

    fn start(&self) -> u64 {
        self.lock().start
    }

    /// containerd asked again with a Range from `offset`: bytes past it are dropped (they come
    /// again); a gap before it is in the download already.
    pub(crate) fn resume_at(&self, offset: u64) {
        let mut w = self.lock();
        let end = self.end();
        if offset < w.start || offset > end {
            w.chunks.clear();
            w.start = offset;
        } else {
            let mut keep = offset - w.start;
            let mut kept = VecDeque::new();
            for c in w.chunks.drain(..) {
                if keep == 0 {
                    break;
                }
                let take = (c.len() as u64).min(keep);
                kept.push_back(c.slice(..take as usize));
                keep -= take;
            }
            w.chunks = kept;
        }
        self.end.send_replace(offset);
    }

    fn push(&self, bytes: &Bytes) {
        if bytes.is_empty() {
            return;
        }
        let mut w = self.lock();
        w.chunks.push_back(bytes.clone());
        w.last = Instant::now();
        let end = self.end() + bytes.len() as u64;
        while let Some(front) = w.chunks.front() {
            let after = w.start + front.len() as u64;
            if end - after < WINDOW {
                break;
            }
            w.start = after;
            w.chunks.pop_front();
        }
        drop(w);
        self.end.send_replace(end);
    }

    /// Up to `max` bytes from `pos`, if the window holds `pos`.
    fn slice(&self, pos: u64, max: usize) -> Option<Bytes> {
        let w = self.lock();
        let mut at = w.start;
        for c in &w.chunks {
            let next = at + c.len() as u64;
            if pos < next && pos >= at {
                let from = (pos - at) as usize;
                let to = c.len().min(from + max);
                return Some(c.slice(from..to));
            }
            at = next;
        }
        None
    }

    fn received_within(&self, live: Duration) -> bool {
        self.lock().last.elapsed() < live
    }

    /// Whether the window can go: complete longer ago than `done`, or idle for `stale`.
    pub(crate) fn spent(&self, done: Duration, stale: Duration) -> bool {
        let quiet_for = |d| !self.received_within(d);
        (self.end() == self.total && quiet_for(done)) || quiet_for(stale)
    }
}

/// `response` with every byte it passes on kept in `received`; unchanged unless it is a
/// whole blob or a range to its end.
pub(crate) fn tee(response: Response, received: &Arc<Received>) -> Response {
    let start = match response.status() {
        StatusCode::OK => 0,
        StatusCode::PARTIAL_CONTENT => match content_range_start(&response) {
            Some(start) => start,
            None => return response,
        },
        _ => return response,
    };
    received.resume_at(start);
    let received = received.clone();
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        if let Ok(bytes) = &chunk {
            received.push(bytes);
        }
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// The blob's size from a follow answer: `Content-Range`'s total, or the whole length.
pub(crate) fn blob_total(response: &Response) -> Option<u64> {
    let headers = response.headers();
    if response.status() == StatusCode::PARTIAL_CONTENT {
        let range = headers.get(header::CONTENT_RANGE)?.to_str().ok()?;
        return range.rsplit('/').next()?.parse().ok();
    }
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn content_range_start(response: &Response) -> Option<u64> {
    let range = response
        .headers()
        .get(header::CONTENT_RANGE)?
        .to_str()
        .ok()?;
    let range = range.strip_prefix("bytes ")?;
    range.split('-').next()?.parse().ok()
}

/// A relay's download as one follower reads it: containerd's, then the window.
#[derive(Debug)]
pub(crate) struct Relayed {
    pub(crate) ingest: InFlight,
    pub(crate) received: Arc<Received>,
    pub(crate) follower: String,
    /// Counts followers given up as too slow.
    pub(crate) slow: Counter,
}

#[async_trait::async_trait]
impl Download for Relayed {
    fn total(&self) -> u64 {
        self.ingest.total()
    }

    async fn landed(&self) -> Option<u64> {
        let landed = self.ingest.landed().await?;
        Some(landed.max(self.received.end()))
    }

    async fn written_within(&self, live: Duration) -> bool {
        self.received.received_within(live) || self.ingest.written_within(live).await
    }

    async fn read_from(&self, offset: u64, idle: Duration) -> std::io::Result<ByteStream> {
        let reader = Reader {
            ingest: self.ingest.clone(),
            received: self.received.clone(),
            end: self.received.end.subscribe(),
            file: None,
            pos: offset,
            total: self.ingest.total(),
            idle,
            pace: Pace::new(offset, self.received.end()),
            follower: self.follower.clone(),
            slow: self.slow.clone(),
        };
        Ok(Box::pin(futures::stream::unfold(
            Some(reader),
            |reader| async move {
                let mut reader = reader?;
                match reader.next().await {
                    Ok(Some(chunk)) => Some((Ok(chunk), Some(reader))),
                    Ok(None) => None,
                    Err(e) => Some((Err(e), None)),
                }
            },
        )))
    }
}

struct Reader {
    ingest: InFlight,
    received: Arc<Received>,
    end: watch::Receiver<u64>,
    /// The download from `pos`; dropped when the window serves (its position is stale).
    file: Option<ByteStream>,
    pos: u64,
    total: u64,
    idle: Duration,
    pace: Pace,
    follower: String,
    slow: Counter,
}

/// How fast this relay feeds one follower against how fast it was fed itself.
#[derive(Debug)]
struct Pace {
    since: Instant,
    pos: u64,
    end: u64,
    /// The most this relay received in one period so far.
    best_in: u64,
}

impl Pace {
    fn new(pos: u64, end: u64) -> Pace {
        Pace {
            since: Instant::now(),
            pos,
            end,
            best_in: 0,
        }
    }

    /// At the end of each period: whether the follower at `pos` is too slow for a relay that
    /// has received up to `end`.
    fn too_slow(&mut self, pos: u64, end: u64) -> bool {
        if self.since.elapsed() < SLOW_PERIOD {
            return false;
        }
        let sent = pos.saturating_sub(self.pos);
        self.best_in = self.best_in.max(end.saturating_sub(self.end));
        *self = Pace {
            since: Instant::now(),
            pos,
            end,
            best_in: self.best_in,
        };
        end.saturating_sub(pos) > SLOW_LAG && sent.saturating_mul(SLOW_RATIO) < self.best_in
    }
}

impl Reader {
    async fn next(&mut self) -> std::io::Result<Option<Bytes>> {
        if self.pace.too_slow(self.pos, self.received.end()) {
            self.received.give_up(&self.follower);
            self.slow.inc();
            tracing::info!(follower = %self.follower, at = self.pos, behind = self.received.end().saturating_sub(self.pos), "a follower this relay feeds far slower than it is fed: sent elsewhere");
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the follower falls ever further behind this relay",
            ));
        }
        let mut waited_since = Instant::now();
        loop {
            if self.pos >= self.total {
                return Ok(None);
            }
            if let Some(bytes) = self.received.slice(self.pos, CHUNK) {
                self.file = None;
                self.pos += bytes.len() as u64;
                return Ok(Some(bytes));
            }
            if let Some(file) = self.file.as_mut() {
                tokio::select! {
                    chunk = file.next() => match chunk {
                        Some(Ok(bytes)) => {
                            self.pos += bytes.len() as u64;
                            return Ok(Some(bytes));
                        }
                        Some(Err(e)) => return Err(e),
                        None => return Ok(None),
                    },
                    _ = self.end.changed() => continue,
                }
            }
            // Older than the window, or written by containerd from elsewhere (this transfer
            // ended and containerd went on without it): the download has it.
            let in_file = self.ingest.landed().await.is_some_and(|l| l > self.pos);
            if in_file || self.pos < self.received.start() {
                self.file = Some(self.ingest.read_from(self.pos, self.idle).await?);
                continue;
            }
            if waited_since.elapsed() >= self.idle {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the relayed download made no progress",
                ));
            }
            if let Ok(Ok(())) = tokio::time::timeout(FILE_POLL, self.end.changed()).await {
                waited_since = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::Digest;
    use crate::store::ContentStore;
    use crate::store::downloads::Scope;
    use crate::store::memory::MemoryStore;

    fn blob() -> Vec<u8> {
        (0..(10u32 << 20)).map(|i| (i % 251) as u8).collect()
    }

    async fn read_all(stream: ByteStream) -> Vec<u8> {
        let chunks: Vec<Bytes> = stream.map(|c| c.unwrap()).collect().await;
        chunks.concat()
    }

    #[tokio::test]
    async fn a_follower_reads_the_download_then_what_containerd_has_not_written() {
        let data = blob();
        let digest = Digest::sha256_of(&data);
        let store = MemoryStore::new();
        let writer = store.start_download(&digest, data.len() as u64);
        let ingest = store.downloads(&digest, Scope::Namespace).await.remove(0);
        let received = Arc::new(Received::new(data.len() as u64, 0));
        let relayed = Relayed {
            ingest,
            received: received.clone(),
            follower: "f".into(),
            slow: Counter::default(),
        };
        // containerd has written 5 MiB; this node has received 7 MiB.
        writer.append(&data[..5 << 20]);
        for c in data[..7 << 20].chunks(64 << 10) {
            received.push(&Bytes::copy_from_slice(c));
        }
        let reader = relayed
            .read_from(1 << 20, Duration::from_secs(5))
            .await
            .unwrap();
        let reading = tokio::spawn(read_all(reader));
        tokio::time::sleep(Duration::from_millis(50)).await;
        for c in data[7 << 20..].chunks(64 << 10) {
            received.push(&Bytes::copy_from_slice(c));
        }
        writer.append(&data[5 << 20..]);
        writer.commit();
        let got = reading.await.unwrap();
        assert_eq!(got.len(), data.len() - (1 << 20));
        assert!(got == data[1 << 20..], "the bytes, in order, each once");
    }

    #[tokio::test]
    async fn a_follower_ahead_of_the_relay_waits_for_its_bytes_and_gives_up_after_idle() {
        let data = blob();
        let digest = Digest::sha256_of(&data);
        let store = MemoryStore::new();
        let _writer = store.start_download(&digest, data.len() as u64);
        let ingest = store.downloads(&digest, Scope::Namespace).await.remove(0);
        let received = Arc::new(Received::new(data.len() as u64, 0));
        let relayed = Relayed {
            ingest,
            received: received.clone(),
            follower: "f".into(),
            slow: Counter::default(),
        };
        received.push(&Bytes::copy_from_slice(&data[..1 << 20]));
        // Asked from 2 MiB, not received yet: it waits.
        let mut reader = relayed
            .read_from(2 << 20, Duration::from_millis(300))
            .await
            .unwrap();
        let feed = {
            let received = received.clone();
            let data = data.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                received.push(&Bytes::copy_from_slice(&data[1 << 20..3 << 20]));
            })
        };
        let first = reader.next().await.unwrap().unwrap();
        assert_eq!(first[..], data[2 << 20..][..first.len()]);
        feed.await.unwrap();
        // Then nothing more: an error after the idle bound, never a short blob.
        let mut got = first.len();
        let end = loop {
            match reader.next().await {
                Some(Ok(chunk)) => got += chunk.len(),
                other => break other,
            }
        };
        assert_eq!(got, 1 << 20, "all it had, from 2 MiB to 3 MiB");
        assert!(matches!(end, Some(Err(_))), "{end:?}");
    }

    #[tokio::test]
    async fn the_window_keeps_only_the_newest_bytes_and_a_resume_continues_it() {
        let received = Received::new(20 << 20, 0);
        let data = blob();
        for c in data.chunks(256 << 10) {
            received.push(&Bytes::copy_from_slice(c));
        }
        assert_eq!(received.end(), 10 << 20);
        assert!(
            received.slice(0, CHUNK).is_none(),
            "old bytes are in the download"
        );
        let at = (10 << 20) - WINDOW;
        assert_eq!(
            received.slice(at, 10).unwrap()[..],
            data[at as usize..][..10]
        );
        // containerd asks again from 9 MiB: what is past it comes again.
        received.resume_at(9 << 20);
        assert_eq!(received.end(), 9 << 20);
        assert!(received.slice(9 << 20, 1).is_none());
        assert_eq!(received.slice((9 << 20) - 1, 5).unwrap().len(), 1);
    }

    async fn relayed(store: &MemoryStore, digest: &Digest, total: u64) -> (Relayed, Arc<Received>) {
        let received = Arc::new(Received::new(total, 0));
        let ingest = store.downloads(digest, Scope::Namespace).await.remove(0);
        let relayed = Relayed {
            ingest,
            received: received.clone(),
            follower: "slow-node".into(),
            slow: Counter::default(),
        };
        (relayed, received)
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_fed_far_slower_than_the_relay_is_fed_is_sent_away() {
        let data = blob();
        let digest = Digest::sha256_of(&data);
        let store = MemoryStore::new();
        let writer = store.start_download(&digest, data.len() as u64);
        let (relayed, received) = relayed(&store, &digest, data.len() as u64).await;
        let mut reader = relayed.read_from(0, Duration::from_secs(5)).await.unwrap();
        // The relay gets the whole 10 MiB at once; its follower takes one chunk in 6 s.
        writer.append(&data);
        for c in data.chunks(256 << 10) {
            received.push(&Bytes::copy_from_slice(c));
        }
        let first = reader.next().await.unwrap().unwrap();
        assert_eq!(first[..], data[..first.len()]);
        tokio::time::advance(SLOW_PERIOD + Duration::from_secs(1)).await;
        let next = reader.next().await;
        assert!(matches!(next, Some(Err(_))), "cut, never short: {next:?}");
        assert!(
            received.gave_up("slow-node"),
            "its next follow request is refused"
        );
        assert!(!received.gave_up("another-node"));
        assert_eq!(relayed.slow.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_that_keeps_pace_is_never_sent_away() {
        let data = blob();
        let digest = Digest::sha256_of(&data);
        let store = MemoryStore::new();
        let writer = store.start_download(&digest, data.len() as u64);
        let (relayed, received) = relayed(&store, &digest, data.len() as u64).await;
        let mut reader = relayed.read_from(0, Duration::from_secs(5)).await.unwrap();
        let mut got = Vec::new();
        // A mebibyte a second comes in, and the follower takes all of it each second.
        for mib in data.chunks(1 << 20) {
            writer.append(mib);
            received.push(&Bytes::copy_from_slice(mib));
            while (got.len() as u64) < received.end() {
                got.extend_from_slice(&reader.next().await.unwrap().unwrap());
            }
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert!(got == data);
        assert!(!received.gave_up("slow-node"));
        assert_eq!(relayed.slow.get(), 0);
    }
}
