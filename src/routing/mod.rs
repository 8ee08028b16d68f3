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

use std::net::{IpAddr, SocketAddr};
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

/// A peer ID as another node states it (a claim's, a follower's): short and plain, so that no
/// member can fill a coordinator's tables with long strings.
pub fn plausible_peer_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Whether a node seen at `seen_from` may name `addr` as its own: a loopback, link-local,
/// multicast or unspecified address only where it is itself on loopback (one machine), so a
/// member cannot point other nodes' requests and dials at their own local services.
pub fn plausible_peer_ip(addr: IpAddr, seen_from: IpAddr) -> bool {
    let local = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
            None => v6.is_loopback() || v6.is_unicast_link_local() || v6.is_unspecified(),
        },
    };
    let on_loopback = match seen_from {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    };
    on_loopback || !(local(addr) || addr.is_multicast())
}

pub fn digest_key(digest: &Digest) -> String {
    digest.to_string()
}

/// The key for a tag, as containerd names images.
pub fn tag_key(registry: &str, repository: &str, tag: &str) -> String {
    format!("{registry}/{repository}:{tag}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stated_ids_and_addresses_are_checked() {
        assert!(plausible_peer_id(
            "12D3KooWRm1u7Rb4Hfz3zE6F2qYd9nTzJ5cWx7o8vQp4ab3iXyZt"
        ));
        assert!(!plausible_peer_id(&"a".repeat(60 * 1024)));
        assert!(!plausible_peer_id("a&failed=b") && !plausible_peer_id(""));
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let node = ip("10.0.0.7");
        assert!(plausible_peer_ip(ip("10.0.0.8"), node));
        assert!(plausible_peer_ip(ip("fd00::8"), node));
        for bad in [
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "224.0.0.1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!plausible_peer_ip(ip(bad), node), "{bad}");
        }
        assert!(
            plausible_peer_ip(ip("127.0.0.1"), ip("127.0.0.1")),
            "one machine"
        );
    }
}
