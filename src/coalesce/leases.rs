//! The coordinator's lease table: per digest, who leads its download and whom each follower
//! streams from, as a tree (`docs/design/relays.md`). Pure logic over an injected clock.
//!
//! Invariant: no member streams a blob to more than `fanout` followers, and no claimant is
//! attached inside its own subtree.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::routing::clock::Instant;

use crate::oci::Digest;
use crate::routing::Peer;

/// A leader is trusted this long; a slower download gets a second leader (one more upstream
/// fetch, never a failure).
pub(crate) const LEASE: Duration = Duration::from_secs(600);
const MAX_LEASES: usize = 100_000;
/// Followers form a chain this many hops deep before any member streams to a second one: a
/// second follower halves what each gets, a hop only adds a relay's lag.
pub(crate) const CHAIN_DEPTH: usize = 16;
/// Members of one tree that may be sources; later claimants follow without becoming one.
const MAX_MEMBERS: usize = 4_096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The claimant leads: its containerd fetches from upstream.
    Lead,
    /// Stream from `source`. The leader is named too: a follower whose source and coordinator
    /// both die follows it.
    Follow { source: Peer, leader: Peer },
}

/// One digest's download: the leader is `members[0]` until it is replaced.
#[derive(Debug)]
struct Tree {
    granted: Instant,
    leader: usize,
    members: Vec<Member>,
}

#[derive(Debug)]
struct Member {
    peer: Peer,
    parent: Option<usize>,
    depth: usize,
    children: usize,
    alive: bool,
}

#[derive(Debug)]
pub(crate) struct Leases {
    /// Followers one member may stream to; 0: all follow the leader.
    fanout: usize,
    chain: usize,
    table: Mutex<HashMap<Digest, Tree>>,
}

impl Default for Leases {
    fn default() -> Leases {
        Leases::new(0)
    }
}

impl Leases {
    pub(crate) fn new(fanout: usize) -> Leases {
        Leases::with_chain(fanout, CHAIN_DEPTH)
    }

    pub(crate) fn with_chain(fanout: usize, chain: usize) -> Leases {
        Leases {
            fanout,
            chain,
            table: Mutex::default(),
        }
    }

    /// `claimant` asks whom to stream `digest` from, reporting `failed` (a source it could not
    /// follow). The first claimant leads until its lease ends or it is reported.
    pub(crate) fn claim(
        &self,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
        now: Instant,
    ) -> Grant {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tree) = table.get_mut(digest)
            && now.saturating_duration_since(tree.granted) < LEASE
        {
            if let Some(failed) = failed {
                tree.failed(failed);
            }
            if tree.members[tree.leader].alive {
                return tree.attach(claimant, self.fanout, self.chain);
            }
            // The leader was reported: the claimant leads, keeping its own followers.
            tree.promote(claimant, now);
            return Grant::Lead;
        }
        make_room(&mut table, now);
        table.insert(digest.clone(), Tree::new(claimant, now));
        Grant::Lead
    }
}

/// Drops expired leases, then the oldest tenth, to keep the table within [`MAX_LEASES`]: one
/// walk of the table per tenth of it, not one per claim, when claims for random digests
/// keep it full.
fn make_room(table: &mut HashMap<Digest, Tree>, now: Instant) {
    if table.len() < MAX_LEASES {
        return;
    }
    table.retain(|_, t| now.saturating_duration_since(t.granted) < LEASE);
    if table.len() >= MAX_LEASES {
        let mut ages: Vec<Instant> = table.values().map(|t| t.granted).collect();
        let tenth = MAX_LEASES / 10;
        let (_, cut, _) = ages.select_nth_unstable(tenth);
        let cut = *cut;
        table.retain(|_, t| t.granted > cut);
    }
}

impl Tree {
    fn new(leader: &Peer, now: Instant) -> Tree {
        Tree {
            granted: now,
            leader: 0,
            members: vec![Member::new(leader.clone(), None, 0)],
        }
    }

    fn find(&self, id: &str) -> Option<usize> {
        self.members.iter().position(|m| m.peer.id == id)
    }

    /// A member that could not be followed: no one is sent to it again.
    fn failed(&mut self, id: &str) {
        if let Some(i) = self.find(id)
            && self.members[i].alive
        {
            self.members[i].alive = false;
            if let Some(p) = self.members[i].parent {
                self.members[p].children = self.members[p].children.saturating_sub(1);
            }
        }
    }

    /// The claimant's live source, else a new one outside its own subtree.
    fn attach(&mut self, claimant: &Peer, fanout: usize, chain: usize) -> Grant {
        let me = self.find(&claimant.id);
        if me == Some(self.leader) {
            return Grant::Lead;
        }
        if let Some(me) = me {
            self.members[me].alive = true;
            if let Some(parent) = self.members[me].parent
                && self.members[parent].alive
            {
                return self.follow(parent);
            }
        }
        let source = if fanout == 0 {
            self.leader
        } else {
            self.roomiest(me, fanout, chain)
        };
        let depth = self.members[source].depth + 1;
        match me {
            Some(me) => {
                let member = &mut self.members[me];
                member.parent = Some(source);
                member.depth = depth;
            }
            None if self.members.len() < MAX_MEMBERS => {
                self.members
                    .push(Member::new(claimant.clone(), Some(source), depth));
            }
            // Not recorded: it follows without becoming a source.
            None => {}
        }
        self.members[source].children += 1;
        self.follow(source)
    }

    fn follow(&self, source: usize) -> Grant {
        Grant::Follow {
            source: self.members[source].peer.clone(),
            leader: self.members[self.leader].peer.clone(),
        }
    }

    /// The end of a chain shorter than `chain` hops, else the shallowest member with fewer than
    /// `fanout` children (ties: earliest); never dead or in `me`'s subtree (it waits for `me`).
    fn roomiest(&self, me: Option<usize>, fanout: usize, chain: usize) -> usize {
        let open: Vec<usize> = (0..self.members.len())
            .filter(|&i| {
                let m = &self.members[i];
                m.alive && m.children < fanout && !me.is_some_and(|me| self.descends(i, me))
            })
            .collect();
        let shallowest = |candidates: &mut dyn Iterator<Item = usize>| {
            candidates.min_by_key(|&i| (self.members[i].depth, i))
        };
        let chain_end = shallowest(
            &mut open
                .iter()
                .copied()
                .filter(|&i| self.members[i].children == 0 && self.members[i].depth < chain),
        );
        chain_end
            .or_else(|| shallowest(&mut open.iter().copied()))
            .unwrap_or(self.leader)
    }

    fn descends(&self, mut i: usize, ancestor: usize) -> bool {
        // A bound keeps a bug in the parent links from looping forever.
        for _ in 0..=self.members.len() {
            if i == ancestor {
                return true;
            }
            match self.members[i].parent {
                Some(p) => i = p,
                None => return false,
            }
        }
        false
    }

    /// `claimant` leads from now on, fetching what it lacks upstream.
    fn promote(&mut self, claimant: &Peer, now: Instant) {
        let me = match self.find(&claimant.id) {
            Some(me) => me,
            None => {
                self.members.push(Member::new(claimant.clone(), None, 0));
                self.members.len() - 1
            }
        };
        if let Some(p) = self.members[me].parent.take() {
            self.members[p].children = self.members[p].children.saturating_sub(1);
        }
        let member = &mut self.members[me];
        member.depth = 0;
        member.alive = true;
        self.leader = me;
        self.granted = now;
    }
}

impl Member {
    fn new(peer: Peer, parent: Option<usize>, depth: usize) -> Member {
        Member {
            peer,
            parent,
            depth,
            children: 0,
            alive: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str) -> Peer {
        Peer {
            id: id.into(),
            addr: "10.0.0.1:5481".parse().unwrap(),
        }
    }

    fn src(grant: Grant) -> String {
        match grant {
            Grant::Lead => "lead".into(),
            Grant::Follow { source, .. } => source.id,
        }
    }

    /// M3: claims for random digests keep the table full; it stays within its bound, the
    /// newest leases are kept, and the walk to make room comes once per tenth of the table.
    #[test]
    fn a_flood_of_claims_keeps_the_table_bounded_and_the_newest_leases() {
        let leases = Leases::default();
        let start = Instant::now();
        let at = |i: usize| start + Duration::from_micros(i as u64);
        let digest = |i: usize| Digest::sha256_of(&i.to_le_bytes());
        for i in 0..MAX_LEASES + 5 {
            leases.claim(&digest(i), &peer("a"), None, at(i));
        }
        let len = || leases.table.lock().unwrap().len();
        assert!(len() <= MAX_LEASES && len() >= MAX_LEASES - MAX_LEASES / 10);
        let newest = MAX_LEASES + 4;
        assert_eq!(
            src(leases.claim(&digest(newest), &peer("b"), None, at(newest))),
            "a"
        );
        assert_eq!(
            src(leases.claim(&digest(0), &peer("b"), None, at(newest))),
            "lead",
            "the oldest went"
        );
    }

    #[test]
    fn the_first_claimant_leads_and_the_others_follow_it() {
        let leases = Leases::default();
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        assert_eq!(src(leases.claim(&d, &peer("a"), None, t)), "lead");
        assert_eq!(src(leases.claim(&d, &peer("b"), None, t)), "a");
        assert_eq!(src(leases.claim(&d, &peer("c"), None, t)), "a");
        // The leader asking again still leads.
        assert_eq!(src(leases.claim(&d, &peer("a"), None, t)), "lead");
        let other = Digest::sha256_of(b"other layer");
        assert_eq!(src(leases.claim(&other, &peer("c"), None, t)), "lead");
    }

    #[test]
    fn a_reported_or_expired_leader_is_replaced_by_the_claimant() {
        let leases = Leases::default();
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        leases.claim(&d, &peer("a"), None, t);
        // A report about someone else changes nothing.
        assert_eq!(src(leases.claim(&d, &peer("b"), Some("z"), t)), "a");
        assert_eq!(src(leases.claim(&d, &peer("b"), Some("a"), t)), "lead");
        assert_eq!(src(leases.claim(&d, &peer("c"), None, t)), "b");
        let later = t + LEASE + Duration::from_secs(1);
        assert_eq!(src(leases.claim(&d, &peer("c"), None, later)), "lead");
    }

    /// Claims of nodes `1..=n` after `0` leads; the source each got, by node.
    fn storm(leases: &Leases, d: &Digest, n: usize, t: Instant) -> Vec<String> {
        assert_eq!(src(leases.claim(d, &peer("0"), None, t)), "lead");
        (1..=n)
            .map(|i| match leases.claim(d, &peer(&i.to_string()), None, t) {
                Grant::Follow { source, leader } => {
                    assert_eq!(leader.id, "0");
                    source.id
                }
                Grant::Lead => panic!("{i} leads"),
            })
            .collect()
    }

    #[test]
    fn followers_fill_the_tree_breadth_first_and_no_member_exceeds_the_fanout() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let sources = storm(&Leases::with_chain(2, 0), &d, 6, t);
        // 0 feeds 1 and 2; 1 feeds 3 and 4; 2 feeds 5 and 6.
        assert_eq!(sources, ["0", "0", "1", "1", "2", "2"]);

        let chain = storm(&Leases::new(1), &d, 4, t);
        assert_eq!(chain, ["0", "1", "2", "3"]);

        // A chain of three hops first, then a second follower at the shallowest member.
        let chained = storm(&Leases::with_chain(2, 3), &d, 6, t);
        assert_eq!(chained, ["0", "1", "2", "0", "4", "5"]);

        let many = storm(&Leases::new(3), &d, 1_000, t);
        let mut per_source = HashMap::new();
        for s in &many {
            *per_source.entry(s.as_str()).or_insert(0) += 1;
        }
        assert!(per_source.values().all(|n| *n <= 3), "{per_source:?}");

        let flat = storm(&Leases::new(0), &d, 5, t);
        assert!(flat.iter().all(|s| s == "0"), "fanout 0 is no relays");
    }

    #[test]
    fn a_dead_relays_followers_reattach_outside_their_own_subtree() {
        let leases = Leases::new(1);
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        storm(&leases, &d, 4, t);
        // 1 dies; 2 reports it and must not be sent to 3 or 4 (they wait for 2).
        assert_eq!(src(leases.claim(&d, &peer("2"), Some("1"), t)), "0");
        let leases = Leases::with_chain(2, 0);
        storm(&leases, &d, 6, t);
        // 1 (feeding 3 and 4) dies: 3 takes its slot at the leader, 4 the next free one.
        assert_eq!(src(leases.claim(&d, &peer("3"), Some("1"), t)), "0");
        assert_eq!(src(leases.claim(&d, &peer("4"), Some("1"), t)), "3");
        assert_eq!(src(leases.claim(&d, &peer("3"), None, t)), "0");
        assert_ne!(src(leases.claim(&d, &peer("7"), None, t)), "1");
    }

    #[test]
    fn a_dead_leaders_first_reporter_leads_and_keeps_its_followers() {
        let leases = Leases::with_chain(2, 0);
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        storm(&leases, &d, 6, t);
        assert_eq!(src(leases.claim(&d, &peer("1"), Some("0"), t)), "lead");
        // 2 reports it too: attached (1 is full: 3 and 4), not a second leader.
        assert_eq!(src(leases.claim(&d, &peer("2"), Some("0"), t)), "3");
        // 3 and 4 still follow 1, now the leader.
        assert_eq!(src(leases.claim(&d, &peer("3"), None, t)), "1");
        // The dead leader coming back follows too.
        assert!(matches!(
            leases.claim(&d, &peer("0"), None, t),
            Grant::Follow { leader, .. } if leader.id == "1"
        ));
    }
}
