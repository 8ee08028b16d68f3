//! The coordinator's lease table: per digest, who leads its download and whom each follower
//! streams from, as a tree (`docs/design/relays.md`). Pure logic over an injected clock.
//!
//! Invariant: no member streams a blob to more than `fanout` recorded followers (plus one in
//! turn per [`MAX_MEMBERS`] past the record), and no claimant is attached inside its own
//! subtree.

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
/// A report against a leader promoted this recently, from a follower attached to it before, is
/// about the relay it was: that follower was cut when the leader's own source stalled (a peer's
/// idle timeout, 5 s by default), and its fresh download from upstream is not what failed.
pub(crate) const PROMOTED_GRACE: Duration = Duration::from_secs(5);

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
    /// When the leader took over from a reported one.
    promoted: Option<Instant>,
    leader: usize,
    members: Vec<Member>,
    /// Claimants past [`MAX_MEMBERS`] sent so far, to spread the next one.
    unrecorded: usize,
}

#[derive(Debug)]
struct Member {
    peer: Peer,
    parent: Option<usize>,
    /// When it was attached to `parent`.
    since: Instant,
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
                tree.failed(failed, &claimant.id, now);
            }
            if tree.members[tree.leader].alive {
                return tree.attach(claimant, self.fanout, self.chain, now);
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
            promoted: None,
            leader: 0,
            members: vec![Member::new(leader.clone(), None, 0, now)],
            unrecorded: 0,
        }
    }

    fn find(&self, id: &str) -> Option<usize> {
        self.members.iter().position(|m| m.peer.id == id)
    }

    /// A member that could not be followed: no one is sent to it again.
    fn failed(&mut self, id: &str, claimant: &str, now: Instant) {
        let Some(i) = self.find(id) else { return };
        if i == self.leader && self.about_the_relay_it_was(claimant, now) {
            return;
        }
        self.set_alive(i, false);
    }

    /// The leader was promoted under [`PROMOTED_GRACE`] ago, and `claimant` followed it before.
    fn about_the_relay_it_was(&self, claimant: &str, now: Instant) -> bool {
        let Some(promoted) = self.promoted else {
            return false;
        };
        let follower = self.find(claimant).map(|c| &self.members[c]);
        now.saturating_duration_since(promoted) < PROMOTED_GRACE
            && follower.is_some_and(|f| f.parent == Some(self.leader) && f.since < promoted)
    }

    /// Keeps each parent's `children` the count of its live children.
    fn set_alive(&mut self, i: usize, alive: bool) {
        if self.members[i].alive == alive {
            return;
        }
        self.members[i].alive = alive;
        if let Some(p) = self.members[i].parent {
            let children = &mut self.members[p].children;
            *children = if alive {
                *children + 1
            } else {
                children.saturating_sub(1)
            };
        }
    }

    fn set_parent(&mut self, i: usize, parent: Option<usize>, now: Instant) {
        let alive = self.members[i].alive;
        self.set_alive(i, false);
        self.members[i].parent = parent;
        self.members[i].since = now;
        self.set_alive(i, alive);
    }

    /// The claimant's live source while it has room for it, else a new one outside the
    /// claimant's own subtree.
    fn attach(&mut self, claimant: &Peer, fanout: usize, chain: usize, now: Instant) -> Grant {
        let me = self.find(&claimant.id);
        if me == Some(self.leader) {
            return Grant::Lead;
        }
        if let Some(me) = me {
            self.set_alive(me, true);
            if let Some(parent) = self.members[me].parent
                && self.members[parent].alive
                && (fanout == 0 || self.members[parent].children <= fanout)
            {
                return self.follow(parent);
            }
        }
        if me.is_none() && self.members.len() >= MAX_MEMBERS {
            let source = if fanout == 0 {
                self.leader
            } else {
                self.in_turn()
            };
            return self.follow(source);
        }
        let source = if fanout == 0 {
            self.leader
        } else {
            self.roomiest(me, fanout, chain)
        };
        let depth = self.members[source].depth + 1;
        match me {
            Some(me) => {
                self.set_parent(me, Some(source), now);
                self.redepth();
            }
            None => {
                self.members
                    .push(Member::new(claimant.clone(), Some(source), depth, now));
                self.members[source].children += 1;
            }
        }
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

    /// A claimant past [`MAX_MEMBERS`] is not recorded, so it cannot be counted against a
    /// source's fanout (nor its slot given back): the live members take turns feeding one each.
    fn in_turn(&mut self) -> usize {
        let live = (self.members.iter()).filter(|m| m.alive).count();
        self.unrecorded += 1;
        let turn = self.unrecorded % live.max(1);
        (0..self.members.len())
            .filter(|&i| self.members[i].alive)
            .nth(turn)
            .unwrap_or(self.leader)
    }

    /// Every member's depth from the parent links, after one moved with its subtree; each
    /// member is walked once.
    fn redepth(&mut self) {
        let n = self.members.len();
        let mut known: Vec<Option<usize>> = vec![None; n];
        let mut path = Vec::new();
        for start in 0..n {
            let (mut i, mut above) = (start, None);
            // Bounded, like `descends`, against a bug in the parent links.
            while path.len() <= n {
                if let Some(d) = known[i] {
                    above = Some(d);
                    break;
                }
                path.push(i);
                match self.members[i].parent {
                    Some(p) => i = p,
                    None => break,
                }
            }
            // `path` climbs from `start` to the root (depth 0) or to a child of a known member.
            let mut depth = match above {
                Some(d) => d + path.len(),
                None => path.len().saturating_sub(1),
            };
            for &j in &path {
                known[j] = Some(depth);
                self.members[j].depth = depth;
                depth = depth.saturating_sub(1);
            }
            path.clear();
        }
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
                self.members
                    .push(Member::new(claimant.clone(), None, 0, now));
                self.members.len() - 1
            }
        };
        self.set_parent(me, None, now);
        self.set_alive(me, true);
        self.redepth();
        self.leader = me;
        self.granted = now;
        self.promoted = Some(now);
    }
}

impl Member {
    fn new(peer: Peer, parent: Option<usize>, depth: usize, since: Instant) -> Member {
        Member {
            peer,
            parent,
            since,
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

    /// The leader of a chain stalls: every member below it is cut at once and each reports its
    /// own source. Whatever order the reports come in, one member takes over and the chain
    /// ends up fed by it: one more upstream fetch, not one per member.
    #[test]
    fn a_stalled_leaders_chain_reports_in_any_order_and_promotes_one() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let later = t + Duration::from_secs(1);
        let claims = |leases: &Leases, reports: &[(&str, &str)]| -> Vec<String> {
            reports
                .iter()
                .map(|(me, failed)| src(leases.claim(&d, &peer(me), Some(failed), later)))
                .collect()
        };

        // 1 reports 0 first and leads; 2's report of it (it relayed nothing) is about the relay
        // it was, so 2 follows it; 3's report of 2 sends 3 to 1 too.
        let leases = Leases::new(1);
        storm(&leases, &d, 3, t);
        assert_eq!(
            claims(&leases, &[("1", "0"), ("2", "1"), ("3", "2")]),
            ["lead", "1", "1"]
        );

        // The other way round: 3 and 2 are first sent elsewhere, 1 takes over, and their next
        // reports (of the stalled 0) send them to the new leader's chain, not to 0.
        let leases = Leases::new(1);
        storm(&leases, &d, 3, t);
        assert_eq!(
            claims(&leases, &[("3", "2"), ("2", "1"), ("1", "0")]),
            ["1", "0", "lead"]
        );
        assert_eq!(claims(&leases, &[("3", "0"), ("2", "0")]), ["1", "3"]);
    }

    /// The grace covers only the new leader's old followers, and only for a while: a follower
    /// attached after the promotion, or any report past the grace, is about its download.
    #[test]
    fn a_new_leader_is_reported_by_its_new_followers_or_after_the_grace() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let later = t + Duration::from_secs(1);
        // A tree: 0 feeds 1 and 2, 1 feeds 3; 0 stalls and 1 takes over.
        let promoted = || {
            let leases = Leases::with_chain(2, 0);
            storm(&leases, &d, 3, t);
            assert_eq!(src(leases.claim(&d, &peer("1"), Some("0"), later)), "lead");
            leases
        };
        let leases = promoted();
        assert_eq!(src(leases.claim(&d, &peer("3"), Some("1"), later)), "1");
        assert_eq!(src(leases.claim(&d, &peer("4"), None, later)), "1");
        assert_eq!(src(leases.claim(&d, &peer("4"), Some("1"), later)), "lead");

        let leases = promoted();
        let past = later + PROMOTED_GRACE;
        assert_eq!(src(leases.claim(&d, &peer("3"), Some("1"), past)), "lead");
    }

    /// Claimants past the members a tree records follow too, spread over the live members one
    /// each, and take no slot: the recorded tree keeps its fanout and its counts.
    #[test]
    fn past_the_recorded_members_claimants_share_the_sources_without_taking_slots() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let leases = Leases::new(2);
        let sources = storm(&leases, &d, MAX_MEMBERS + 500, t);
        let mut per_source: HashMap<&str, usize> = HashMap::new();
        for s in &sources {
            *per_source.entry(s.as_str()).or_default() += 1;
        }
        assert!(
            per_source.values().all(|n| *n <= 3),
            "at most 2 recorded and 1 more"
        );
        let table = leases.table.lock().unwrap();
        let tree = &table[&d];
        assert_eq!(tree.members.len(), MAX_MEMBERS);
        assert_counts_live_children(tree);
        // The unrecorded took no slot: the recorded tree has one free for each member but one.
        let free: usize = tree.members.iter().map(|m| 2 - m.children).sum();
        assert_eq!(free, MAX_MEMBERS + 1);
    }

    /// A member that moves takes its subtree with it: the depths below it follow, so a chain
    /// under it still ends where its length says.
    #[test]
    fn a_moved_members_subtree_takes_its_new_depth() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let leases = Leases::with_chain(2, 3);
        // A chain 0 -> 1 -> 2 -> 3; then 2 reports 1 and moves under 0, taking 3 with it.
        storm(&leases, &d, 3, t);
        assert_eq!(src(leases.claim(&d, &peer("2"), Some("1"), t)), "0");
        {
            let table = leases.table.lock().unwrap();
            let tree = &table[&d];
            let depth = |id: &str| tree.members[tree.find(id).unwrap()].depth;
            assert_eq!((depth("0"), depth("2"), depth("3")), (0, 1, 2));
        }
        // 3 is two hops down, so the chain goes on from it (at its stale depth of 3 it could not).
        assert_eq!(src(leases.claim(&d, &peer("4"), None, t)), "3");
    }

    /// A member that re-attaches frees its slot at its old source, and one that comes back to
    /// a source that gave its slot away goes elsewhere: no member feeds more than the fanout,
    /// and each counts exactly its live children.
    #[test]
    fn a_member_that_moves_frees_its_slot() {
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        let leases = Leases::new(1);
        storm(&leases, &d, 3, t);
        // 2 reports 1 and moves to 0; 1 comes back, finds 0 full and goes to the chain's end.
        assert_eq!(src(leases.claim(&d, &peer("2"), Some("1"), t)), "0");
        assert_eq!(src(leases.claim(&d, &peer("1"), None, t)), "3");
        assert_eq!(src(leases.claim(&d, &peer("4"), None, t)), "1");
        let table = leases.table.lock().unwrap();
        let tree = &table[&d];
        assert_counts_live_children(tree);
        for m in &tree.members {
            assert!(m.children <= 1, "member {} feeds {}", m.peer.id, m.children);
        }
    }

    /// Every member's `children` is the count of its live children.
    fn assert_counts_live_children(tree: &Tree) {
        for (i, m) in tree.members.iter().enumerate() {
            let live = (tree.members.iter())
                .filter(|c| c.alive && c.parent == Some(i))
                .count();
            assert_eq!(
                m.children, live,
                "member {} counts {}",
                m.peer.id, m.children
            );
        }
    }
}
