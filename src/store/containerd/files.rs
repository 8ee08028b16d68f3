//! The fast path: blob bytes read straight from containerd's content directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::oci::Digest;
use crate::store::ByteStream;

/// Read size per chunk once a transfer is under way. Large reads keep the per-chunk overhead
/// (a blocking-pool hop per read) small next to the copy itself.
const READ_CHUNK_BYTES: usize = 256 * 1024;
/// The first chunk of a response: what a reader that never reads holds.
const FIRST_CHUNK_BYTES: usize = 16 * 1024;

/// `<content_dir>/blobs/<algorithm>/<hex>`. `Digest` only admits lowercase hex of a fixed
/// length and known algorithms, so this cannot leave the content directory.
pub fn blob_path(content_dir: &Path, digest: &Digest) -> PathBuf {
    content_dir
        .join("blobs")
        .join(digest.algorithm().as_str())
        .join(digest.hex())
}

/// Opens `len` bytes at `offset` of the blob's file. Fails if the file is missing, unreadable
/// or not the size containerd says it is (then the caller reads through gRPC instead).
pub async fn open(
    content_dir: &Path,
    digest: &Digest,
    size: u64,
    offset: u64,
    len: u64,
) -> std::io::Result<ByteStream> {
    let path = blob_path(content_dir, digest);
    let (file, actual) = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        Ok::<_, std::io::Error>((file, len))
    })
    .await
    .map_err(std::io::Error::other)??;
    if actual != size {
        return Err(std::io::Error::other(format!(
            "file is {actual} bytes, containerd says {size}"
        )));
    }
    Ok(chunks(Arc::new(file), offset, offset + len))
}

/// The bytes `[start, end)` of `file`, one chunk per poll, each read with `pread` on the
/// blocking pool straight into a buffer of the chunk's own size (tokio's `File` reads into a
/// buffer of its own that it keeps, then copies). Nothing is held between chunks: a response
/// whose reader stops reading holds only the chunk hyper is writing. Chunks start at
/// [`FIRST_CHUNK_BYTES`] and double up to [`READ_CHUNK_BYTES`]: a reader that stalls at once
/// (a slow or hostile client) holds a small one; a transfer under way reads in large ones.
fn chunks(file: Arc<std::fs::File>, start: u64, end: u64) -> ByteStream {
    let state = (file, start, FIRST_CHUNK_BYTES);
    Box::pin(futures::stream::try_unfold(
        state,
        move |(file, at, size)| async move {
            if at >= end {
                return Ok(None);
            }
            let n = (end - at).min(size as u64) as usize;
            let f = file.clone();
            let chunk = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; n];
                // A file cut short under us is an error, never a short blob.
                f.read_exact_at(&mut buf, at)?;
                Ok::<_, std::io::Error>(Bytes::from(buf))
            })
            .await
            .map_err(std::io::Error::other)??;
            let next = (size * 2).min(READ_CHUNK_BYTES);
            Ok(Some((chunk, (file, at + n as u64, next))))
        },
    ))
}
