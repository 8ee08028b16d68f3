//! Where content comes from: the narrow [`ContentStore`] trait, containerd's implementation and
//! an in-memory one for tests, and one conformance check both must pass.
//!
//! Invariant: only `store/containerd/` knows containerd's on-disk layout (committed files and
//! downloads in progress); every other room reads content through [`ContentStore`].

#[cfg(any(test, feature = "test-support"))]
pub mod conformance;
pub mod containerd;
pub(crate) mod downloads;
#[cfg(any(test, feature = "test-support"))]
pub mod memory;

use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;

use crate::oci::{ByteRange, Digest};
use downloads::{InFlight, Scope};

/// A stream of blob bytes. An `Err` item means the transfer broke off: the HTTP layer resets
/// the connection so containerd never mistakes a truncated body for a complete one.
pub type ByteStream = Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

/// What changed in the store, as far as what a node can serve goes; the stream ends when the
/// connection to the store is lost.
pub type ChangeStream = Pin<Box<dyn Stream<Item = Change> + Send>>;

/// A change in the store. New content alone is not one: nothing is served for content until
/// an image names it, and naming it is an image change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The image of this name was created, updated (possibly to the same target, after more
    /// of its content arrived) or deleted.
    Image(String),
    /// This content was deleted: the images that had it lose it.
    ContentDeleted(Digest),
    /// Changes were missed, or one could not be read: look at everything.
    Unknown,
}

/// A named image: `<registry>/<repo>:<tag>` (or `...@<digest>`) and the manifest or index it
/// points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub name: String,
    pub target: Descriptor,
}

/// What the store knows about a piece of content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub digest: Digest,
    pub size: u64,
    /// Known when the content was reached through an image (tag resolution); content looked
    /// up by digest alone carries none, because containerd's content store does not keep it.
    pub media_type: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store is up and does not have it. The registry turns this into a 404.
    #[error("not found")]
    NotFound,
    /// The store cannot answer right now (containerd down or restarting). Also a 404 to
    /// containerd, so that it falls back to the next host at once, but counted apart.
    #[error("content store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("content store I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// The content a node can serve. Implementations: containerd (production), memory (tests).
#[async_trait::async_trait]
pub trait ContentStore: Send + Sync + 'static {
    /// Resolves `<registry>/<repository>:<tag>` to the descriptor of its manifest or index.
    async fn resolve(
        &self,
        registry: &str,
        repository: &str,
        tag: &str,
    ) -> Result<Descriptor, StoreError>;

    /// Size (and media type when known) of the content with this digest.
    async fn descriptor(&self, digest: &Digest) -> Result<Descriptor, StoreError>;

    /// The bytes of `digest`, all of them or one range of them (already clamped to the size).
    async fn open(
        &self,
        digest: &Digest,
        range: Option<ByteRange>,
    ) -> Result<ByteStream, StoreError>;

    /// The committed file holding `digest`'s bytes, when the store keeps content as files this
    /// process may read (containerd's content directory): the peer address sends it with
    /// `sendfile`. The caller checks the file's size against [`ContentStore::descriptor`].
    fn blob_file(&self, _digest: &Digest) -> Option<std::path::PathBuf> {
        None
    }

    /// The downloads of `digest` in progress that `scope` allows, with a known size.
    async fn downloads(&self, digest: &Digest, scope: Scope) -> Vec<InFlight>;

    /// The size of `digest` if it has been committed in any namespace of the store's
    /// containerd. A blob just committed may not be recorded yet, or ever in this namespace.
    async fn landed(&self, digest: &Digest) -> Option<u64>;

    /// The bytes of a landed blob ([`ContentStore::landed`]) from `offset` to its end, and its
    /// size.
    async fn open_landed(
        &self,
        digest: &Digest,
        offset: u64,
    ) -> Result<(ByteStream, u64), StoreError>;

    /// Does the store answer at all? Drives `/readyz` and the `containerd_up` metric.
    async fn healthy(&self) -> bool;

    /// The major version of the containerd behind the store, when there is one and it
    /// answers: the hosts.toml syntax for IPv6 hosts depends on it.
    async fn containerd_major(&self) -> Option<u32> {
        None
    }

    /// Every named image.
    async fn images(&self) -> Result<Vec<ImageRecord>, StoreError>;

    /// Change notifications from now on.
    async fn changes(&self) -> Result<ChangeStream, StoreError>;

    /// Drops unfinished downloads (ingests) of `digest` started before `started_before`.
    /// Called after bytes that turned out not to match were already streamed to this node's
    /// containerd: it would otherwise keep them and resume on top of them, failing every later
    /// pull of that blob. Downloads started afterwards are clean and left alone.
    async fn discard_partial(
        &self,
        digest: &Digest,
        started_before: std::time::SystemTime,
    ) -> Result<usize, StoreError>;
}
