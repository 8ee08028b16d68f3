//! Downloads in progress, read while they land, so a second request of this node or a
//! follower on another node shares one download. The waits here are written once against
//! [`ContentStore`], so they hold for containerd and the memory store alike.
//!
//! Invariant: nothing above `store/` knows where a download's bytes are kept.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;

use super::{ByteStream, ContentStore};
use crate::oci::Digest;

/// How often a wait looks again: keeps a follower within a few upstream bursts of the leader.
pub(crate) const POLL: Duration = Duration::from_millis(10);

#[async_trait::async_trait]
pub trait Download: Send + Sync + Debug {
    /// The size the blob will have: where every reader stops.
    fn total(&self) -> u64;

    /// How many bytes have landed; `None` once the download is gone (committed or aborted).
    async fn landed(&self) -> Option<u64>;

    async fn written_within(&self, live: Duration) -> bool;

    /// The blob from `offset` as it lands. Ends in an error, never short, when the download is
    /// aborted, truncated (restarted) or lands nothing for `idle`.
    async fn read_from(&self, offset: u64, idle: Duration) -> std::io::Result<ByteStream>;
}

pub(crate) type InFlight = Arc<dyn Download>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// This store's namespace: what a leader's own containerd is fetching.
    Namespace,
    /// Any namespace, written within this long (older ones were left by failed downloads).
    AnyFresh(Duration),
}

#[derive(Debug, Clone)]
pub enum Landing {
    InFlight(InFlight),
    /// Committed meanwhile, in some namespace.
    Committed,
    Nothing,
}

/// Waits up to `wait` for a download of `digest` in the store's namespace to appear (a
/// leader's containerd starts it just after the 404), or for the blob to be committed.
pub(crate) async fn wait_for(store: &dyn ContentStore, digest: &Digest, wait: Duration) -> Landing {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(download) = store
            .downloads(digest, Scope::Namespace)
            .await
            .into_iter()
            .next()
        {
            return Landing::InFlight(download);
        }
        if store.landed(digest).await.is_some() {
            return Landing::Committed;
        }
        if Instant::now() >= deadline {
            return Landing::Nothing;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The first of `candidates` that grows within `wait`. A download whose writer waits for the
/// request being answered does not grow, so a request never waits for itself. `Committed`
/// when one is gone and the blob has landed.
pub(crate) async fn growing(
    store: &dyn ContentStore,
    digest: &Digest,
    candidates: Vec<InFlight>,
    wait: Duration,
) -> Landing {
    let mut start = Vec::with_capacity(candidates.len());
    for c in &candidates {
        start.push(c.landed().await);
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
        for (download, before) in candidates.iter().zip(&start) {
            match (before, download.landed().await) {
                (Some(before), Some(now)) if now > *before => {
                    return Landing::InFlight(download.clone());
                }
                (_, None) if store.landed(digest).await.is_some() => return Landing::Committed,
                _ => {}
            }
        }
    }
    Landing::Nothing
}

/// Written within `live`, or grows past `offset` before `deadline`. A download left behind
/// by a dead containerd or a refused upstream must not be followed. `false` when it is gone.
pub(crate) async fn alive(
    download: &dyn Download,
    offset: u64,
    live: Duration,
    deadline: Instant,
) -> bool {
    let Some(start) = download.landed().await else {
        return false;
    };
    if download.written_within(live).await {
        return true;
    }
    while Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
        match download.landed().await {
            Some(now) if now > start && now > offset => return true,
            Some(_) => {}
            None => return false,
        }
    }
    false
}

/// `stream`, the whole blob, checked on the way: the last chunk is passed on only once every
/// byte matches, so a client sees a body cut short (and resumes elsewhere), never wrong bytes.
pub(crate) fn verified(stream: ByteStream, digest: Digest, total: u64) -> ByteStream {
    let state = (stream, digest.hasher(), 0u64);
    futures::stream::unfold(Some(state), move |state| {
        let digest = digest.clone();
        async move {
            let (mut stream, mut hasher, mut seen) = state?;
            match stream.next().await {
                Some(Ok(chunk)) => {
                    hasher.update(&chunk);
                    seen += chunk.len() as u64;
                    if seen < total {
                        return Some((Ok(chunk), Some((stream, hasher, seen))));
                    }
                    if hasher.matches(&digest) {
                        return Some((Ok(chunk), None));
                    }
                    tracing::error!(%digest, "a download in progress does not match its digest; not passing it on");
                    Some((Err(std::io::Error::other("digest mismatch")), None))
                }
                Some(Err(e)) => Some((Err(e), None)),
                None => None,
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use bytes::Bytes;

    fn blob(n: usize) -> (Vec<u8>, Digest) {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let digest = Digest::sha256_of(&bytes);
        (bytes, digest)
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_a_download_to_start_or_land() {
        let store = Arc::new(MemoryStore::new());
        let (bytes, digest) = blob(100);
        let waiting = {
            let (store, digest) = (store.clone(), digest.clone());
            tokio::spawn(async move { wait_for(&*store, &digest, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(60)).await;
        let writer = store.start_download(&digest, bytes.len() as u64);
        assert!(matches!(waiting.await.unwrap(), Landing::InFlight(_)));
        writer.append(&bytes);
        writer.commit();
        let found = wait_for(&*store, &digest, Duration::from_secs(5)).await;
        assert!(matches!(found, Landing::Committed), "{found:?}");
        let nobody = Digest::sha256_of(b"nobody downloads this");
        let none = wait_for(&*store, &nobody, Duration::from_millis(50)).await;
        assert!(matches!(none, Landing::Nothing));
    }

    /// The asker's own download (still, waiting for the answer) is never picked.
    #[tokio::test(start_paused = true)]
    async fn shares_the_download_that_grows_never_the_askers_own() {
        let store = MemoryStore::new();
        let (bytes, digest) = blob(50_000);
        let total = bytes.len() as u64;
        let writing = store.start_download_elsewhere(&digest, total);
        writing.append(&bytes[..1000]);
        let _own = store.start_download(&digest, total);
        let fresh = Scope::AnyFresh(Duration::from_secs(30));
        let all = store.downloads(&digest, fresh).await;
        assert_eq!(all.len(), 2, "any namespace");
        assert_eq!(store.downloads(&digest, Scope::Namespace).await.len(), 1);
        let wait = Duration::from_millis(80);
        let found = growing(&store, &digest, all.clone(), wait).await;
        assert!(matches!(found, Landing::Nothing), "nothing is written");
        let appender = {
            let writing = writing.clone();
            let tail = bytes[1000..].to_vec();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(40)).await;
                writing.append(&tail);
            })
        };
        let picked = growing(&store, &digest, all.clone(), Duration::from_secs(2)).await;
        let Landing::InFlight(picked) = picked else {
            panic!("the growing download is picked");
        };
        appender.await.unwrap();
        assert_eq!(picked.landed().await, Some(total), "the one written to");
        writing.commit();
        let found = growing(&store, &digest, all, Duration::from_secs(2)).await;
        assert!(matches!(found, Landing::Committed), "{found:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_still_download_is_not_alive_and_a_growing_one_is() {
        let store = MemoryStore::new();
        let (bytes, digest) = blob(10_000);
        let writer = store.start_download(&digest, bytes.len() as u64);
        writer.append(&bytes[..2000]);
        let found = store.downloads(&digest, Scope::Namespace).await.remove(0);
        let soon = || Instant::now() + Duration::from_millis(100);
        assert!(
            alive(&*found, 0, Duration::from_secs(2), soon()).await,
            "written just now"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            !alive(&*found, 0, Duration::from_secs(2), soon()).await,
            "old bytes"
        );
        let grower = {
            let writer = writer.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                writer.append(&[1, 2, 3]);
            })
        };
        let later = Instant::now() + Duration::from_secs(2);
        assert!(alive(&*found, 0, Duration::ZERO, later).await);
        grower.await.unwrap();
        writer.abort();
        assert!(
            !alive(&*found, 0, Duration::from_secs(2), soon()).await,
            "gone"
        );
    }

    #[tokio::test]
    async fn a_verified_stream_withholds_the_last_chunk_of_wrong_bytes() {
        let (bytes, digest) = blob(3000);
        let chunks = |b: Vec<u8>| -> ByteStream {
            let parts: Vec<std::io::Result<Bytes>> = b
                .chunks(1000)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            futures::stream::iter(parts).boxed()
        };
        let mut good = verified(chunks(bytes.clone()), digest.clone(), 3000);
        let mut got = Vec::new();
        while let Some(c) = good.next().await {
            got.extend_from_slice(&c.unwrap());
        }
        assert_eq!(got, bytes);
        let mut bad = bytes.clone();
        bad[1500] ^= 1;
        let mut stream = verified(chunks(bad), digest, 3000);
        let (mut passed, mut failed) = (0, false);
        while let Some(item) = stream.next().await {
            match item {
                Ok(c) => passed += c.len(),
                Err(_) => failed = true,
            }
        }
        assert!(failed, "a mismatch is an error");
        assert_eq!(passed, 2000, "the last chunk is never passed on");
    }
}
