//! Which nodes keep a blob's last copies: over the budget, a node lets a blob go ahead of its
//! turn only where `--keep-copies` other nodes that come before it in the blob's rendezvous
//! order have it. Every node computes the same order, so nodes that all hold a blob (a rollout
//! pulls it everywhere) do not all let it go at once: the first `copies` keep it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::oci::Digest;
use crate::routing::{ContentRouting, digest_key, rendezvous};

/// The longest a count waits for the DHT: a slow answer counts what came.
pub const COUNT_WAIT: Duration = Duration::from_secs(2);

#[async_trait::async_trait]
pub trait Copies: Send + Sync + 'static {
    /// How many other nodes advertise `digest` and come before this one in its order, counted
    /// up to `enough`.
    async fn ahead(&self, digest: &Digest, enough: usize) -> usize;
}

/// Other nodes' copies, counted through the DHT.
pub struct RoutedCopies(pub Arc<dyn ContentRouting>);

impl std::fmt::Debug for RoutedCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoutedCopies")
    }
}

#[async_trait::async_trait]
impl Copies for RoutedCopies {
    async fn ahead(&self, digest: &Digest, enough: usize) -> usize {
        let me = self.0.local().id;
        let mut providers = self.0.lookup(&digest_key(digest)).await;
        let mut seen = HashSet::new();
        let count = async {
            while seen.len() < enough {
                match providers.recv().await {
                    Some(peer) if rendezvous::ahead(&peer.id, &me, digest) => seen.insert(peer.id),
                    Some(_) => continue,
                    None => break,
                };
            }
        };
        let _ = tokio::time::timeout(COUNT_WAIT, count).await;
        seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Peer;
    use crate::routing::memory::MemoryNetwork;

    fn peer(i: usize) -> Peer {
        Peer {
            id: format!("node-{i}"),
            addr: format!("10.0.0.{}:5481", i + 1).parse().unwrap(),
        }
    }

    /// Four nodes hold every blob: for each, exactly the two first in its order keep it.
    #[tokio::test]
    async fn nodes_that_all_hold_a_blob_agree_on_which_keep_it() {
        let network = MemoryNetwork::new();
        let routers: Vec<_> = (0..4).map(|i| network.node(peer(i))).collect();
        let digests: Vec<Digest> = (0..20)
            .map(|i| Digest::sha256_of(format!("layer {i}").as_bytes()))
            .collect();
        let keys: Vec<String> = digests.iter().map(digest_key).collect();
        for r in &routers {
            r.advertise(keys.clone()).await.unwrap();
        }
        for d in &digests {
            let mut keepers = 0;
            for r in &routers {
                let copies = RoutedCopies(Arc::new(r.clone()));
                if copies.ahead(d, 2).await < 2 {
                    keepers += 1;
                }
            }
            assert_eq!(keepers, 2, "{d}");
        }
    }
}
