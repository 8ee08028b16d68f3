//! The fast path: blob bytes read straight from containerd's content directory.

use std::io::SeekFrom;
use std::path::{Path, PathBuf};

use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_util::io::ReaderStream;

use crate::oci::Digest;
use crate::store::ByteStream;

/// Large reads keep the per-chunk cost (a blocking-pool hop in tokio's file I/O) small.
const READ_CHUNK_BYTES: usize = 256 * 1024;

/// `Digest` admits only known algorithms and fixed-length lowercase hex, so this path cannot
/// leave the content directory.
pub fn blob_path(content_dir: &Path, digest: &Digest) -> PathBuf {
    content_dir
        .join("blobs")
        .join(digest.algorithm().as_str())
        .join(digest.hex())
}

/// Fails if the file is missing, unreadable or not the size containerd says (the caller then
/// reads through gRPC).
pub async fn open(
    content_dir: &Path,
    digest: &Digest,
    size: u64,
    offset: u64,
    len: u64,
) -> std::io::Result<ByteStream> {
    let mut file = tokio::fs::File::open(blob_path(content_dir, digest)).await?;
    let actual = file.metadata().await?.len();
    if actual != size {
        return Err(std::io::Error::other(format!(
            "file is {actual} bytes, containerd says {size}"
        )));
    }
    file.seek(SeekFrom::Start(offset)).await?;
    let reader = file.take(len);
    Ok(Box::pin(ReaderStream::with_capacity(
        reader,
        READ_CHUNK_BYTES,
    )))
}
