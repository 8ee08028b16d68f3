//! An in-memory [`ContentStore`] for unit tests of the logic above the store.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;

use futures::StreamExt;
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;

use tokio::time::Instant;

use super::downloads::{Download, InFlight, POLL, Scope};
use super::{
    ByteStream, Change, ChangeStream, ContentStore, Descriptor, HeldBlob, Holder, ImageRecord,
    StoreError,
};
use crate::oci::{ByteRange, Digest};

/// Content and image names held in memory. Cloning shares nothing; wrap it in an `Arc`.
#[derive(Debug)]
pub struct MemoryStore {
    inner: Arc<RwLock<Inner>>,
    changes: broadcast::Sender<Change>,
    /// Also keep each blob as a file here, as containerd's content directory does.
    files: Option<PathBuf>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
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
    images: HashMap<String, Descriptor>,
    downloads: Vec<Arc<MemoryDownload>>,
    /// Blobs committed by downloads in another namespace: landed, not listed here.
    landed_elsewhere: HashMap<Digest, Bytes>,
    /// When each blob landed.
    landed_at: HashMap<Digest, Instant>,
    /// [`Holder`]'s holds: lease, digests.
    holds: HashMap<String, HashSet<Digest>>,
}

/// Small, so that tests exercise multi-chunk streams.
const CHUNK_BYTES: usize = 16 * 1024;

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_files(dir: &Path) -> Self {
        Self {
            files: Some(dir.to_path_buf()),
            ..Self::default()
        }
    }

    pub fn put(&self, data: impl Into<Bytes>) -> Digest {
        let data = data.into();
        let digest = Digest::sha256_of(&data);
        self.put_as(&digest, data);
        digest
    }

    fn notify(&self, change: Change) {
        let _ = self.changes.send(change);
    }

    /// Stores `data` under a digest it may not match, for tests of corrupt content.
    pub fn put_as(&self, digest: &Digest, data: impl Into<Bytes>) {
        let data = data.into();
        if let Some(dir) = &self.files {
            // Written whole under another name first: a reader never sees half a file.
            let partial = dir.join(format!("{}.partial", digest.hex()));
            std::fs::write(&partial, &data)
                .and_then(|()| std::fs::rename(&partial, dir.join(digest.hex())))
                .unwrap_or_else(|e| panic!("memory store's file of {digest}: {e}"));
        }
        let mut inner = self.write();
        inner.blobs.insert(digest.clone(), data);
        inner.landed_at.insert(digest.clone(), Instant::now());
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

    /// Deletes an image name (its content stays, as in containerd until GC).
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

    pub fn start_download(&self, digest: &Digest, total: u64) -> DownloadWriter {
        self.begin(digest, total, true)
    }

    /// Starts a download in another namespace: its bytes land where this store can read them,
    /// but the store does not list the blob.
    pub fn start_download_elsewhere(&self, digest: &Digest, total: u64) -> DownloadWriter {
        self.begin(digest, total, false)
    }

    fn begin(&self, digest: &Digest, total: u64, own: bool) -> DownloadWriter {
        let download = Arc::new(MemoryDownload {
            digest: digest.clone(),
            total,
            own,
            progress: Arc::new(Mutex::new(Progress {
                data: Vec::new(),
                written_at: Instant::now(),
                end: None,
            })),
        });
        self.write().downloads.push(download.clone());
        DownloadWriter {
            store: self.inner.clone(),
            download,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        read(&self.inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        write(&self.inner)
    }

    fn landed_bytes(&self, digest: &Digest) -> Option<Bytes> {
        let inner = self.read();
        inner
            .blobs
            .get(digest)
            .or_else(|| inner.landed_elsewhere.get(digest))
            .cloned()
    }
}

fn read(inner: &RwLock<Inner>) -> std::sync::RwLockReadGuard<'_, Inner> {
    inner.read().unwrap_or_else(|e| e.into_inner())
}

fn write(inner: &RwLock<Inner>) -> std::sync::RwLockWriteGuard<'_, Inner> {
    inner.write().unwrap_or_else(|e| e.into_inner())
}

fn chunked(blob: Bytes) -> ByteStream {
    let chunks: Vec<std::io::Result<Bytes>> = (0..blob.len())
        .step_by(CHUNK_BYTES)
        .map(|i| Ok(blob.slice(i..(i + CHUNK_BYTES).min(blob.len()))))
        .collect();
    Box::pin(futures::stream::iter(chunks))
}

/// A download in a memory store, written by its [`DownloadWriter`].
#[derive(Debug)]
struct MemoryDownload {
    digest: Digest,
    total: u64,
    own: bool,
    progress: Arc<Mutex<Progress>>,
}

#[derive(Debug)]
struct Progress {
    data: Vec<u8>,
    written_at: Instant,
    /// `Some(true)` once committed, `Some(false)` once aborted.
    end: Option<bool>,
}

fn lock(progress: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    progress.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes one download of a [`MemoryStore`]: bytes land, then it commits or aborts.
#[derive(Debug, Clone)]
pub struct DownloadWriter {
    store: Arc<RwLock<Inner>>,
    download: Arc<MemoryDownload>,
}

impl DownloadWriter {
    pub fn append(&self, bytes: &[u8]) {
        let mut progress = lock(&self.download.progress);
        progress.data.extend_from_slice(bytes);
        progress.written_at = Instant::now();
    }

    /// Lands the download under its digest, whatever its bytes are.
    pub fn commit(&self) {
        let data = {
            let mut progress = lock(&self.download.progress);
            progress.end = Some(true);
            Bytes::copy_from_slice(&progress.data)
        };
        let mut store = write(&self.store);
        let d = &self.download;
        store.downloads.retain(|o| !Arc::ptr_eq(o, d));
        if d.own {
            store.blobs.insert(d.digest.clone(), data);
        } else {
            store.landed_elsewhere.insert(d.digest.clone(), data);
        }
        store.landed_at.insert(d.digest.clone(), Instant::now());
    }

    pub fn abort(&self) {
        lock(&self.download.progress).end = Some(false);
        let d = &self.download;
        write(&self.store).downloads.retain(|o| !Arc::ptr_eq(o, d));
    }
}

#[async_trait::async_trait]
impl Download for MemoryDownload {
    fn total(&self) -> u64 {
        self.total
    }

    async fn landed(&self) -> Option<u64> {
        let progress = lock(&self.progress);
        progress.end.is_none().then_some(progress.data.len() as u64)
    }

    async fn written_within(&self, live: Duration) -> bool {
        lock(&self.progress).written_at.elapsed() < live
    }

    async fn read_from(&self, offset: u64, idle: Duration) -> std::io::Result<ByteStream> {
        if offset > self.total {
            return Err(std::io::Error::other("offset past the end of the blob"));
        }
        let (progress, total) = (self.progress.clone(), self.total);
        let state = (offset, Instant::now());
        let stream = futures::stream::unfold(Some(state), move |state| {
            let progress = progress.clone();
            async move {
                let (mut pos, last) = state?;
                loop {
                    if pos >= total {
                        return None;
                    }
                    let (chunk, end) = {
                        let p = lock(&progress);
                        let have = (p.data.len() as u64).min(total);
                        let upto = have.min(pos + CHUNK_BYTES as u64);
                        let chunk = (upto > pos)
                            .then(|| Bytes::copy_from_slice(&p.data[pos as usize..upto as usize]));
                        (chunk, p.end)
                    };
                    if let Some(chunk) = chunk {
                        pos += chunk.len() as u64;
                        return Some((Ok(chunk), Some((pos, Instant::now()))));
                    }
                    let error = match end {
                        Some(false) => Some("the download was aborted before it completed"),
                        Some(true) => Some("the download was committed short"),
                        None if last.elapsed() >= idle => Some("the download made no progress"),
                        None => None,
                    };
                    if let Some(e) = error {
                        return Some((Err(std::io::Error::other(e)), None));
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        });
        Ok(Box::pin(stream))
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
        Ok(chunked(
            blob.slice(offset as usize..(offset + len) as usize),
        ))
    }

    async fn downloads(&self, digest: &Digest, scope: Scope) -> Vec<InFlight> {
        self.read()
            .downloads
            .iter()
            .filter(|d| &d.digest == digest)
            .filter(|d| match scope {
                Scope::Namespace => d.own,
                Scope::AnyFresh(fresh) => lock(&d.progress).written_at.elapsed() < fresh,
            })
            .map(|d| d.clone() as InFlight)
            .collect()
    }

    async fn landed(&self, digest: &Digest) -> Option<u64> {
        self.landed_bytes(digest).map(|b| b.len() as u64)
    }

    async fn landed_within(&self, digest: &Digest, within: Duration) -> bool {
        let inner = self.read();
        inner
            .landed_at
            .get(digest)
            .is_some_and(|t| t.elapsed() < within)
    }

    async fn open_landed(
        &self,
        digest: &Digest,
        offset: u64,
    ) -> Result<(ByteStream, u64), StoreError> {
        let blob = self.landed_bytes(digest).ok_or(StoreError::NotFound)?;
        let size = blob.len() as u64;
        let offset = offset.min(size) as usize;
        Ok((chunked(blob.slice(offset..)), size))
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

/// Holds as containerd keeps them, without garbage collection: every landed held blob is
/// held alone.
#[async_trait::async_trait]
impl Holder for MemoryStore {
    async fn open(&self) -> Result<(String, Vec<Digest>), StoreError> {
        let mut inner = self.write();
        let held: HashSet<Digest> = inner.holds.drain().flat_map(|(_, h)| h).collect();
        let id = format!("memory-{}", held.len());
        inner.holds.insert(id.clone(), held.clone());
        Ok((id, held.into_iter().collect()))
    }

    async fn hold(&self, lease: &str, digest: &Digest) -> Result<(), StoreError> {
        let mut inner = self.write();
        let held = inner.holds.get_mut(lease).ok_or(StoreError::NotFound)?;
        held.insert(digest.clone());
        Ok(())
    }

    async fn release(&self, lease: &str, digest: &Digest) -> Result<(), StoreError> {
        let mut inner = self.write();
        if let Some(held) = inner.holds.get_mut(lease) {
            held.remove(digest);
        }
        Ok(())
    }

    async fn landed_holds(&self, held: &[Digest]) -> Result<Vec<HeldBlob>, StoreError> {
        let inner = self.read();
        Ok(held
            .iter()
            .filter_map(|d| {
                Some(HeldBlob {
                    digest: d.clone(),
                    size: inner.blobs.get(d)?.len() as u64,
                    alone: true,
                })
            })
            .collect())
    }

    async fn end(&self) -> Result<usize, StoreError> {
        let mut inner = self.write();
        let n = inner.holds.len();
        inner.holds.clear();
        Ok(n)
    }
}
