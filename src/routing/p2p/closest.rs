//! Which node coordinates a key's download: the XOR-closest, this node included. All walks
//! for a key end at the same nodes, so nodes agree unconnected. Invariant: only a walk that
//! ran to its end stands for its key, for [`CLOSEST_FRESH`]; a walk cut short answers only
//! those who wait on it.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use crate::routing::clock::Instant;

use libp2p::PeerId;
use libp2p::kad::{KBucketKey, QueryId, RecordKey};

/// How long a finished walk stands for its key: a rollout's claims come within seconds, and a
/// node joining or leaving moves few keys.
const CLOSEST_FRESH: Duration = Duration::from_secs(30);
/// Keys whose coordinator is kept at most (about 150 bytes each).
const CLOSEST_KEPT: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Coordinator {
    Me,
    Other(PeerId),
}

/// Walks by key, and recent walks' coordinators (`Q`: the query ID).
#[derive(Debug)]
pub(super) struct Closest<Q = QueryId> {
    me: PeerId,
    walking: HashMap<Q, String>,
    /// Walks told to end with the nodes that answered so far (a pull could not wait).
    cut: HashMap<Q, String>,
    found: HashMap<String, (Instant, Coordinator)>,
}

impl<Q: Hash + Eq> Closest<Q> {
    pub(super) fn new(me: PeerId) -> Self {
        Closest {
            me,
            walking: HashMap::new(),
            cut: HashMap::new(),
            found: HashMap::new(),
        }
    }

    pub(super) fn walking(&mut self, id: Q, key: String) {
        self.walking.insert(id, key);
    }

    pub(super) fn is_walking(&self, key: &str) -> bool {
        self.walking
            .values()
            .chain(self.cut.values())
            .any(|k| k == key)
    }

    /// The walk was cut short: the nodes it reached must not stand for the key.
    pub(super) fn abandoned(&mut self, id: &Q) -> Option<String> {
        self.walking.remove(id).or_else(|| self.cut.remove(id))
    }

    /// The walks for `key` that are to end now, with the nodes that answered so far: they
    /// answer whoever waits, and stand for nothing afterwards.
    pub(super) fn cut(&mut self, key: &str) -> Vec<Q>
    where
        Q: Clone,
    {
        let ids: Vec<Q> = self
            .walking
            .iter()
            .filter(|(_, k)| *k == key)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            if let Some(k) = self.walking.remove(id) {
                self.cut.insert(id.clone(), k);
            }
        }
        ids
    }

    /// A walk ended; `peers` are its closest nodes if it ran to its end. Returns its key,
    /// and whether it was cut short.
    pub(super) fn walked(
        &mut self,
        id: &Q,
        peers: Option<&[PeerId]>,
        now: Instant,
    ) -> Option<(String, bool)> {
        if let Some(key) = self.cut.remove(id) {
            return Some((key, true));
        }
        let key = self.walking.remove(id)?;
        if let Some(peers) = peers {
            let coordinator = self.closest_of(&key, peers);
            if self.found.len() >= CLOSEST_KEPT {
                self.found
                    .retain(|_, (at, _)| now.duration_since(*at) < CLOSEST_FRESH);
                if self.found.len() >= CLOSEST_KEPT {
                    self.found.clear();
                }
            }
            self.found.insert(key.clone(), (now, coordinator));
        }
        Some((key, false))
    }

    pub(super) fn coordinator(&self, key: &str, now: Instant) -> Option<Coordinator> {
        let (at, coordinator) = self.found.get(key)?;
        (now.duration_since(*at) < CLOSEST_FRESH).then_some(*coordinator)
    }

    /// Of `peers` and this node, the one closest to `key`.
    pub(super) fn closest_of(&self, key: &str, peers: &[PeerId]) -> Coordinator {
        let target = KBucketKey::new(RecordKey::new(&key));
        let distance = |p: &PeerId| KBucketKey::from(*p).distance(&target);
        match peers.iter().min_by_key(|p| distance(p)) {
            Some(p) if distance(p) < distance(&self.me) => Coordinator::Other(*p),
            _ => Coordinator::Me,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_that_saw_the_same_closest_nodes_picks_the_same_one() {
        let nodes: Vec<PeerId> = (0..30).map(|_| PeerId::random()).collect();
        for k in 0..50 {
            let key = format!("sha256:{k:064x}");
            let picks: Vec<PeerId> = nodes
                .iter()
                .map(|me| {
                    let others: Vec<PeerId> = nodes.iter().filter(|p| *p != me).copied().collect();
                    match Closest::<u32>::new(*me).closest_of(&key, &others) {
                        Coordinator::Me => *me,
                        Coordinator::Other(p) => p,
                    }
                })
                .collect();
            assert!(picks.iter().all(|p| *p == picks[0]), "key {k}");
        }
        // Alone, or closer than everyone found: this node.
        let me = PeerId::random();
        assert_eq!(
            Closest::<u32>::new(me).closest_of("k", &[]),
            Coordinator::Me
        );
    }

    #[test]
    fn only_walks_that_ran_to_their_end_stand_for_their_key_for_a_while() {
        let me = PeerId::random();
        let other = PeerId::random();
        let mut closest = Closest::new(me);
        let now = Instant::now();
        let (a, b, c) = (1u32, 2, 3);
        closest.walking(a, "one".into());
        closest.walking(b, "two".into());
        closest.walking(c, "three".into());
        assert!(closest.is_walking("two"));
        closest.abandoned(&b);
        assert!(!closest.is_walking("two"));
        let one = closest.walked(&a, Some(&[other]), now);
        assert_eq!(one, Some(("one".into(), false)));
        assert_eq!(closest.walked(&b, Some(&[other]), now), None);
        let three = closest.walked(&c, None, now);
        assert_eq!(three, Some(("three".into(), false)));
        assert!(closest.coordinator("one", now).is_some());
        assert!(closest.coordinator("two", now).is_none());
        assert!(closest.coordinator("three", now).is_none());
        assert!(closest.coordinator("one", now + CLOSEST_FRESH).is_none());
    }

    #[test]
    fn a_walk_cut_short_answers_its_waiters_but_stands_for_nothing() {
        let me = PeerId::random();
        let other = PeerId::random();
        let mut closest = Closest::new(me);
        let now = Instant::now();
        closest.walking(1u32, "key".into());
        closest.walking(2u32, "other".into());
        assert_eq!(closest.cut("key"), vec![1]);
        assert!(closest.is_walking("key"), "its answer is still to come");
        assert!(closest.cut("key").is_empty(), "cut once");
        let ended = closest.walked(&1, Some(&[other]), now);
        assert_eq!(ended, Some(("key".into(), true)));
        assert!(!closest.is_walking("key"));
        assert!(closest.coordinator("key", now).is_none());
        assert!(closest.is_walking("other"));
    }
}
