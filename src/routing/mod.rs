//! Who has a key: the narrow [`ContentRouting`] trait, its libp2p and in-memory
//! implementations, bootstrap sources, and the sync that advertises what the store holds.
//! Keys share one key space: `sha256:<hex>` for content, `<registry>/<repo>:<tag>` for tags.
//!
//! Invariant: the registry never sees libp2p types.

pub mod bootstrap;
pub mod clock;
#[cfg(any(test, feature = "test-support"))]
pub mod memory;
pub mod p2p;
pub mod rendezvous;
pub mod sync;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::oci::Digest;

/// A node that has content, and where its peer address serves it over HTTP.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Peer {
    /// A stable identity (the libp2p peer ID), used to skip a peer that just failed.
    pub id: String,
    pub addr: SocketAddr,
}

/// Providers as they are found; ends when the lookup is over, so it never hangs.
pub type PeerStream = mpsc::Receiver<Peer>;

#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("the routing task has stopped")]
    Stopped,
    #[error("cannot advertise: {0}")]
    Advertise(String),
}

#[async_trait::async_trait]
pub trait ContentRouting: Send + Sync + 'static {
    /// Connected to at least one peer (or alone by configuration).
    fn ready(&self) -> bool;

    /// This node, as other nodes reach it.
    fn local(&self) -> Peer;

    /// The other nodes this one is connected to now.
    fn members(&self) -> Arc<Vec<Peer>>;

    fn connected_since(&self, _id: &str) -> Option<std::time::SystemTime> {
        None
    }

    /// Providers of `key`, this node excluded.
    async fn lookup(&self, key: &str) -> PeerStream;

    /// The node that coordinates `key`, this node included: the same for every node that asks,
    /// as far as the router can tell. `None`: the caller picks among the members.
    async fn coordinator(&self, _key: &str) -> Option<Peer> {
        None
    }

    /// Announces that this node serves `keys`.
    async fn advertise(&self, keys: Vec<String>) -> Result<(), RoutingError>;

    /// Stops announcing `keys` (other nodes forget them when their records expire).
    async fn withdraw(&self, keys: Vec<String>) -> Result<(), RoutingError>;
}

pub fn digest_key(digest: &Digest) -> String {
    digest.to_string()
}

/// The key for a tag, as containerd names images.
pub fn tag_key(registry: &str, repository: &str, tag: &str) -> String {
    format!("{registry}/{repository}:{tag}")
}
