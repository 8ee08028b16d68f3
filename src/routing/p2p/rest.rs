//! Keys that need not be announced this round: a quarter of their storing nodes refused this
//! node as full, so the key rests one or two rounds, drawn per key.
//!
//! Invariant: new keys never rest, and a resting key stays findable through the full nodes.

use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug)]
pub(crate) struct Resting {
    /// Refusals in one round that rest a key: a quarter of its storing nodes.
    to_rest: u8,
    refusals: HashMap<Arc<str>, u8>,
    /// Resting keys, with how many rounds they still skip.
    rounds_left: HashMap<Arc<str>, u8>,
}

impl Resting {
    pub(super) fn new(replicas: usize) -> Self {
        Resting {
            to_rest: (replicas / 4).clamp(1, u8::MAX as usize) as u8,
            refusals: HashMap::new(),
            rounds_left: HashMap::new(),
        }
    }

    /// A storing node refused `key` as full; `draw` picks one or two rounds of rest.
    pub(super) fn refused(&mut self, key: &Arc<str>, draw: u64) {
        let n = self.refusals.entry(key.clone()).or_default();
        *n = n.saturating_add(1);
        if *n == self.to_rest {
            self.rounds_left.insert(key.clone(), 1 + (draw % 2) as u8);
        }
    }

    /// Whether `key` is announced in the round beginning; call [`Resting::round_started`]
    /// once after asking for every key.
    pub(super) fn announce(&self, key: &str) -> bool {
        !self.rounds_left.contains_key(key)
    }

    pub(super) fn round_started(&mut self) {
        self.rounds_left.retain(|_, n| {
            *n -= 1;
            *n > 0
        });
        self.refusals.clear();
    }

    pub(super) fn forget(&mut self, key: &str) {
        self.refusals.remove(key);
        self.rounds_left.remove(key);
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.rounds_left.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn a_key_refused_by_most_of_its_nodes_rests_one_or_two_rounds_then_comes_back() {
        for draw in [0u64, 1] {
            let mut r = Resting::new(20);
            let k = key("sha256:shared");
            for _ in 0..5 - 1 {
                r.refused(&k, draw);
            }
            assert!(r.announce(&k), "a few full nodes are not enough");
            r.refused(&k, draw);
            assert!(!r.announce(&k), "refused by 5 of its 20 nodes: rests");
            let mut rested = 0;
            loop {
                let announced = r.announce(&k);
                r.round_started();
                if announced {
                    break;
                }
                rested += 1;
            }
            assert_eq!(rested, 1 + draw as usize, "one or two rounds, as drawn");
            assert_eq!(r.len(), 0);
        }
    }

    #[test]
    fn refusals_count_per_round_and_a_withdrawn_key_is_forgotten() {
        let mut r = Resting::new(20);
        let k = key("sha256:a");
        for _ in 0..5 - 1 {
            r.refused(&k, 0);
        }
        r.round_started();
        r.refused(&k, 0);
        assert!(r.announce(&k), "refusals of earlier rounds do not add up");
        for _ in 0..5 {
            r.refused(&k, 0);
        }
        assert!(!r.announce(&k));
        r.forget(&k);
        assert!(r.announce(&k) && r.len() == 0);
    }
}
