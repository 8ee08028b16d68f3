//! An early announcement round when the network, estimated from the routing table, has grown
//! several times over. Invariant: only at [`GROWTH_FACTOR`] times the size at the last round's end,
//! once the routing table pauses gaining nodes (at most a minute later).

use std::time::Duration;

use crate::routing::clock::Instant;

use super::announce_plan::Hash;

/// Records placed before are missed by under 0.5% of lookups up to this growth.
const GROWTH_FACTOR: f64 = 4.0;
const CHECK_EVERY: Duration = Duration::from_secs(10);
/// A growing network is announced into once its growth pauses this long (a node joins in
/// well under a second), or after [`MOST_WAIT`]: a round placed mid-growth misses the nodes
/// still coming.
const QUIET: Duration = Duration::from_secs(2);
const MOST_WAIT: Duration = Duration::from_secs(60);
const NEAREST: usize = 20;

#[derive(Debug, Default)]
pub(crate) struct Growth {
    /// The estimated size when the last round ended; `None` while a round runs.
    at_last_round: Option<f64>,
    next_check: Option<Instant>,
    /// When growth was first seen while the table was still gaining nodes.
    waiting_since: Option<Instant>,
}

impl Growth {
    pub(super) fn round_started(&mut self) {
        self.at_last_round = None;
        self.waiting_since = None;
    }

    /// The network grew: whether the early round starts now, given when the routing table
    /// last gained a node. Otherwise checked again after [`QUIET`].
    pub(super) fn paused(&mut self, now: Instant, table_grew: Option<Instant>) -> bool {
        let since = *self.waiting_since.get_or_insert(now);
        let quiet = table_grew.is_none_or(|t| now >= t + QUIET);
        if quiet || now >= since + MOST_WAIT {
            return true;
        }
        self.next_check = Some(now + QUIET);
        false
    }

    /// No round runs: whether to estimate the size now.
    pub(super) fn due(&mut self, now: Instant) -> bool {
        if self.next_check.is_some_and(|t| now < t) {
            return false;
        }
        self.next_check = Some(now + CHECK_EVERY);
        true
    }

    /// `size` is the network the round's records went to.
    pub(super) fn round_ended(&mut self, size: f64) {
        self.at_last_round.get_or_insert(size);
    }

    /// Whether a round should start at once, with no round running and `size` now.
    pub(super) fn grown(&self, size: f64) -> bool {
        self.at_last_round
            .is_some_and(|before| size >= before * GROWTH_FACTOR)
    }

    pub(super) fn baseline(&self) -> Option<f64> {
        self.at_last_round
    }
}

/// The network's size seen from `local`'s routing table; under [`NEAREST`] peers, a count.
pub(crate) fn network_size(local: &Hash, peers: impl Iterator<Item = Hash>) -> f64 {
    // The leading 64 bits of each distance are plenty for a ratio.
    let mut distances: Vec<u64> = peers
        .map(|p| {
            let mut lead = [0u8; 8];
            for (i, b) in lead.iter_mut().enumerate() {
                *b = local[i] ^ p[i];
            }
            u64::from_be_bytes(lead)
        })
        .collect();
    if distances.len() < NEAREST {
        return distances.len() as f64 + 1.0;
    }
    let (_, kth, _) = distances.select_nth_unstable(NEAREST - 1);
    let fraction = (*kth as f64 + 1.0) / (u64::MAX as f64 + 1.0);
    // The k-th nearest of N uniform points lies at about k / N of the space, on one side.
    (NEAREST as f64 / fraction).max(NEAREST as f64 + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::p2p::announce_plan::peer_hash;
    use libp2p::PeerId;

    fn random_network(n: usize) -> (Hash, Vec<Hash>) {
        let local = peer_hash(&PeerId::random());
        let peers = (0..n).map(|_| peer_hash(&PeerId::random())).collect();
        (local, peers)
    }

    #[test]
    fn the_estimate_follows_the_network_within_its_noise() {
        for n in [50usize, 300, 1_000, 5_000] {
            // One view's noise is about 20%.
            let mean: f64 = (0..20)
                .map(|_| {
                    let (local, peers) = random_network(n - 1);
                    network_size(&local, peers.into_iter())
                })
                .sum::<f64>()
                / 20.0;
            assert!(
                mean > n as f64 * 0.7 && mean < n as f64 * 1.4,
                "{n} nodes estimated at {mean:.0}"
            );
        }
    }

    #[test]
    fn a_small_network_is_counted_not_estimated() {
        let (local, peers) = random_network(7);
        assert_eq!(network_size(&local, peers.into_iter()), 8.0);
        assert_eq!(network_size(&local, std::iter::empty()), 1.0);
    }

    #[test]
    fn a_round_starts_early_only_after_the_network_grew_fourfold() {
        let mut g = Growth::default();
        assert!(!g.grown(1_000.0));
        g.round_ended(100.0);
        assert_eq!(g.baseline(), Some(100.0));
        assert!(!g.grown(150.0));
        assert!(!g.grown(399.0));
        assert!(g.grown(400.0));
        g.round_started();
        assert!(!g.grown(1_600.0), "no baseline while the round runs");
        g.round_ended(400.0);
        g.round_ended(900.0);
        assert_eq!(g.baseline(), Some(400.0), "the first end counts");
        assert!(!g.grown(1_000.0));
        assert!(g.grown(1_600.0));
    }

    #[test]
    fn an_early_round_waits_for_the_growth_to_pause_at_most_a_minute() {
        let mut g = Growth::default();
        let t = Instant::now();
        g.round_ended(4.0);
        assert!(g.due(t) && g.grown(16.0));
        assert!(g.paused(t, None), "a table that never grew is quiet");
        assert!(!g.paused(t, Some(t)), "a node joined just now");
        assert!(!g.due(t + Duration::from_secs(1)));
        assert!(g.due(t + QUIET), "checked again after the pause");
        assert!(g.paused(t + QUIET, Some(t)));
        // Growing without a pause: a minute on, the round starts anyway.
        let s = t + Duration::from_secs(30);
        let mut g = Growth::default();
        assert!(!g.paused(s, Some(s)));
        assert!(!g.paused(
            s + Duration::from_secs(59),
            Some(s + Duration::from_secs(59))
        ));
        assert!(g.paused(s + MOST_WAIT, Some(s + MOST_WAIT)));
        g.round_started();
        assert!(!g.paused(s + MOST_WAIT, Some(s + MOST_WAIT)), "a new wait");
    }

    #[test]
    fn the_size_is_checked_at_most_every_ten_seconds() {
        let mut g = Growth::default();
        let t = Instant::now();
        assert!(g.due(t));
        assert!(!g.due(t + Duration::from_secs(9)));
        assert!(g.due(t + Duration::from_secs(10)));
    }
}
