//! An in-memory [`ContentStore`] for unit tests of the logic above the store.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use bytes::Bytes;

use futures::StreamExt;
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;

use super::{ByteStream, Change, ChangeStream, ContentStore, Descriptor, ImageRecord, StoreError};
use crate::oci::{ByteRange, Digest};

/// Content and image names held in memory. Cloning shares nothing; wrap it in an `Arc`.
#[derive(Debug)]
pub struct MemoryStore {
    inner: RwLock<Inner>,
    changes: broadcast::Sender<Change>,
    /// Also keep each blob as a file here, as containerd's content directory does (for tests
    /// of what is sent from files: `ContentStore::blob_file`).
    files: Option<PathBuf>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: RwLock::default(),
            changes: broadcast::channel(CHANGE_BUFFER).0,
            files: None,
        }
    }
}

/// A follower that falls further behind is told it missed changes ([`Change::Unknown`]).
const CHANGE_BUFFER: usize = 16;

#[derive(Debug, Default)]
struct Inner {
    blobs: HashMap<Digest, Bytes>,
    /// `<registry>/<repo>:<tag>` -> target descriptor.
    images: HashMap<String, Descriptor>,
}

/// Bytes served per chunk, small so that tests exercise multi-chunk streams.
const CHUNK_BYTES: usize = 16 * 1024;

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that also writes every blob to a file named by its hex digest under `dir`.
    pub fn with_files(dir: &Path) -> Self {
        Self {
            files: Some(dir.to_path_buf()),
            ..Self::default()
        }
    }

    /// Stores `data` and returns its digest.
    pub fn put(&self, data: impl Into<Bytes>) -> Digest {
        let data = data.into();
        let digest = Digest::sha256_of(&data);
        self.put_as(&digest, data);
        digest
    }

    fn notify(&self, change: Change) {
        let _ = self.changes.send(change);
    }

    /// Stores `data` under a digest it may not match: for tests of what happens when a store
    /// holds corrupt content.
    pub fn put_as(&self, digest: &Digest, data: impl Into<Bytes>) {
        let data = data.into();
        if let Some(dir) = &self.files {
            // Written whole under another name first: a reader never sees half a file.
            let partial = dir.join(format!("{}.partial", digest.hex()));
            std::fs::write(&partial, &data)
                .and_then(|()| std::fs::rename(&partial, dir.join(digest.hex())))
                .unwrap_or_else(|e| panic!("memory store's file of {digest}: {e}"));
        }
        self.write().blobs.insert(digest.clone(), data);
    }

    /// Names an image: `<registry>/<repo>:<tag>` points at `manifest` of `media_type`.
    pub fn tag(&self, registry: &str, repo: &str, tag: &str, manifest: &Digest, media_type: &str) {
        let mut inner = self.write();
        let size = inner.blobs.get(manifest).map_or(0, |b| b.len() as u64);
        inner.images.insert(
            format!("{registry}/{repo}:{tag}"),
            Descriptor {
                digest: manifest.clone(),
                size,
                media_type: Some(media_type.to_string()),
            },
        );
        drop(inner);
        self.notify(Change::Image(format!("{registry}/{repo}:{tag}")));
    }

    /// Deletes an image name (its content stays, as in containerd until garbage collection).
    pub fn untag(&self, registry: &str, repo: &str, tag: &str) {
        self.write()
            .images
            .remove(&format!("{registry}/{repo}:{tag}"));
        self.notify(Change::Image(format!("{registry}/{repo}:{tag}")));
    }

    pub fn remove(&self, digest: &Digest) {
        self.write().blobs.remove(digest);
        self.notify(Change::ContentDeleted(digest.clone()));
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait::async_trait]
impl ContentStore for MemoryStore {
    async fn resolve(
        &self,
        registry: &str,
        repo: &str,
        tag: &str,
    ) -> Result<Descriptor, StoreError> {
        self.read()
            .images
            .get(&format!("{registry}/{repo}:{tag}"))
            .cloned()
            .ok_or(StoreError::NotFound)
    }

    async fn descriptor(&self, digest: &Digest) -> Result<Descriptor, StoreError> {
        let inner = self.read();
        let blob = inner.blobs.get(digest).ok_or(StoreError::NotFound)?;
        Ok(Descriptor {
            digest: digest.clone(),
            size: blob.len() as u64,
            media_type: None,
        })
    }

    async fn open(
        &self,
        digest: &Digest,
        range: Option<ByteRange>,
    ) -> Result<ByteStream, StoreError> {
        let blob = self
            .read()
            .blobs
            .get(digest)
            .cloned()
            .ok_or(StoreError::NotFound)?;
        let (offset, len) = crate::oci::range::span(range, blob.len() as u64);
        let blob = blob.slice(offset as usize..(offset + len) as usize);
        let chunks: Vec<std::io::Result<Bytes>> = (0..blob.len())
            .step_by(CHUNK_BYTES)
            .map(|i| Ok(blob.slice(i..(i + CHUNK_BYTES).min(blob.len()))))
            .collect();
        Ok(Box::pin(futures::stream::iter(chunks)))
    }

    fn blob_file(&self, digest: &Digest) -> Option<PathBuf> {
        let dir = self.files.as_ref()?;
        self.read()
            .blobs
            .contains_key(digest)
            .then(|| dir.join(digest.hex()))
    }

    async fn healthy(&self) -> bool {
        true
    }

    async fn images(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let mut images: Vec<ImageRecord> = self
            .read()
            .images
            .iter()
            .map(|(name, target)| ImageRecord {
                name: name.clone(),
                target: target.clone(),
            })
            .collect();
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    async fn discard_partial(
        &self,
        _digest: &Digest,
        _started_before: std::time::SystemTime,
    ) -> Result<usize, StoreError> {
        // Writes are whole here: there are no partial downloads.
        Ok(0)
    }

    async fn changes(&self) -> Result<ChangeStream, StoreError> {
        let stream = BroadcastStream::new(self.changes.subscribe())
            .map(|change| change.unwrap_or(Change::Unknown));
        Ok(Box::pin(stream))
    }
}
