//! A stored blob is checked against its digest before it is served to a peer: the file may
//! have changed since containerd committed it (`docs/security.md`). A bad blob is withdrawn,
//! counted, logged and a 404. Invariant: each version of a file (device, inode, size, mtime)
//! is hashed once, and concurrent requests for one unchecked blob share one hash.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::metrics::Metrics;
use crate::oci::Digest;
use crate::routing::{ContentRouting, digest_key};
use crate::store::ContentStore;

/// Verdicts kept at most (about 100 bytes each).
const MAX_VERDICTS: usize = 100_000;
const READ_CHUNK: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    Good,
    /// Does not match its digest: never served.
    Bad,
    /// No file to check: served as before.
    Unknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
}

pub struct Integrity {
    store: Arc<dyn ContentStore>,
    router: Arc<dyn ContentRouting>,
    metrics: Arc<Metrics>,
    verdicts: Mutex<HashMap<Digest, (FileId, bool)>>,
    /// One hash per digest at a time.
    hashing: Mutex<HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Integrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Integrity").finish_non_exhaustive()
    }
}

impl Integrity {
    pub fn new(
        store: Arc<dyn ContentStore>,
        router: Arc<dyn ContentRouting>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Integrity {
            store,
            router,
            metrics,
            verdicts: Mutex::new(HashMap::new()),
            hashing: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the file matches `digest`. The hash runs to its end even if the asker gives up:
    /// a blob hashing longer than a first-byte timeout would otherwise never be served.
    pub async fn check(self: &Arc<Self>, digest: &Digest) -> Check {
        let Some(path) = self.store.blob_file(digest) else {
            return Check::Unknown;
        };
        let Some(id) = file_id(&path) else {
            return Check::Unknown;
        };
        if let Some(check) = self.known(digest, id) {
            return check;
        }
        let (this, digest) = (self.clone(), digest.clone());
        tokio::spawn(async move { this.check_unknown(&digest, &path, id).await })
            .await
            .unwrap_or(Check::Unknown)
    }

    async fn check_unknown(&self, digest: &Digest, path: &Path, id: FileId) -> Check {
        let turn = {
            let mut hashing = self.hashing.lock().unwrap_or_else(|e| e.into_inner());
            hashing.entry(digest.clone()).or_default().clone()
        };
        let check = {
            let _mine = turn.lock().await;
            match self.known(digest, id) {
                Some(check) => check,
                None => self.hash(digest, path, id).await,
            }
        };
        let mut hashing = self.hashing.lock().unwrap_or_else(|e| e.into_inner());
        if Arc::strong_count(&turn) <= 2 {
            hashing.remove(digest);
        }
        check
    }

    fn known(&self, digest: &Digest, id: FileId) -> Option<Check> {
        let verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        match verdicts.get(digest) {
            Some((seen, good)) if *seen == id => Some(if *good { Check::Good } else { Check::Bad }),
            _ => None,
        }
    }

    async fn hash(&self, digest: &Digest, path: &Path, id: FileId) -> Check {
        let (p, d) = (path.to_path_buf(), digest.clone());
        let matched = tokio::task::spawn_blocking(move || hash_file(&p, &d)).await;
        let good = match matched {
            Ok(Ok(good)) => good,
            // Unreadable or gone meanwhile: not a verdict on the bytes.
            _ => return Check::Unknown,
        };
        // Changed while it was read: the verdict is about neither version.
        if file_id(path) != Some(id) {
            return Check::Unknown;
        }
        {
            let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
            if verdicts.len() >= MAX_VERDICTS {
                verdicts.clear();
            }
            verdicts.insert(digest.clone(), (id, good));
        }
        if good {
            return Check::Good;
        }
        self.metrics.corrupt_blobs.inc();
        tracing::error!(
            %digest,
            path = %path.display(),
            "a blob in containerd's content store does not match its digest (bit rot, a bad disk, tampering?): not served to peers, withdrawn from the peer network; `ctr content rm` it and pull again"
        );
        if let Err(e) = self.router.withdraw(vec![digest_key(digest)]).await {
            tracing::warn!(%digest, error = %e, "could not withdraw a corrupt blob");
        }
        Check::Bad
    }
}

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileId {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
    })
}

fn hash_file(path: &Path, digest: &Digest) -> std::io::Result<bool> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = digest.hasher();
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.matches(digest));
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::memory::MemoryNetwork;
    use crate::store::memory::MemoryStore;
    use std::path::PathBuf;

    fn setup(bytes: &[u8]) -> (tempfile::TempDir, Arc<dyn ContentStore>, Digest, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let store = MemoryStore::with_files(tmp.path());
        let digest = store.put(bytes.to_vec());
        let path = store.blob_file(&digest).unwrap();
        (tmp, Arc::new(store), digest, path)
    }

    #[tokio::test]
    async fn a_blob_is_hashed_once_and_again_only_when_its_file_changes() {
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let (_tmp, store, digest, path) = setup(&bytes);
        let me = crate::routing::Peer {
            id: "a".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
        };
        let router: Arc<dyn ContentRouting> = Arc::new(MemoryNetwork::new().node(me));
        let metrics = Arc::new(Metrics::new());
        let check = Arc::new(Integrity::new(store, router, metrics.clone()));
        assert_eq!(check.check(&digest).await, Check::Good);
        assert_eq!(check.check(&digest).await, Check::Good, "remembered");

        // Overwritten in the middle: a new modification time, checked again.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut rotten = bytes.clone();
        rotten[1_500_000..1_500_000 + 16_384].fill(0xAA);
        std::fs::write(&path, &rotten).unwrap();
        assert_eq!(check.check(&digest).await, Check::Bad);
        assert_eq!(check.check(&digest).await, Check::Bad, "remembered too");
        assert_eq!(metrics.corrupt_blobs.get(), 1, "counted once");

        let missing = Digest::sha256_of(b"not here");
        assert_eq!(check.check(&missing).await, Check::Unknown);
    }

    #[tokio::test]
    async fn a_check_its_asker_gave_up_on_still_reaches_a_verdict() {
        // Tens of milliseconds of hashing, far more than the asker waits here.
        let bytes: Vec<u8> = (0..64u32 << 20).map(|i| (i % 253) as u8).collect();
        let (_tmp, store, digest, path) = setup(&bytes);
        let me = crate::routing::Peer {
            id: "a".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
        };
        let router: Arc<dyn ContentRouting> = Arc::new(MemoryNetwork::new().node(me));
        let check = Arc::new(Integrity::new(store, router, Arc::new(Metrics::new())));
        let gave_up =
            tokio::time::timeout(std::time::Duration::from_millis(1), check.check(&digest)).await;
        assert!(
            gave_up.is_err(),
            "the asker stopped waiting before the verdict"
        );
        let id = file_id(&path).unwrap();
        let started = std::time::Instant::now();
        while check.known(&digest, id).is_none() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "the hash was dropped with its asker"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(check.known(&digest, id), Some(Check::Good));
        // The next asker is answered from the verdict at once.
        let next =
            tokio::time::timeout(std::time::Duration::from_millis(100), check.check(&digest)).await;
        assert_eq!(next.ok(), Some(Check::Good));
    }
}
