//! An in-memory [`ContentRouting`] for tests of the logic above routing: every node of one
//! [`MemoryNetwork`] sees the others' advertisements at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::{ContentRouting, Peer, PeerStream, RoutingError};

#[derive(Debug, Default, Clone)]
pub struct MemoryNetwork {
    providers: Arc<Mutex<BTreeMap<String, BTreeSet<PeerKey>>>>,
    /// Every node that has a router: all are connected to all.
    nodes: Arc<Mutex<Vec<Peer>>>,
}

/// `Peer` ordered by id so lookups are deterministic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct PeerKey(String, std::net::SocketAddr);

impl MemoryNetwork {
    /// A panicked holder leaves it usable: every change is one insert or remove.
    fn providers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeSet<PeerKey>>> {
        self.providers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn new() -> Self {
        Self::default()
    }

    /// A router for one node of this network.
    pub fn node(&self, me: Peer) -> MemoryRouter {
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if !nodes.contains(&me) {
            nodes.push(me.clone());
        }
        drop(nodes);
        MemoryRouter {
            network: self.clone(),
            me,
        }
    }
}

#[derive(Debug, Clone)]
pub struct MemoryRouter {
    network: MemoryNetwork,
    me: Peer,
}

impl MemoryRouter {
    fn me(&self) -> PeerKey {
        PeerKey(self.me.id.clone(), self.me.addr)
    }
}

#[async_trait::async_trait]
impl ContentRouting for MemoryRouter {
    fn ready(&self) -> bool {
        true
    }

    fn local(&self) -> Peer {
        self.me.clone()
    }

    fn members(&self) -> Arc<Vec<Peer>> {
        let nodes = self.network.nodes.lock().unwrap_or_else(|e| e.into_inner());
        Arc::new(
            nodes
                .iter()
                .filter(|p| p.id != self.me.id)
                .cloned()
                .collect(),
        )
    }

    async fn lookup(&self, key: &str) -> PeerStream {
        let found: Vec<Peer> = {
            let map = self.network.providers();
            map.get(key)
                .into_iter()
                .flatten()
                .filter(|p| p.0 != self.me.id)
                .map(|p| Peer {
                    id: p.0.clone(),
                    addr: p.1,
                })
                .collect()
        };
        let (tx, rx) = mpsc::channel(found.len().max(1));
        for peer in found {
            let _ = tx.try_send(peer);
        }
        rx
    }

    async fn advertise(&self, keys: Vec<String>) -> Result<(), RoutingError> {
        let mut map = self.network.providers();
        for key in keys {
            map.entry(key).or_default().insert(self.me());
        }
        Ok(())
    }

    async fn withdraw(&self, keys: Vec<String>) -> Result<(), RoutingError> {
        let mut map = self.network.providers();
        for key in keys {
            if let Some(set) = map.get_mut(&key) {
                set.remove(&self.me());
            }
        }
        Ok(())
    }
}
