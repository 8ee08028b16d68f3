//! The in-flight reader: a blob read out of containerd's ingest while containerd is still
//! downloading it, so that other nodes can follow a leader byte for byte.
//!
//! containerd's local content store (1.6, 1.7 and 2.x alike) writes a download to
//! `<content>/ingest/<sha256 of the internal ref>/`, with `ref` (`<namespace>/<n>/<kind>-<digest>`,
//! kind `layer`, `config`, `manifest`, `index`), `total` (the expected size, known from the
//! descriptor) and `data`, which grows as bytes land and is *renamed* into
//! `blobs/sha256/<hex>` on commit. An open file descriptor survives the rename, so the reader
//! opens `data` once and reads it to `total`, whatever happens to its name. A download that is
//! aborted (the directory goes, nothing is committed), truncated (containerd restarting it) or
//! silent for the idle timeout ends the stream with an error: the follower's body then resumes
//! elsewhere or cuts its client off, never a short or wrong blob.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::oci::Digest;
use crate::store::ByteStream;

/// How often a reader at the end of what has landed looks again. Bytes arrive from the
/// upstream in bursts; 10 ms keeps a follower within a few bursts of the leader.
const POLL: Duration = Duration::from_millis(10);
/// Read size per chunk (as the complete-blob fast path).
const CHUNK: usize = 256 * 1024;

/// What a wait for a download found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Landing {
    InFlight(Ingest),
    Committed,
    Nothing,
}

/// A download in progress in containerd's ingest directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ingest {
    pub dir: PathBuf,
    /// The size the download will have: where every reader stops.
    pub total: u64,
}

impl Ingest {
    /// The ingest of `digest` in `namespace`, if containerd is downloading it now. Ingests
    /// without a known size are skipped (a reader would not know where the blob ends).
    pub fn find(content_dir: &Path, namespace: &str, digest: &Digest) -> Option<Ingest> {
        let prefix = format!("{namespace}/");
        Self::scan(content_dir, digest)
            .find(|(r, _)| r.starts_with(&prefix))
            .map(|(_, ingest)| ingest)
    }

    /// Every download of `digest` in progress, in any containerd namespace, whose file was
    /// written within `fresh` (older ones are leftovers of downloads that failed).
    pub fn find_all(content_dir: &Path, digest: &Digest, fresh: Duration) -> Vec<Ingest> {
        Self::scan(content_dir, digest)
            .map(|(_, ingest)| ingest)
            .filter(|ingest| {
                std::fs::metadata(ingest.dir.join("data"))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|m| m.elapsed().ok())
                    .is_some_and(|age| age < fresh)
            })
            .collect()
    }

    /// The ingests of `digest` with a known size, with their refs.
    fn scan(content_dir: &Path, digest: &Digest) -> impl Iterator<Item = (String, Ingest)> {
        let suffix = format!("-{digest}");
        std::fs::read_dir(content_dir.join("ingest"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(move |entry| {
                let dir = entry.path();
                let r = std::fs::read_to_string(dir.join("ref")).ok()?;
                let r = r.trim().to_string();
                if !r.ends_with(&suffix) {
                    return None;
                }
                let total = std::fs::read_to_string(dir.join("total"))
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .filter(|t| *t > 0)?;
                Some((r, Ingest { dir, total }))
            })
    }

    /// The first of `candidates` whose file grows within `wait`: one that something is
    /// writing now. A download whose writer is waiting for the very request being answered
    /// does not grow, so it is never picked (that would be a request waiting for itself).
    /// A small blob may land and be committed (to `committed`) between two looks: then
    /// `Committed`.
    pub async fn growing(candidates: Vec<Ingest>, committed: &Path, wait: Duration) -> Landing {
        let len = |ingest: &Ingest| {
            std::fs::metadata(ingest.dir.join("data"))
                .map(|m| m.len())
                .ok()
        };
        let start: Vec<Option<u64>> = candidates.iter().map(len).collect();
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            tokio::time::sleep(POLL).await;
            for (ingest, before) in candidates.iter().zip(&start) {
                match (before, len(ingest)) {
                    (Some(before), Some(now)) if now > *before => {
                        return Landing::InFlight(ingest.clone());
                    }
                    (_, None) if committed.exists() => return Landing::Committed,
                    _ => {}
                }
            }
        }
        Landing::Nothing
    }

    /// Waits up to `wait` for the ingest of `digest` to appear (a leader's containerd starts
    /// its download a moment after its Ferry said 404), or for the blob to be committed at
    /// `committed` (a small blob may come and go between two looks).
    pub async fn wait_for(
        content_dir: &Path,
        namespace: &str,
        digest: &Digest,
        committed: &Path,
        wait: Duration,
    ) -> Landing {
        let deadline = Instant::now() + wait;
        loop {
            let (dir, ns, d) = (
                content_dir.to_path_buf(),
                namespace.to_string(),
                digest.clone(),
            );
            let found = tokio::task::spawn_blocking(move || Ingest::find(&dir, &ns, &d))
                .await
                .ok()
                .flatten();
            if let Some(ingest) = found {
                return Landing::InFlight(ingest);
            }
            if committed.exists() {
                return Landing::Committed;
            }
            if Instant::now() >= deadline {
                return Landing::Nothing;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Whether the download is alive: its file changed within `live` (a download that has
    /// just started, or is receiving), or grows before `deadline`. A download whose containerd
    /// died, or whose upstream refused it, leaves its ingest behind, still: it must not be
    /// followed. `false` too when the file is gone (committed or aborted: the caller looks).
    pub async fn landing(&self, offset: u64, live: Duration, deadline: Instant) -> bool {
        let data = self.dir.join("data");
        let Ok(first) = tokio::fs::metadata(&data).await else {
            return false;
        };
        let recent = first
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age < live);
        if recent {
            return true;
        }
        let start = first.len();
        while Instant::now() < deadline {
            tokio::time::sleep(POLL).await;
            match tokio::fs::metadata(&data).await {
                Ok(m) if m.len() > start && m.len() > offset => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// The blob from byte `offset` to the end, as it lands. `committed` is where the blob
    /// will be once containerd commits it (to tell a commit from an abort).
    pub async fn read_from(
        &self,
        offset: u64,
        committed: PathBuf,
        idle_timeout: Duration,
    ) -> std::io::Result<ByteStream> {
        if offset > self.total {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "offset past the end of the blob",
            ));
        }
        let data = self.dir.join("data");
        let mut file = tokio::fs::File::open(&data).await?;
        file.seek(std::io::SeekFrom::Start(offset)).await?;
        let state = Reader {
            file,
            data,
            committed,
            pos: offset,
            longest: 0,
            total: self.total,
            idle_timeout,
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

/// `stream`, the whole of the blob `digest`, checked on the way: the last chunk is only
/// passed on once every byte matches, so a client sees a body cut short (and resumes
/// elsewhere), never a complete body with wrong bytes.
pub fn verified(stream: ByteStream, digest: Digest, total: u64) -> ByteStream {
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

struct Reader {
    file: tokio::fs::File,
    data: PathBuf,
    committed: PathBuf,
    pos: u64,
    /// The longest the file has been: a file shorter than that was restarted.
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
                // Bytes read there: the file was at least this long.
                self.longest = self.longest.max(self.pos);
                self.last_progress = Instant::now();
                return Ok(Some(Bytes::copy_from_slice(&self.buf[..n])));
            }
            // At the end of what has landed (or before the asked offset has landed: a
            // follower resuming at an offset the leader has not reached yet): is the download
            // still going?
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
    use futures::TryStreamExt;
    use std::io::Write;

    async fn all(stream: ByteStream) -> std::io::Result<Vec<u8>> {
        stream
            .try_fold(Vec::new(), |mut v, c| async move {
                v.extend_from_slice(&c);
                Ok(v)
            })
            .await
    }

    /// An ingest directory as containerd lays it out, with `have` of the blob written.
    fn ingest(content: &Path, digest: &Digest, total: usize, have: &[u8]) -> PathBuf {
        let dir = content.join("ingest").join("4f2c");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ref"), format!("k8s.io/1/layer-{digest}")).unwrap();
        std::fs::write(dir.join("total"), total.to_string()).unwrap();
        std::fs::write(dir.join("data"), have).unwrap();
        std::fs::create_dir_all(content.join("blobs/sha256")).unwrap();
        dir
    }

    fn append(path: &Path, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        f.write_all(bytes).unwrap();
    }

    fn blob(n: usize) -> (Vec<u8>, Digest) {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let digest = Digest::sha256_of(&bytes);
        (bytes, digest)
    }

    #[tokio::test]
    async fn reads_a_growing_file_across_its_commit_to_the_expected_size() {
        let tmp = tempfile::tempdir().unwrap();
        let content = tmp.path();
        let (bytes, digest) = blob(3 * CHUNK + 123);
        let dir = ingest(content, &digest, bytes.len(), &bytes[..1000]);
        assert_eq!(
            Ingest::find(content, "default", &digest),
            None,
            "other namespace"
        );
        let found = Ingest::find(content, "k8s.io", &digest).unwrap();
        assert_eq!(found.total, bytes.len() as u64);
        let committed = content.join("blobs/sha256").join(digest.hex());
        let stream = found
            .read_from(0, committed.clone(), Duration::from_secs(5))
            .await
            .unwrap();
        let reader = tokio::spawn(all(stream));
        // containerd writes the rest in bursts, then commits: a rename out of the ingest.
        for part in bytes[1000..].chunks(100_000) {
            tokio::time::sleep(Duration::from_millis(15)).await;
            append(&dir.join("data"), part);
        }
        std::fs::rename(dir.join("data"), &committed).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let got = reader.await.unwrap().unwrap();
        assert_eq!(got.len(), bytes.len());
        assert!(digest.matches(&got), "every byte, in order");
    }

    #[tokio::test]
    async fn starts_at_an_offset_for_a_resumed_transfer() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(5000);
        ingest(tmp.path(), &digest, bytes.len(), &bytes);
        let found = Ingest::find(tmp.path(), "k8s.io", &digest).unwrap();
        let got = found
            .read_from(4000, tmp.path().join("nowhere"), Duration::from_secs(1))
            .await
            .unwrap();
        let got = all(got).await.unwrap();
        assert_eq!(&got[..], &bytes[4000..]);
    }

    /// A follower resuming at an offset the leader's download has not reached yet waits for
    /// it (the reader used to take the shorter file for a restarted download and cut at once,
    /// and containerd gives up after a few cuts without progress).
    #[tokio::test]
    async fn an_offset_not_landed_yet_is_waited_for() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(20_000);
        let dir = ingest(tmp.path(), &digest, bytes.len(), &bytes[..3000]);
        let found = Ingest::find(tmp.path(), "k8s.io", &digest).unwrap();
        let committed = tmp.path().join("blobs/sha256").join(digest.hex());
        let stream = found
            .read_from(12_000, committed, Duration::from_secs(5))
            .await
            .unwrap();
        let reader = tokio::spawn(all(stream));
        for part in bytes[3000..].chunks(2000) {
            tokio::time::sleep(Duration::from_millis(15)).await;
            append(&dir.join("data"), part);
        }
        let got = reader.await.unwrap().unwrap();
        assert_eq!(&got[..], &bytes[12_000..]);
    }

    #[tokio::test]
    async fn an_aborted_download_ends_in_an_error_not_a_short_blob() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(10_000);
        let dir = ingest(tmp.path(), &digest, bytes.len(), &bytes[..4000]);
        let found = Ingest::find(tmp.path(), "k8s.io", &digest).unwrap();
        let committed = tmp.path().join("blobs/sha256").join(digest.hex());
        let stream = found
            .read_from(0, committed, Duration::from_secs(30))
            .await
            .unwrap();
        let reader = tokio::spawn(all(stream));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // `ctr content rm`/an abort: the directory goes and nothing is committed.
        std::fs::remove_dir_all(&dir).unwrap();
        let started = Instant::now();
        let result = reader.await.unwrap();
        assert!(result.is_err(), "an aborted download is an error");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "noticed at once"
        );
    }

    #[tokio::test]
    async fn a_truncated_or_stalled_download_ends_in_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(10_000);
        let dir = ingest(tmp.path(), &digest, bytes.len(), &bytes[..6000]);
        let found = Ingest::find(tmp.path(), "k8s.io", &digest).unwrap();
        let stream = found
            .read_from(0, tmp.path().join("never"), Duration::from_secs(30))
            .await
            .unwrap();
        let reader = tokio::spawn(all(stream));
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("data"))
            .unwrap()
            .set_len(0)
            .unwrap();
        assert!(reader.await.unwrap().is_err(), "truncated");

        let stalled = found
            .read_from(0, tmp.path().join("never"), Duration::from_millis(100))
            .await
            .unwrap();
        assert!(all(stalled).await.is_err(), "stalled");
    }

    #[tokio::test]
    async fn a_still_ingest_is_not_followed_and_a_growing_one_is() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(10_000);
        let dir = ingest(tmp.path(), &digest, bytes.len(), &bytes[..2000]);
        let found = Ingest::find(tmp.path(), "k8s.io", &digest).unwrap();
        let soon = || Instant::now() + Duration::from_millis(100);
        // Written just now: live (its bytes may still be on their way).
        assert!(found.landing(0, Duration::from_secs(2), soon()).await);
        // Old bytes (a dead containerd's leftovers): not live until new ones come.
        assert!(!found.landing(0, Duration::ZERO, soon()).await);
        let data = dir.join("data");
        let grower = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            append(&data, &[1, 2, 3]);
        });
        assert!(
            found
                .landing(0, Duration::ZERO, Instant::now() + Duration::from_secs(2))
                .await
        );
        grower.await.unwrap();
    }

    #[tokio::test]
    async fn waits_for_a_download_to_start() {
        let tmp = tempfile::tempdir().unwrap();
        let (bytes, digest) = blob(100);
        let content = tmp.path().to_path_buf();
        let committed = content.join("blobs/sha256").join(digest.hex());
        let waiting = {
            let (content, digest, committed) = (content.clone(), digest.clone(), committed.clone());
            tokio::spawn(async move {
                Ingest::wait_for(
                    &content,
                    "k8s.io",
                    &digest,
                    &committed,
                    Duration::from_secs(5),
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(60)).await;
        ingest(&content, &digest, bytes.len(), &[]);
        assert!(matches!(waiting.await.unwrap(), Landing::InFlight(_)));
        // Committed already (came and went between two looks).
        std::fs::remove_dir_all(content.join("ingest")).unwrap();
        std::fs::write(&committed, &bytes).unwrap();
        let found = Ingest::wait_for(
            &content,
            "k8s.io",
            &digest,
            &committed,
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(found, Landing::Committed);
        let nobody = Digest::sha256_of(b"nobody downloads this");
        let none = Ingest::wait_for(
            &content,
            "k8s.io",
            &nobody,
            &content.join("blobs/sha256").join(nobody.hex()),
            Duration::from_millis(50),
        )
        .await;
        assert_eq!(none, Landing::Nothing);
    }

    /// Two namespaces downloading one digest: the second request's own download (still,
    /// waiting for the answer) is never picked; the one being written is.
    #[tokio::test]
    async fn shares_the_download_that_grows_never_the_askers_own() {
        let tmp = tempfile::tempdir().unwrap();
        let content = tmp.path();
        let (bytes, digest) = blob(50_000);
        let writing = ingest(content, &digest, bytes.len(), &bytes[..1000]);
        let own = content.join("ingest").join("77aa");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(own.join("ref"), format!("default/3/layer-{digest}")).unwrap();
        std::fs::write(own.join("total"), bytes.len().to_string()).unwrap();
        std::fs::write(own.join("data"), b"").unwrap();

        let all_fresh = Ingest::find_all(content, &digest, Duration::from_secs(30));
        assert_eq!(all_fresh.len(), 2, "any namespace");
        assert!(
            Ingest::find_all(content, &digest, Duration::ZERO).is_empty(),
            "leftovers are not in progress"
        );
        let committed = content.join("blobs/sha256").join(digest.hex());
        assert_eq!(
            Ingest::growing(all_fresh.clone(), &committed, Duration::from_millis(80)).await,
            Landing::Nothing,
            "nothing is written: nothing to share"
        );
        let data = writing.join("data");
        let tail = bytes[1000..].to_vec();
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(40)).await;
            append(&data, &tail);
        });
        let picked = Ingest::growing(all_fresh.clone(), &committed, Duration::from_secs(2)).await;
        let Landing::InFlight(picked) = picked else {
            panic!("the growing download is picked");
        };
        assert_eq!(picked.dir, writing);
        writer.await.unwrap();
        // A small blob lands and is committed between two looks.
        std::fs::rename(writing.join("data"), &committed).unwrap();
        assert_eq!(
            Ingest::growing(all_fresh, &committed, Duration::from_secs(2)).await,
            Landing::Committed
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
        let good = all(verified(chunks(bytes.clone()), digest.clone(), 3000)).await;
        assert_eq!(good.unwrap(), bytes);
        let mut bad = bytes.clone();
        bad[1500] ^= 1;
        let mut stream = verified(chunks(bad), digest, 3000);
        let mut passed = 0;
        let mut failed = false;
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
