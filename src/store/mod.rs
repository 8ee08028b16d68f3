//! Where content comes from: the narrow [`ContentStore`] trait, containerd's implementation, an
//! in-memory one for tests, and a conformance check both pass.
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
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;

use crate::oci::{ByteRange, Digest};
use downloads::{InFlight, Scope};

/// A stream of blob bytes. An `Err` item means the transfer broke off: the connection is reset
/// so containerd never takes a truncated body for a complete one.
pub type ByteStream = Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

/// Store changes that affect what a node can serve; ends when the store connection is lost.
pub type ChangeStream = Pin<Box<dyn Stream<Item = Change> + Send>>;

/// A change in the store. New content alone is not one: content is served only once an image
/// names it, which is an image change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The image was created, updated (possibly to the same target, with more content) or deleted.
    Image(String),
    ContentDeleted(Digest),
    /// Changes were missed, or one could not be read: look at everything.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub name: String,
    pub target: Descriptor,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub digest: Digest,
    pub size: u64,
    /// Known only through an image: containerd's content store does not keep it.
    pub media_type: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store is up and does not have it (a 404).
    #[error("not found")]
    NotFound,
    /// containerd is down or restarting: also a 404, so containerd falls back at once, but
    /// counted apart.
    #[error("content store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("content store I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// Blobs this node holds for its peers in a lease of its own (`keep/`), so that containerd's
/// garbage collector leaves them, whatever the images' labels say. Ended by `ferry cleanup`.
#[async_trait::async_trait]
pub trait Holder: Send + Sync + 'static {
    /// Takes over the holds a previous start left (renewing their expiry); returns the lease
    /// and what it holds.
    async fn open(&self) -> Result<(String, Vec<Digest>), StoreError>;

    /// Holds `digest`, also before it lands: a hold taken at the request wins the race with
    /// the collector that runs when the pull ends.
    async fn hold(&self, lease: &str, digest: &Digest) -> Result<(), StoreError>;

    async fn release(&self, lease: &str, digest: &Digest) -> Result<(), StoreError>;

    /// Those of `held` that have landed, each with whether only the hold keeps it (no image's
    /// garbage-collection references reach it): only those cost disk of their own.
    async fn landed_holds(&self, held: &[Digest]) -> Result<Vec<HeldBlob>, StoreError>;

    /// Ends every hold of this node; returns how many leases went.
    async fn end(&self) -> Result<usize, StoreError>;

    /// Has the garbage collector run now, so that released blobs deleted meanwhile go (a
    /// release alone may not start a collection).
    async fn collect(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBlob {
    pub digest: Digest,
    pub size: u64,
    /// Kept by the hold alone: no image keeps it.
    pub alone: bool,
}

/// The content a node can serve.
#[async_trait::async_trait]
pub trait ContentStore: Send + Sync + 'static {
    /// The manifest or index a tag points at.
    async fn resolve(
        &self,
        registry: &str,
        repository: &str,
        tag: &str,
    ) -> Result<Descriptor, StoreError>;

    async fn descriptor(&self, digest: &Digest) -> Result<Descriptor, StoreError>;

    /// All of `digest` or one range of it (already clamped to the size).
    async fn open(
        &self,
        digest: &Digest,
        range: Option<ByteRange>,
    ) -> Result<ByteStream, StoreError>;

    /// The committed file of `digest`, if this process may read it (for `sendfile`); the caller
    /// checks its size against `descriptor`.
    fn blob_file(&self, _digest: &Digest) -> Option<std::path::PathBuf> {
        None
    }

    /// The downloads of `digest` in progress that `scope` allows, with a known size.
    async fn downloads(&self, digest: &Digest, scope: Scope) -> Vec<InFlight>;

    /// The size of `digest` if committed in any namespace; a blob just committed may not be
    /// recorded yet, or ever in this namespace.
    async fn landed(&self, digest: &Digest) -> Option<u64>;

    /// Whether `digest` landed (in any namespace) within `within`: only a blob just landed is
    /// shared across namespaces, never one another namespace has kept for long.
    async fn landed_within(&self, digest: &Digest, within: Duration) -> bool;

    /// A landed blob's bytes from `offset` to its end, and its size.
    async fn open_landed(
        &self,
        digest: &Digest,
        offset: u64,
    ) -> Result<(ByteStream, u64), StoreError>;

    /// Drives `/readyz` and the `containerd_up` metric.
    async fn healthy(&self) -> bool;

    /// containerd's major version, when it answers: the hosts.toml IPv6 syntax depends on it.
    async fn containerd_major(&self) -> Option<u32> {
        None
    }

    async fn images(&self) -> Result<Vec<ImageRecord>, StoreError>;

    async fn changes(&self) -> Result<ChangeStream, StoreError>;

    /// Drops ingests of `digest` started before `started_before`, which took bytes that did not
    /// match: containerd would resume on top of them and fail every later pull of that blob.
    async fn discard_partial(
        &self,
        digest: &Digest,
        started_before: std::time::SystemTime,
    ) -> Result<usize, StoreError>;
}
