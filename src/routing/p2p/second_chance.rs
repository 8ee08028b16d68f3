//! A second chance for keys whose placement this round may have missed their closest nodes:
//! keys planned by a walk that timed out (it placed them on the nodes it reached, which need
//! not be the closest, where lookups look) and keys of a batch that was not delivered. They
//! are announced once more a while later, when a passing overload (a pool of nodes starting
//! at once, a node hung mid-walk) has usually gone, instead of staying unfindable from some
//! nodes until the next round.
//!
//! Bounded twice over:
//! - a key gets one second chance per round, however its second walk ends;
//! - unless this node's last [`TRUST_AFTER`] walks converged, second chances go one walk's
//!   keys at a time, one a minute (a probe), and the rest follow once walks converge again
//!   (the probes' own, usually). Retrying every
//!   key of a network that does not answer doubled the work of an overload that was already
//!   the cause: measured, 300 nodes x 10,000 keys started at once on 2 cores took their first
//!   round into the next (placements still waiting after 880 s, against all placed in 250 s
//!   without second chances), whether or not the retries waited for each node's own round.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Walks converged in a row after which the network is taken to answer again. In an overload
/// where most walks time out a few still converge (14% of them in the 300-node start), so
/// the last walk alone says little; three in a row seldom happen there.
const TRUST_AFTER: u32 = 3;

#[derive(Debug)]
pub struct SecondChance {
    after: Duration,
    /// Keys waiting for their second chance, oldest first, each group with when it is due.
    waiting: VecDeque<(Instant, Vec<Arc<str>>)>,
    /// Keys given their second chance this round (waiting or done).
    given: HashSet<Arc<str>>,
    /// This node's announcement walks converged since the last that timed out.
    converged_in_a_row: u32,
    /// While walks time out, no probe before this.
    next_probe: Option<Instant>,
}

impl SecondChance {
    pub fn new(after: Duration) -> Self {
        SecondChance {
            after,
            waiting: VecDeque::new(),
            given: HashSet::new(),
            converged_in_a_row: TRUST_AFTER,
            next_probe: None,
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

    /// One of this node's announcement walks ended.
    pub fn walk_ended(&mut self, converged: bool) {
        self.converged_in_a_row = if converged {
            self.converged_in_a_row.saturating_add(1)
        } else {
            0
        };
    }

    /// The keys to announce again now, each once: every key due while walks converge;
    /// else the oldest due group alone, at most one group per `after`.
    pub fn due(&mut self, now: Instant) -> Vec<Arc<str>> {
        let mut out = Vec::new();
        if self.converged_in_a_row < TRUST_AFTER {
            if self.next_probe.is_some_and(|t| now < t) {
                return out;
            }
            if let Some(keys) = self.pop_due(now) {
                out = keys;
                self.next_probe = Some(now + self.after);
            }
            return out;
        }
        while let Some(keys) = self.pop_due(now) {
            out.extend(keys);
        }
        out
    }

    fn pop_due(&mut self, now: Instant) -> Option<Vec<Arc<str>>> {
        if self.waiting.front()?.0 > now {
            return None;
        }
        self.waiting.pop_front().map(|(_, keys)| keys)
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

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn keys_come_back_once_when_due_and_again_only_after_a_round() {
        let after = secs(60);
        let mut chance = SecondChance::new(after);
        let t0 = Instant::now();
        assert_eq!(chance.add(keys(&["a", "b"]), t0), 2);
        // A key met twice in a round (two timed-out walks, a failed batch) waits once.
        assert_eq!(chance.add(keys(&["b", "c"]), t0 + secs(10)), 1);
        assert!(chance.due(t0 + secs(59)).is_empty());
        assert_eq!(chance.due(t0 + after), keys(&["a", "b"]));
        assert!(chance.due(t0 + after).is_empty());
        assert_eq!(chance.due(t0 + secs(70)), keys(&["c"]));
        // The second walk timed out too: no third chance this round.
        assert_eq!(chance.add(keys(&["a"]), t0 + secs(80)), 0);
        assert!(chance.due(t0 + secs(3_600)).is_empty());

        // A new round: what waited is part of it, and every key has a chance again.
        assert_eq!(chance.add(keys(&["d"]), t0 + secs(90)), 1);
        chance.round_started();
        assert!(chance.due(t0 + secs(3_600)).is_empty());
        assert_eq!(chance.add(keys(&["a", "d"]), t0), 2);
    }

    #[test]
    fn while_walks_time_out_one_group_a_minute_goes_and_the_rest_once_one_converges() {
        let after = secs(60);
        let mut chance = SecondChance::new(after);
        let t0 = Instant::now();
        chance.add(keys(&["a", "b"]), t0);
        chance.add(keys(&["c"]), t0 + secs(1));
        chance.add(keys(&["d"]), t0 + secs(2));
        chance.walk_ended(false);
        // A probe: the oldest due group alone.
        assert_eq!(chance.due(t0 + secs(70)), keys(&["a", "b"]));
        assert!(chance.due(t0 + secs(71)).is_empty());
        // Its walk timed out too: the next probe a minute after the first.
        chance.walk_ended(false);
        assert!(chance.due(t0 + secs(129)).is_empty());
        assert_eq!(chance.due(t0 + secs(130)), keys(&["c"]));
        // Its walks converged, but not enough in a row yet: still one group a minute.
        chance.add(keys(&["e"]), t0 + secs(3));
        chance.walk_ended(true);
        chance.walk_ended(true);
        assert!(chance.due(t0 + secs(131)).is_empty());
        // Three in a row: the rest at once.
        chance.walk_ended(true);
        assert_eq!(chance.due(t0 + secs(131)), keys(&["d", "e"]));
    }
}
