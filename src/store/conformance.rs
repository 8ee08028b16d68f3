//! The conformance check every [`ContentStore`] must pass: the memory store in unit tests,
//! the containerd store against a real containerd. It panics naming the broken promise.

use bytes::Bytes;
use futures::TryStreamExt;

use std::time::Duration;

use super::downloads::{self, Landing, Scope};
use super::{ByteStream, ContentStore, StoreError};
use crate::oci::{ByteRange, Digest};

/// Content known to be in the store under test.
#[derive(Debug, Clone)]
pub struct Fixture {
    pub registry: String,
    pub repository: String,
    pub tag: String,
    pub manifest: Digest,
    pub manifest_media_type: String,
    /// Every blob of the image (manifest included) with its bytes.
    pub blobs: Vec<(Digest, Bytes)>,
}

pub async fn check(store: &dyn ContentStore, fixture: &Fixture) {
    assert!(store.healthy().await, "a running store reports healthy");

    let resolved = store
        .resolve(&fixture.registry, &fixture.repository, &fixture.tag)
        .await
        .expect("the fixture's tag resolves");
    assert_eq!(
        resolved.digest, fixture.manifest,
        "tag resolves to the manifest"
    );
    assert_eq!(
        resolved.media_type.as_deref(),
        Some(fixture.manifest_media_type.as_str()),
        "tag resolution carries the manifest media type"
    );

    for missing in [
        (
            fixture.registry.as_str(),
            fixture.repository.as_str(),
            "no-such-tag",
        ),
        (
            fixture.registry.as_str(),
            "no/such/repo",
            fixture.tag.as_str(),
        ),
        (
            "no-such-registry.invalid",
            fixture.repository.as_str(),
            fixture.tag.as_str(),
        ),
    ] {
        let got = store.resolve(missing.0, missing.1, missing.2).await;
        assert!(
            matches!(got, Err(StoreError::NotFound)),
            "unknown image {missing:?} is NotFound, got {got:?}"
        );
    }

    let absent = Digest::sha256_of(b"ferry conformance: content nobody stored");
    assert!(matches!(
        store.descriptor(&absent).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(
        store.open(&absent, None).await,
        Err(StoreError::NotFound)
    ));

    for (digest, bytes) in &fixture.blobs {
        let size = bytes.len() as u64;
        let desc = store
            .descriptor(digest)
            .await
            .expect("every blob has a descriptor");
        assert_eq!(desc.size, size, "size of {digest}");
        assert_eq!(&desc.digest, digest);

        let all = read(store, digest, None).await;
        assert!(digest.matches(&all), "bytes of {digest} match their digest");
        assert_eq!(all, bytes.as_ref());

        if size == 0 {
            continue;
        }
        let ranges = [
            ByteRange { start: 0, end: 0 },
            ByteRange {
                start: size - 1,
                end: size - 1,
            },
            ByteRange {
                start: size / 3,
                end: size - 1 - size / 3,
            },
            ByteRange {
                start: 0,
                end: size - 1,
            },
        ];
        for r in ranges.into_iter().filter(|r| r.start <= r.end) {
            let got = read(store, digest, Some(r)).await;
            assert_eq!(
                got,
                bytes[r.start as usize..=r.end as usize],
                "range {r:?} of {digest}"
            );
        }
    }
}

/// Drives downloads into the store under test, as its containerd's pulls would.
pub trait DownloadDriver {
    /// Starts a download of `total` bytes of `digest`, in the store's own namespace or another.
    fn start(&self, digest: &Digest, total: u64, own_namespace: bool) -> Box<dyn DownloadWriter>;
}

pub trait DownloadWriter: Send {
    fn append(&mut self, bytes: &[u8]);
    /// Writing is done: the download is committed under its digest.
    fn commit(&mut self);
    /// Drops the download without committing it; `false` when the driver cannot.
    fn abort(&mut self) -> bool;
}

/// How long a check waits for a driver's action to show (a real containerd takes a moment).
const SETTLE: Duration = Duration::from_secs(10);

pub async fn check_downloads(store: &dyn ContentStore, driver: &dyn DownloadDriver) {
    let absent = Digest::sha256_of(b"ferry conformance: nobody downloads this");
    assert!(store.downloads(&absent, Scope::Namespace).await.is_empty());
    let any = Scope::AnyFresh(Duration::from_secs(60));
    assert!(store.downloads(&absent, any).await.is_empty());
    assert_eq!(store.landed(&absent).await, None, "nothing landed");
    assert!(!store.landed_within(&absent, Duration::from_secs(60)).await);
    assert!(matches!(
        store.open_landed(&absent, 0).await,
        Err(StoreError::NotFound)
    ));
    let quick = downloads::wait_for(store, &absent, Duration::from_millis(30)).await;
    assert!(matches!(quick, Landing::Nothing), "{quick:?}");

    // Read while it lands, from the start and from an offset that has not landed yet.
    let bytes = pattern(700_000, 1);
    let digest = Digest::sha256_of(&bytes);
    let total = bytes.len() as u64;
    let mut writer = driver.start(&digest, total, true);
    writer.append(&bytes[..1000]);
    let Landing::InFlight(download) = downloads::wait_for(store, &digest, SETTLE).await else {
        panic!("a download in the store's namespace is found");
    };
    assert_eq!(download.total(), total, "its size is known from the start");
    let idle = Duration::from_secs(20);
    let whole = tokio::spawn(collect(download.read_from(0, idle).await.expect("opens")));
    let tail = tokio::spawn(collect(
        download.read_from(500_000, idle).await.expect("opens"),
    ));
    for part in bytes[1000..].chunks(100_000) {
        tokio::time::sleep(Duration::from_millis(15)).await;
        writer.append(part);
    }
    writer.commit();
    let got = whole
        .await
        .expect("reader")
        .expect("the whole blob, read as it landed");
    assert!(
        digest.matches(&got),
        "every byte, in order, across the commit"
    );
    let got = tail.await.expect("reader").expect("the tail");
    assert_eq!(
        got,
        bytes[500_000..],
        "an offset not landed yet is waited for"
    );
    let started = tokio::time::Instant::now();
    while store.landed(&digest).await != Some(total) {
        assert!(
            started.elapsed() < SETTLE,
            "a committed download has landed"
        );
        tokio::time::sleep(downloads::POLL).await;
    }
    assert!(
        store.landed_within(&digest, SETTLE).await,
        "a download committed a moment ago landed within the freshness"
    );
    assert!(
        !store.landed_within(&digest, Duration::ZERO).await,
        "nothing landed within no time"
    );
    let (stream, size) = store.open_landed(&digest, 10).await.expect("opens");
    assert_eq!(size, total);
    assert_eq!(collect(stream).await.expect("reads"), bytes[10..]);
    // A relay's follower may fall behind its window after the download landed: read from an
    // offset then, it gets the landed bytes (renamed into place), not an error.
    let late = download
        .read_from(600_000, idle)
        .await
        .expect("opens after it landed");
    assert_eq!(collect(late).await.expect("reads"), bytes[600_000..]);
    let offset_past = download.read_from(total + 1, idle).await;
    assert!(offset_past.is_err(), "an offset past the end is refused");

    // Another namespace's download: found only with any namespace, only while fresh.
    let bytes = pattern(300_000, 2);
    let digest = Digest::sha256_of(&bytes);
    let mut writer = driver.start(&digest, bytes.len() as u64, false);
    writer.append(&bytes[..5000]);
    let started = tokio::time::Instant::now();
    let found = loop {
        let found = store.downloads(&digest, any).await;
        if !found.is_empty() || started.elapsed() > SETTLE {
            break found;
        }
        tokio::time::sleep(downloads::POLL).await;
    };
    assert_eq!(
        found.len(),
        1,
        "another namespace's download, with any namespace"
    );
    assert!(store.downloads(&digest, Scope::Namespace).await.is_empty());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let stale = Scope::AnyFresh(Duration::from_secs(1));
    assert!(
        store.downloads(&digest, stale).await.is_empty(),
        "a still one is not fresh"
    );

    // A download that stops landing: its readers end in an error, never a short blob.
    let stalled = found[0].read_from(0, Duration::from_millis(300)).await;
    let got = collect(stalled.expect("opens")).await;
    assert!(got.is_err(), "a stalled download is an error: {got:?}");
    let reader = tokio::spawn(collect(found[0].read_from(0, idle).await.expect("opens")));
    tokio::time::sleep(Duration::from_millis(50)).await;
    if writer.abort() {
        let got = tokio::time::timeout(SETTLE, reader).await;
        let got = got.expect("an abort is noticed at once").expect("reader");
        assert!(got.is_err(), "an aborted download is an error: {got:?}");
    }
}

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + seed * 13) % 251) as u8).collect()
}

async fn collect(stream: ByteStream) -> std::io::Result<Vec<u8>> {
    let chunks: Vec<Bytes> = stream.try_collect().await?;
    Ok(chunks.concat())
}

async fn read(store: &dyn ContentStore, digest: &Digest, range: Option<ByteRange>) -> Vec<u8> {
    let stream = store.open(digest, range).await.expect("stored blob opens");
    let chunks: Vec<Bytes> = stream
        .try_collect()
        .await
        .expect("stored blob streams to the end");
    chunks.concat()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::manifest::OCI_MANIFEST;
    use crate::store::memory::MemoryStore;

    #[tokio::test]
    async fn memory_store_conforms() {
        let store = MemoryStore::new();
        let layer = Bytes::from((0..100_000u32).map(|i| (i * 7) as u8).collect::<Vec<_>>());
        let layer_digest = store.put(layer.clone());
        let manifest = Bytes::from(format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{}},"layers":[{{"digest":"{layer_digest}"}}]}}"#
        ));
        let manifest_digest = store.put(manifest.clone());
        let empty_digest = store.put(Bytes::new());
        store.tag("example.com", "a/b", "v1", &manifest_digest, OCI_MANIFEST);
        let fixture = Fixture {
            registry: "example.com".into(),
            repository: "a/b".into(),
            tag: "v1".into(),
            manifest: manifest_digest.clone(),
            manifest_media_type: OCI_MANIFEST.into(),
            blobs: vec![
                (layer_digest, layer),
                (manifest_digest, manifest),
                (empty_digest, Bytes::new()),
            ],
        };
        check(&store, &fixture).await;
    }
}

#[cfg(test)]
mod download_tests {
    use super::*;
    use crate::store::memory::{self, MemoryStore};

    struct Memory<'a>(&'a MemoryStore);

    impl DownloadWriter for memory::DownloadWriter {
        fn append(&mut self, bytes: &[u8]) {
            memory::DownloadWriter::append(self, bytes);
        }

        fn commit(&mut self) {
            memory::DownloadWriter::commit(self);
        }

        fn abort(&mut self) -> bool {
            memory::DownloadWriter::abort(self);
            true
        }
    }

    impl DownloadDriver for Memory<'_> {
        fn start(&self, digest: &Digest, total: u64, own: bool) -> Box<dyn DownloadWriter> {
            Box::new(if own {
                self.0.start_download(digest, total)
            } else {
                self.0.start_download_elsewhere(digest, total)
            })
        }
    }

    #[tokio::test]
    async fn memory_store_passes_the_download_checks() {
        let store = MemoryStore::new();
        check_downloads(&store, &Memory(&store)).await;
    }
}
