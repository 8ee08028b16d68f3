//! The HTTP peer address of each node, as identify told it. Invariant: an entry unheard of for
//! a record's lifetime, of a node not connected, is forgotten (its records have expired).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::routing::clock::Instant;

use libp2p::PeerId;

use crate::routing::Peer;

#[derive(Debug)]
pub(super) struct PeerAddrs {
    forget_after: Duration,
    known: HashMap<PeerId, (Peer, Instant)>,
}

impl PeerAddrs {
    pub(super) fn new(forget_after: Duration) -> Self {
        PeerAddrs {
            forget_after,
            known: HashMap::new(),
        }
    }

    pub(super) fn get(&self, id: &PeerId) -> Option<&Peer> {
        self.known.get(id).map(|(p, _)| p)
    }

    /// The peer `id` serving at `addr`, its ID encoded once (base58 is slow).
    pub(super) fn heard(&mut self, id: PeerId, addr: SocketAddr, now: Instant) -> Peer {
        match self.known.get_mut(&id) {
            Some((known, at)) if known.addr == addr => {
                *at = now;
                known.clone()
            }
            _ => {
                let peer = Peer {
                    id: id.to_base58(),
                    addr,
                };
                self.known.insert(id, (peer.clone(), now));
                peer
            }
        }
    }

    /// Forgets the nodes not heard of for `forget_after` and not `connected`; returns how many.
    pub(super) fn forget_stale(
        &mut self,
        now: Instant,
        connected: impl Fn(&PeerId) -> bool,
    ) -> usize {
        let before = self.known.len();
        let forget_after = self.forget_after;
        self.known.retain(|id, (_, at)| {
            now.saturating_duration_since(*at) < forget_after || connected(id)
        });
        before - self.known.len()
    }

    pub(super) fn len(&self) -> usize {
        self.known.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_unheard_of_for_a_record_lifetime_are_forgotten_unless_connected() {
        let ttl = Duration::from_secs(1_800);
        let mut addrs = PeerAddrs::new(ttl);
        let (gone, connected, live) = (PeerId::random(), PeerId::random(), PeerId::random());
        let addr: SocketAddr = "10.0.0.1:5481".parse().unwrap();
        let t0 = Instant::now();
        let first = addrs.heard(gone, addr, t0);
        assert_eq!(first.id, gone.to_base58());
        assert_eq!(addrs.heard(gone, addr, t0), first);
        addrs.heard(connected, addr, t0);
        addrs.heard(live, addr, t0);
        // Heard again (a new connection, or identify's periodic push): kept longer.
        addrs.heard(live, addr, t0 + Duration::from_secs(1_000));
        // A new address replaces the old one.
        let moved: SocketAddr = "10.0.0.2:5481".parse().unwrap();
        assert_eq!(
            addrs
                .heard(live, moved, t0 + Duration::from_secs(1_200))
                .addr,
            moved
        );

        assert_eq!(
            addrs.forget_stale(t0 + ttl - Duration::from_secs(1), |_| false),
            0
        );
        let forgotten = addrs.forget_stale(t0 + ttl, |p| *p == connected);
        assert_eq!(forgotten, 1);
        assert!(addrs.get(&gone).is_none());
        assert!(addrs.get(&connected).is_some());
        assert_eq!(addrs.get(&live).map(|p| p.addr), Some(moved));
        assert_eq!(addrs.len(), 2);
    }
}
