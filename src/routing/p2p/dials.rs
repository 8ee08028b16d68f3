//! Bootstrap dials, bounded: a source may name every node of the cluster, but a node dials only
//! a few, drawn at random, and Kademlia finds the rest. Invariant: at most the limit in flight.

use std::collections::HashSet;

use libp2p::Multiaddr;
use libp2p::swarm::ConnectionId;

use super::draws::Draws;

/// One reachable node is enough to join; three survive two being down or slow.
pub const DEFAULT_BOOTSTRAP_DIALS: usize = 3;

/// Which bootstrap addresses to dial; dials in flight count against the limit.
#[derive(Debug)]
pub(super) struct BootstrapDials {
    limit: usize,
    own: Option<Multiaddr>,
    in_flight: HashSet<ConnectionId>,
    random: Draws,
    draws: u64,
}

impl BootstrapDials {
    pub(super) fn new(limit: usize, own: Option<Multiaddr>, random: Draws) -> Self {
        BootstrapDials {
            limit: limit.max(1),
            own,
            in_flight: HashSet::new(),
            random,
            draws: 0,
        }
    }

    /// Up to the limit, less the dials in flight, of `addrs` (not this node's own), drawn anew
    /// each time so dead picks are not retried forever.
    pub(super) fn pick(&mut self, mut addrs: Vec<Multiaddr>) -> Vec<Multiaddr> {
        addrs.sort();
        addrs.dedup();
        addrs.retain(|a| Some(a) != self.own.as_ref());
        self.draws += 1;
        let draw = self.draws;
        addrs.sort_by_cached_key(|a| self.random.hash_one((draw, a.as_ref())));
        addrs.truncate(self.limit.saturating_sub(self.in_flight.len()));
        addrs
    }

    pub(super) fn started(&mut self, id: ConnectionId) {
        self.in_flight.insert(id);
    }

    pub(super) fn ended(&mut self, id: ConnectionId) {
        self.in_flight.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bootstrap::tcp_multiaddr;

    fn addrs(n: u8) -> Vec<Multiaddr> {
        (1..=n)
            .map(|i| tcp_multiaddr([10, 0, 0, i].into(), 5482))
            .collect()
    }

    #[test]
    fn a_few_of_many_are_dialled_never_this_node_and_not_while_dials_hang() {
        let own = tcp_multiaddr([10, 0, 0, 1].into(), 5482);
        let mut dials = BootstrapDials::new(3, Some(own.clone()), Draws::new(None));
        let mut seen = HashSet::new();
        for _ in 0..50 {
            let picked = dials.pick(addrs(100));
            assert_eq!(picked.len(), 3);
            assert!(!picked.contains(&own));
            assert_eq!(picked.iter().collect::<HashSet<_>>().len(), 3);
            seen.extend(picked);
        }
        // Drawn anew each time, so dead picks do not stop a node for good.
        assert!(seen.len() > 30, "{}", seen.len());

        let (a, b) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        );
        dials.started(a);
        dials.started(b);
        assert_eq!(dials.pick(addrs(100)).len(), 1);
        dials.ended(a);
        dials.ended(a);
        assert_eq!(dials.pick(addrs(100)).len(), 2);
        dials.started(ConnectionId::new_unchecked(3));
        dials.started(ConnectionId::new_unchecked(4));
        assert!(dials.pick(addrs(100)).is_empty());

        // Fewer than the limit: all of them, once each.
        let mut small = BootstrapDials::new(3, Some(own.clone()), Draws::new(None));
        let mut two = addrs(3);
        two.push(addrs(3)[2].clone());
        let picked = small.pick(two);
        assert_eq!(picked.len(), 2);
        assert!(!picked.contains(&own));
    }
}
