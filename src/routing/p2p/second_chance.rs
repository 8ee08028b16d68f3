//! A second chance for keys whose placement this round may have missed their closest nodes:
//! keys planned by a walk that timed out (it placed them on the nodes it reached, which need
//! not be the closest, where lookups look) and keys of a batch that was not delivered. Each
//! is announced once more a while later, when a passing overload (a pool of nodes starting at
//! once, a node restarting mid-batch) has usually gone, instead of staying unfindable from
//! some nodes until the next round.
//!
//! Bounded: a key gets one second chance per round, however its second walk ends, so a
//! round costs at most twice its walks and batches; retrying at once, or until placed, fed
//! the overload that made the walks time out (tried in the scale simulation: placements
//! snowballed).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct SecondChance {
    after: Duration,
    /// Keys waiting for their second chance, oldest first, each with when it is due.
    waiting: VecDeque<(Instant, Vec<Arc<str>>)>,
    /// Keys given their second chance this round (waiting or done).
    given: HashSet<Arc<str>>,
}

impl SecondChance {
    pub fn new(after: Duration) -> Self {
        SecondChance {
            after,
            waiting: VecDeque::new(),
            given: HashSet::new(),
        }
    }

    /// `keys` are announced again `after` from `now`, those not given a chance this round
    /// already; returns how many.
    pub fn add(&mut self, keys: impl IntoIterator<Item = Arc<str>>, now: Instant) -> usize {
        let fresh: Vec<Arc<str>> = keys
            .into_iter()
            .filter(|k| self.given.insert(k.clone()))
            .collect();
        let n = fresh.len();
        if n > 0 {
            self.waiting.push_back((now + self.after, fresh));
        }
        n
    }

    /// The keys whose second chance is due by `now`, each once.
    pub fn due(&mut self, now: Instant) -> Vec<Arc<str>> {
        let mut out = Vec::new();
        while self.waiting.front().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, keys)) = self.waiting.pop_front() {
                out.extend(keys);
            }
        }
        out
    }

    /// A round announces every key again: what waits is part of it, and every key has a
    /// chance again.
    pub fn round_started(&mut self) {
        self.waiting.clear();
        self.given.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> Vec<Arc<str>> {
        names.iter().map(|&n| Arc::from(n)).collect()
    }

    #[test]
    fn keys_come_back_once_when_due_and_again_only_after_a_round() {
        let after = Duration::from_secs(60);
        let mut chance = SecondChance::new(after);
        let t0 = Instant::now();
        assert_eq!(chance.add(keys(&["a", "b"]), t0), 2);
        // A key met twice in a round (two timed-out walks, a failed batch) waits once.
        assert_eq!(
            chance.add(keys(&["b", "c"]), t0 + Duration::from_secs(10)),
            1
        );
        assert!(chance.due(t0 + Duration::from_secs(59)).is_empty());
        assert_eq!(chance.due(t0 + after), keys(&["a", "b"]));
        assert!(chance.due(t0 + after).is_empty());
        assert_eq!(chance.due(t0 + Duration::from_secs(70)), keys(&["c"]));
        // The second walk timed out too: no third chance this round.
        assert_eq!(chance.add(keys(&["a"]), t0 + Duration::from_secs(80)), 0);
        assert!(chance.due(t0 + Duration::from_secs(3_600)).is_empty());

        // A new round: what waited is part of it, and every key has a chance again.
        assert_eq!(chance.add(keys(&["d"]), t0 + Duration::from_secs(90)), 1);
        chance.round_started();
        assert!(chance.due(t0 + Duration::from_secs(3_600)).is_empty());
        assert_eq!(chance.add(keys(&["a", "d"]), t0), 2);
    }
}
