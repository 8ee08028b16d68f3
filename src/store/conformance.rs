//! One conformance check that every [`ContentStore`] must pass: the memory store in unit tests,
//! the containerd store in the integration tests against a real containerd.
//!
//! It panics with a message naming the broken promise, so call it from a test.

use bytes::Bytes;
use futures::TryStreamExt;

use super::{ContentStore, StoreError};
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

/// Runs every check against `store`.
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
