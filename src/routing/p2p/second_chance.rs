//! A second chance for keys whose placement this round may have missed their closest nodes:
//! keys planned by a walk that timed out (it placed them on the nodes it reached, which need
//! not be the closest, where lookups look) and keys of a batch that was not delivered. They
//! are announced once more a while later, when a passing overload (a pool of nodes starting
//! at once, a node hung mid-walk) has usually gone, instead of staying unfindable from some
//! nodes until the next round.
//!
//! Bounded twice over: a key gets one second chance per round, however its second walk ends;
//! and a round gives at most [`BUDGET_SHARE`] of its keys one (at least [`BUDGET_MIN`]), so a
//! round costs at most 1.2 times its walks and batches. Without the budget, retrying every
//! key of a network that did not answer doubled the work of the overload that was the cause:
//! measured, 300 nodes x 10,000 keys started at once on 2 cores took their first round into
//! the next (2.7-4.8 million placements still waiting after 290-880 s, against all placed in
//! 256 s with second chances off), also when the retries were held back while walks timed out
//! (a few walks still converge in an overload, and a retry's keys spread over many walks).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The share of a round's keys that may have a second chance.
const BUDGET_SHARE: f64 = 0.2;
/// Second chances a round may give whatever its size: a node with few keys, or one whose walks
/// all met a hung node, has them all retried.
const BUDGET_MIN: usize = 256;

#[derive(Debug)]
pub struct SecondChance {
    after: Duration,
    /// Keys waiting for their second chance, oldest first, each group with when it is due.
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
    /// already, while the budget of a round of `provided` keys lasts; returns how many.
    pub fn add(
        &mut self,
        keys: impl IntoIterator<Item = Arc<str>>,
        now: Instant,
        provided: usize,
    ) -> usize {
        let budget = BUDGET_MIN.max((provided as f64 * BUDGET_SHARE) as usize);
        let mut fresh = Vec::new();
        for key in keys {
            if self.given.len() >= budget {
                break;
            }
            if self.given.insert(key.clone()) {
                fresh.push(key);
            }
        }
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

    /// A round starts: it announces every key again, what waits included, and every key may
    /// have a chance again.
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

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn keys_come_back_once_when_due_and_again_only_after_a_round() {
        let after = secs(60);
        let mut chance = SecondChance::new(after);
        let t0 = Instant::now();
        assert_eq!(chance.add(keys(&["a", "b"]), t0, 4), 2);
        // A key met twice in a round (two timed-out walks, a failed batch) waits once.
        assert_eq!(chance.add(keys(&["b", "c"]), t0 + secs(10), 4), 1);
        assert!(chance.due(t0 + secs(59)).is_empty());
        assert_eq!(chance.due(t0 + after), keys(&["a", "b"]));
        assert!(chance.due(t0 + after).is_empty());
        assert_eq!(chance.due(t0 + secs(70)), keys(&["c"]));
        // The second walk timed out too: no third chance this round.
        assert_eq!(chance.add(keys(&["a"]), t0 + secs(80), 4), 0);
        assert!(chance.due(t0 + secs(3_600)).is_empty());

        // A new round: what waited is part of it, and every key has a chance again.
        assert_eq!(chance.add(keys(&["d"]), t0 + secs(90), 4), 1);
        chance.round_started();
        assert!(chance.due(t0 + secs(3_600)).is_empty());
        assert_eq!(chance.add(keys(&["a", "d"]), t0, 4), 2);
    }

    #[test]
    fn a_round_gives_a_fifth_of_its_keys_a_second_chance_and_small_rounds_all() {
        let all: Vec<Arc<str>> = (0..10_000).map(|i| Arc::from(format!("k{i}"))).collect();
        let t0 = Instant::now();
        let mut chance = SecondChance::new(secs(60));
        let n = all.len();
        assert_eq!(chance.add(all[..1_500].iter().cloned(), t0, n), 1_500);
        assert_eq!(chance.add(all[1_500..].iter().cloned(), t0, n), 500);
        assert_eq!(chance.add(all.iter().cloned(), t0, n), 0);
        assert_eq!(chance.due(t0 + secs(60)).len(), 2_000);

        chance.round_started();
        assert_eq!(chance.add(all[..100].iter().cloned(), t0, 100), 100);
        chance.round_started();
        assert_eq!(
            chance.add(all[..1_000].iter().cloned(), t0, 1_000),
            BUDGET_MIN
        );
    }
}
