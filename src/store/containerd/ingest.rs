//! containerd's downloads in progress, read out of its ingest directory as they land. Its
//! local content store (1.6 to 2.x) writes `<content>/ingest/<sha256 of ref>/` with `ref`
//! (`<namespace>/<n>/<kind>-<digest>`), `total` and `data`, which grows and is *renamed* to
//! `blobs/sha256/<hex>` on commit; an open descriptor survives the rename.
//!
//! Invariant: a reader's stream ends at `total` or in an error (aborted, truncated, idle),
//! never short.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::oci::Digest;
use crate::store::ByteStream;
use crate::store::downloads::{Download, POLL};

const CHUNK: usize = 256 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ingest {
    dir: PathBuf,
    total: u64,
    /// Where the blob lands on commit (to tell a commit from an abort).
    committed: PathBuf,
}

impl Ingest {
    /// The downloads of `digest` with a known size (else a reader could not tell where one
    /// ends), with their refs. Blocking: call it off the runtime's threads.
    pub(super) fn scan(content_dir: &Path, digest: &Digest) -> Vec<(String, Ingest)> {
        let suffix = format!("-{digest}");
        let committed = super::files::blob_path(content_dir, digest);
        std::fs::read_dir(content_dir.join("ingest"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let dir = entry.path();
                let r = std::fs::read_to_string(dir.join("ref")).ok()?;
                let r = r.trim().to_string();
                // containerd writes `ref` and `total` before it creates `data`: until then
                // there is nothing to read.
                if !r.ends_with(&suffix) || !dir.join("data").exists() {
                    return None;
                }
                let total = std::fs::read_to_string(dir.join("total"))
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .filter(|t| *t > 0)?;
                let committed = committed.clone();
                Some((
                    r,
                    Ingest {
                        dir,
                        total,
                        committed,
                    },
                ))
            })
            .collect()
    }

    pub(super) fn fresh(&self, fresh: Duration) -> bool {
        std::fs::metadata(self.dir.join("data"))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age < fresh)
    }
}

#[async_trait::async_trait]
impl Download for Ingest {
    fn total(&self) -> u64 {
        self.total
    }

    async fn landed(&self) -> Option<u64> {
        tokio::fs::metadata(self.dir.join("data"))
            .await
            .ok()
            .map(|m| m.len())
    }

    async fn written_within(&self, live: Duration) -> bool {
        let Ok(meta) = tokio::fs::metadata(self.dir.join("data")).await else {
            return false;
        };
        meta.modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age < live)
    }

    async fn read_from(&self, offset: u64, idle: Duration) -> std::io::Result<ByteStream> {
        if offset > self.total {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "offset past the end of the blob",
            ));
        }
        let data = self.dir.join("data");
        let mut file = match tokio::fs::File::open(&data).await {
            Ok(file) => file,
            // Landed meanwhile: the same bytes, renamed into place (and checked) by containerd.
            Err(e) if e.kind() == ErrorKind::NotFound => {
                tokio::fs::File::open(&self.committed).await?
            }
            Err(e) => return Err(e),
        };
        file.seek(std::io::SeekFrom::Start(offset)).await?;
        let state = Reader {
            file,
            data,
            committed: self.committed.clone(),
            pos: offset,
            longest: 0,
            total: self.total,
            idle_timeout: idle,
            last_progress: Instant::now(),
            buf: vec![0; CHUNK],
        };
        Ok(futures::stream::unfold(Some(state), |state| async move {
            let mut state = state?;
            match state.next().await {
                Ok(Some(chunk)) => Some((Ok(chunk), Some(state))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed())
    }
}

struct Reader {
    file: tokio::fs::File,
    data: PathBuf,
    committed: PathBuf,
    pos: u64,
    /// The longest the file has been: a shorter file was restarted.
    longest: u64,
    total: u64,
    idle_timeout: Duration,
    last_progress: Instant,
    buf: Vec<u8>,
}

impl Reader {
    /// The next bytes that landed, `None` at `total`, or why the download will not finish.
    async fn next(&mut self) -> std::io::Result<Option<Bytes>> {
        loop {
            if self.pos >= self.total {
                return Ok(None);
            }
            let want = (self.total - self.pos).min(self.buf.len() as u64) as usize;
            let n = self.file.read(&mut self.buf[..want]).await?;
            if n > 0 {
                self.pos += n as u64;
                self.longest = self.longest.max(self.pos);
                self.last_progress = Instant::now();
                return Ok(Some(Bytes::copy_from_slice(&self.buf[..n])));
            }
            // At the end of what has landed (or a follower resumed beyond it): is the
            // download still going?
            let len = self.file.metadata().await?.len();
            if len < self.longest {
                return Err(std::io::Error::other(
                    "the download was truncated (containerd restarted it)",
                ));
            }
            if len > self.longest {
                self.longest = len;
                if len > self.pos {
                    self.last_progress = Instant::now();
                }
            }
            if len <= self.pos && !self.data.exists() && !self.committed.exists() {
                return Err(std::io::Error::other(
                    "the download was aborted before it completed",
                ));
            }
            if self.last_progress.elapsed() >= self.idle_timeout {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "the download made no progress",
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{self, DownloadDriver, DownloadWriter};
    use crate::store::containerd::ContainerdStore;
    use crate::store::downloads::{Landing, wait_for};
    use crate::store::{ContentStore, downloads::Scope};
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Writes downloads exactly as containerd's local content store does.
    struct Layout {
        content: PathBuf,
        next: AtomicUsize,
    }

    struct LayoutWriter {
        dir: PathBuf,
        committed: PathBuf,
    }

    impl DownloadDriver for Layout {
        fn start(&self, digest: &Digest, total: u64, own: bool) -> Box<dyn DownloadWriter> {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let ns = if own { "k8s.io" } else { "default" };
            let dir = self.content.join("ingest").join(format!("{n:04x}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("ref"), format!("{ns}/{n}/layer-{digest}")).unwrap();
            std::fs::write(dir.join("total"), total.to_string()).unwrap();
            std::fs::write(dir.join("data"), b"").unwrap();
            std::fs::create_dir_all(self.content.join("blobs/sha256")).unwrap();
            let committed = self.content.join("blobs/sha256").join(digest.hex());
            Box::new(LayoutWriter { dir, committed })
        }
    }

    impl DownloadWriter for LayoutWriter {
        fn append(&mut self, bytes: &[u8]) {
            let path = self.dir.join("data");
            let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
            f.write_all(bytes).unwrap();
        }

        fn commit(&mut self) {
            std::fs::rename(self.dir.join("data"), &self.committed).unwrap();
            std::fs::remove_dir_all(&self.dir).unwrap();
        }

        /// An abort (`ctr content rm`, a failed pull): nothing lands.
        fn abort(&mut self) -> bool {
            std::fs::remove_dir_all(&self.dir).unwrap();
            true
        }
    }

    fn store(content: &Path) -> ContainerdStore {
        let socket = content.join("no-containerd.sock");
        ContainerdStore::new(socket, "k8s.io".into(), content.to_path_buf())
    }

    #[tokio::test]
    async fn containerds_layout_passes_the_download_checks() {
        let tmp = tempfile::tempdir().unwrap();
        let driver = Layout {
            content: tmp.path().to_path_buf(),
            next: AtomicUsize::new(1),
        };
        conformance::check_downloads(&store(tmp.path()), &driver).await;
    }

    #[tokio::test]
    async fn a_download_is_found_once_its_data_file_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let bytes = vec![3u8; 4000];
        let digest = Digest::sha256_of(&bytes);
        let dir = tmp.path().join("ingest/0001");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ref"), format!("k8s.io/1/layer-{digest}")).unwrap();
        std::fs::write(dir.join("total"), bytes.len().to_string()).unwrap();
        let store = store(tmp.path());
        assert!(store.downloads(&digest, Scope::Namespace).await.is_empty());
        std::fs::write(dir.join("data"), &bytes[..10]).unwrap();
        let Landing::InFlight(found) = wait_for(&store, &digest, Duration::ZERO).await else {
            panic!("found once data exists");
        };
        let mut stream = found.read_from(0, Duration::from_secs(30)).await.unwrap();
        assert_eq!(stream.next().await.unwrap().unwrap().len(), 10);
    }

    #[tokio::test]
    async fn a_truncated_download_ends_in_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let driver = Layout {
            content: tmp.path().to_path_buf(),
            next: AtomicUsize::new(1),
        };
        let bytes = vec![7u8; 10_000];
        let digest = Digest::sha256_of(&bytes);
        let mut writer = driver.start(&digest, bytes.len() as u64, true);
        writer.append(&bytes[..6000]);
        let store = store(tmp.path());
        let Landing::InFlight(found) = wait_for(&store, &digest, Duration::ZERO).await else {
            panic!("found");
        };
        let mut stream = found.read_from(0, Duration::from_secs(30)).await.unwrap();
        assert_eq!(stream.next().await.unwrap().unwrap().len(), 6000);
        // containerd restarting the download: the file is cut back.
        let data = tmp.path().join("ingest/0001/data");
        let file = std::fs::OpenOptions::new().write(true).open(data).unwrap();
        file.set_len(0).unwrap();
        assert!(stream.next().await.unwrap().is_err(), "truncated");
        assert!(store.downloads(&digest, Scope::Namespace).await.len() == 1);
    }
}
