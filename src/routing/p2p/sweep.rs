//! The announcer's next region in one hop: after a region is planned, the known node nearest
//! the next one is asked for its closest nodes, instead of a Kademlia walk of about 30 requests
//! (docs/design/announce-sweep.md).
//!
//! Invariant: an answer stands for a region only when a node that gave one shares as many
//! leading bits with the target as the farthest of the nodes chosen: then the region's nodes
//! fill buckets of its own that are not full, so it knows them all. Otherwise the next hop,
//! and after `MAX_HOPS` a walk.

use std::collections::{HashMap, HashSet};

use libp2p::kad::{KBucketKey, KadPeer, RecordKey};
use libp2p::{Multiaddr, PeerId, Swarm};

use super::announce_plan::{
    Hash, MAX_ADDRESSES, MAX_KEY_LEN, WirePeer, common_prefix, peer_hash, xor,
};
use super::behaviour::Behaviour;

/// Hops before the region gets a walk of its own.
pub(super) const MAX_HOPS: usize = 3;
/// While tables fill in: the region's nearest nodes that must have answered, and the hops
/// allowed to reach them.
pub(super) const CONFIRM: usize = 3;
const MAX_CONFIRM_HOPS: usize = 8;
/// Nodes an answer names at most: Kademlia's k.
const MAX_ANSWER: usize = 20;
/// An answer names its nodes in at most this many bytes: half of what an asker reads
/// (`PROVIDE_ACK_MAX`), so long addresses shorten it instead of making it unreadable.
const ANSWER_BYTES: usize = 16 * 1024;

/// This node's table nearest `key`, without `except`.
pub(super) fn table_near(swarm: &mut Swarm<Behaviour>, key: &str, except: &PeerId) -> Vec<KadPeer> {
    let near = KBucketKey::new(RecordKey::new(&key));
    (swarm.behaviour_mut().kad)
        .find_closest_local_peers(&near, except)
        .take(MAX_ANSWER)
        .collect()
}

/// The answer to a hop from `asker`: this node's nodes nearest `key`, as Kademlia answers.
pub(super) fn answer(swarm: &mut Swarm<Behaviour>, asker: &PeerId, key: &str) -> Vec<WirePeer> {
    if key.len() > MAX_KEY_LEN {
        return Vec::new();
    }
    let mut budget = ANSWER_BYTES;
    let mut answer = Vec::new();
    for p in table_near(swarm, key, asker) {
        let id = p.node_id.to_string();
        let Some(left) = budget.checked_sub(id.len() + 32) else {
            break;
        };
        budget = left;
        let mut addrs = Vec::new();
        for a in p
            .multiaddrs
            .iter()
            .take(MAX_ADDRESSES)
            .map(|a| a.to_string())
        {
            let Some(left) = budget.checked_sub(a.len() + 4) else {
                break;
            };
            budget = left;
            addrs.push(a);
        }
        answer.push(WirePeer { id, addrs });
    }
    answer
}

/// What the announcer knows of the nodes near one target while it hops.
#[derive(Debug)]
pub(super) struct Hop {
    pub target: Hash,
    known: HashMap<PeerId, Vec<Multiaddr>>,
    asked: HashSet<PeerId>,
    /// Nodes that answered with nodes of their own.
    answered: HashSet<PeerId>,
    /// Nodes that could not be asked: never learnt again for this target.
    gone: HashSet<PeerId>,
    /// How many of the nearest known nodes must have answered (0: the invariant above only).
    confirm: usize,
}

impl Hop {
    /// `confirm`: [`CONFIRM`] while tables fill in, else 0.
    pub(super) fn new(
        target: Hash,
        known: impl IntoIterator<Item = (PeerId, Vec<Multiaddr>)>,
        confirm: usize,
    ) -> Hop {
        let mut hop = Hop {
            target,
            known: HashMap::new(),
            asked: HashSet::new(),
            answered: HashSet::new(),
            gone: HashSet::new(),
            confirm,
        };
        hop.learn(known);
        hop
    }

    fn learn(&mut self, peers: impl IntoIterator<Item = (PeerId, Vec<Multiaddr>)>) {
        for (peer, addrs) in peers {
            if self.gone.contains(&peer) {
                continue;
            }
            let known = self.known.entry(peer).or_default();
            if known.is_empty() {
                *known = addrs;
            }
        }
    }

    /// The next node to ask and where to reach it: the nearest known one not asked yet, or
    /// `None` after `MAX_HOPS` (`MAX_CONFIRM_HOPS` when confirming).
    pub(super) fn next(&mut self) -> Option<(PeerId, Vec<Multiaddr>)> {
        let most = if self.confirming() {
            MAX_CONFIRM_HOPS
        } else {
            MAX_HOPS
        };
        if self.asked.len() >= most {
            return None;
        }
        let peer = (self.known.keys())
            .filter(|p| !self.asked.contains(*p))
            .min_by_key(|p| xor(&self.target, &peer_hash(p)))
            .copied()?;
        self.asked.insert(peer);
        Some((peer, self.known[&peer].clone()))
    }

    /// `from` named `peers` (an older Ferry names none); `me`, the asker, is never one of the
    /// region's nodes.
    pub(super) fn answered(&mut self, from: PeerId, peers: &[WirePeer], me: &PeerId) {
        let parsed: Vec<(PeerId, Vec<Multiaddr>)> = (peers.iter().take(MAX_ANSWER))
            .filter_map(|p| {
                let id: PeerId = p.id.parse().ok()?;
                if id == *me {
                    return None;
                }
                let addrs = (p.addrs.iter().take(MAX_ADDRESSES))
                    .filter_map(|a| a.parse().ok())
                    .collect();
                Some((id, addrs))
            })
            .collect();
        if !parsed.is_empty() {
            self.answered.insert(from);
        }
        self.learn(parsed);
    }

    pub(super) fn confirming(&self) -> bool {
        self.confirm > 0
    }

    /// `peer` could not be asked: no record goes to it from this hop.
    pub(super) fn failed(&mut self, peer: &PeerId) {
        self.known.remove(peer);
        self.gone.insert(*peer);
    }

    /// The nearest known nodes (`replicas` at least, up to Kademlia's k, as a walk finds: each
    /// key then gets its own nearest), when they stand for the region they cover: a node that
    /// answered is as near the target as the farthest of them.
    pub(super) fn found(&self, replicas: usize) -> Option<Vec<(PeerId, Vec<Multiaddr>)>> {
        let mut near: Vec<(Hash, PeerId)> = (self.known.keys())
            .map(|p| (xor(&self.target, &peer_hash(p)), *p))
            .collect();
        if near.len() < replicas {
            return None;
        }
        near.sort_unstable();
        // A node that joined seconds ago is known to the nodes nearest it (its own lookup
        // asked them) before anyone farther out.
        if (near.iter().take(self.confirm)).any(|(_, p)| !self.answered.contains(p)) {
            return None;
        }
        near.truncate(replicas.max(MAX_ANSWER));
        let least = (near.iter())
            .map(|(_, p)| common_prefix(&self.target, &peer_hash(p)))
            .min()?;
        let inside =
            (self.answered.iter()).any(|p| common_prefix(&self.target, &peer_hash(p)) >= least);
        inside.then(|| {
            near.into_iter()
                .map(|(_, p)| (p, self.known[&p].clone()))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::announce_plan::Pending;
    use super::*;

    fn wire(peers: &[PeerId]) -> Vec<WirePeer> {
        peers
            .iter()
            .map(|p| WirePeer {
                id: p.to_string(),
                addrs: vec!["/ip4/10.0.0.1/tcp/5482".into()],
            })
            .collect()
    }

    /// The `k` of `all` nearest `target`.
    fn nearest(all: &[PeerId], target: &Hash, k: usize) -> Vec<PeerId> {
        let mut v: Vec<(Hash, PeerId)> = all
            .iter()
            .map(|p| (xor(target, &peer_hash(p)), *p))
            .collect();
        v.sort_unstable();
        v.into_iter().take(k).map(|(_, p)| p).collect()
    }

    /// Kademlia's routing table of a node at `me`: at most 20 nodes a bucket, the first heard of.
    fn table(me: &Hash, heard: impl Iterator<Item = PeerId>) -> Vec<PeerId> {
        let mut per_bucket = [0usize; 257];
        heard
            .filter(|p| {
                let h = peer_hash(p);
                let bucket = &mut per_bucket[common_prefix(me, &h) as usize];
                *bucket += 1;
                h != *me && *bucket <= 20
            })
            .collect()
    }

    /// One round's figures: walks, nodes asked a region, and the share of records on each
    /// key's 20 truly closest nodes.
    struct Round {
        walks: usize,
        per_region: f64,
        share: f64,
        /// The fewest of a key's 20 closest nodes that hold it.
        fewest: usize,
    }

    /// A round of `keys` by hops from `me`, each asked node answering from its `tables` entry.
    fn sweep_round(
        all: &[PeerId],
        tables: &HashMap<PeerId, Vec<PeerId>>,
        my_table: &[PeerId],
        keys: &[String],
        confirm: usize,
    ) -> Round {
        let mut pending = Pending::default();
        keys.iter().cloned().for_each(|k| pending.insert(k));
        let (mut walks, mut asked, mut regions) = (0, 0, 0);
        let mut stored: HashMap<String, Vec<PeerId>> = HashMap::new();
        let mut start = pending.pick([0x5a; 32]);
        let mut found: Vec<PeerId> = Vec::new();
        // Hops from this node's table, then from each region to the next.
        while let Some(next) = start {
            regions += 1;
            let near_me = nearest(my_table, &next, 20);
            let known = found.iter().chain(&near_me).map(|p| (*p, vec![]));
            let mut hop = Hop::new(next, known, confirm);
            found = loop {
                let Some((node, _)) = hop.next() else {
                    walks += 1;
                    break nearest(all, &next, 20);
                };
                asked += 1;
                let answer = wire(&nearest(&tables[&node], &next, 20));
                hop.answered(node, &answer, &PeerId::random());
                if let Some(f) = hop.found(20) {
                    break f.into_iter().map(|(p, _)| p).collect();
                }
            };
            let (plan, end) = pending.plan(&next, &found, false, 20);
            for (peer, keys) in plan {
                for k in keys {
                    stored.entry(k.to_string()).or_default().push(peer);
                }
            }
            start = end.and_then(|e| pending.after(&e));
        }
        assert!(keys.iter().all(|k| stored[k].len() == 20));
        // Checked for every fifth key.
        let (mut exact, mut checked, mut fewest) = (0, 0, 20);
        for k in keys.iter().step_by(5) {
            let truth = nearest(all, &super::super::announce_plan::key_hash(k), 20);
            let hits = stored[k].iter().filter(|p| truth.contains(p)).count();
            fewest = fewest.min(hits);
            exact += hits;
            checked += 1;
        }
        let round = Round {
            walks,
            per_region: asked as f64 / regions as f64,
            share: exact as f64 / (20.0 * checked as f64),
            fewest,
        };
        eprintln!(
            "confirm {confirm}: {walks} walks, {regions} regions, {:.2} nodes asked a region, {:.3} of the records on the closest nodes, fewest {fewest}",
            round.per_region, round.share
        );
        round
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("sha256:{i:064x}")).collect()
    }

    #[test]
    fn a_sweep_asks_a_node_or_two_a_region_and_records_land_where_kademlia_puts_them() {
        let all: Vec<PeerId> = (0..1_000).map(|_| PeerId::random()).collect();
        // Each node heard of the others in an order of its own.
        let tables: HashMap<PeerId, Vec<PeerId>> = (all.iter().enumerate())
            .map(|(i, p)| {
                let heard = all.iter().cycle().skip(i * 7).take(all.len()).copied();
                (*p, table(&peer_hash(p), heard))
            })
            .collect();
        let me = PeerId::random();
        let my_table = table(&peer_hash(&me), all.iter().copied());
        let round = sweep_round(&all, &tables, &my_table, &keys(10_000), 0);
        assert!(round.walks < 5, "{} walks for 10,000 keys", round.walks);
        assert!(
            round.per_region < 2.0,
            "{:.2} asked a region",
            round.per_region
        );
        // As a walk per region places them (`announce_plan.rs`): mostly the closest.
        assert!(round.share > 0.8, "{:.3} on the closest", round.share);
        assert!(
            round.fewest >= 4,
            "a key on {} of its closest",
            round.fewest
        );
    }

    /// 300 nodes joined seconds ago: each is known so far only to the 20 nodes nearest it
    /// (its own lookup asked them) and to this node. One answer from a node that has not
    /// heard of them passes the invariant; the region's nearest nodes have.
    #[test]
    fn while_tables_fill_in_the_nearest_nodes_confirm_a_region() {
        // Fixed identities: the same figures every run.
        let peer = |i: u32| {
            let mut seed = [7u8; 32];
            seed[..4].copy_from_slice(&i.to_be_bytes());
            let key = libp2p::identity::Keypair::ed25519_from_bytes(seed).expect("a key");
            key.public().to_peer_id()
        };
        let old: Vec<PeerId> = (0..700).map(peer).collect();
        let new: Vec<PeerId> = (700..1_000).map(peer).collect();
        let all: Vec<PeerId> = old.iter().chain(&new).copied().collect();
        let mut heard: HashMap<PeerId, Vec<PeerId>> =
            (all.iter()).map(|p| (*p, old.to_vec())).collect();
        for n in &new {
            for near in nearest(&all, &peer_hash(n), 21) {
                heard.get_mut(&near).expect("a node").push(*n);
            }
            heard.insert(*n, all.clone());
        }
        let tables: HashMap<PeerId, Vec<PeerId>> = (heard.into_iter())
            .map(|(p, h)| (p, table(&peer_hash(&p), h.into_iter())))
            .collect();
        let my_table = table(&peer_hash(&peer(1_000)), all.iter().copied());
        let keys = keys(3_000);
        let one = sweep_round(&all, &tables, &my_table, &keys, 0);
        let confirmed = sweep_round(&all, &tables, &my_table, &keys, CONFIRM);
        assert!(
            confirmed.share > one.share && confirmed.share > 0.8,
            "{:.3} of the records on the closest nodes when confirmed, {:.3} from one answer",
            confirmed.share,
            one.share
        );
        // A walk asks about 30 nodes.
        assert!(
            confirmed.per_region < 6.0,
            "{:.2} asked",
            confirmed.per_region
        );
        assert!(
            confirmed.walks * 10 < keys.len() / 100,
            "{} walks",
            confirmed.walks
        );
    }

    #[test]
    fn an_answer_from_inside_the_region_stands_for_it() {
        let all: Vec<PeerId> = (0..200).map(|_| PeerId::random()).collect();
        let target = [0x42u8; 32];
        let truth = nearest(&all, &target, 20);
        // Known: nodes far from the target, and the nearest one.
        let far = all.iter().filter(|p| !truth.contains(p)).take(5);
        let mut hop = Hop::new(target, far.chain([&truth[0]]).map(|p| (*p, vec![])), 0);
        let (asked, _) = hop.next().unwrap();
        assert_eq!(asked, truth[0], "the nearest known node is asked first");
        assert!(hop.found(20).is_none(), "nothing stands before an answer");
        hop.answered(asked, &wire(&truth[1..]), &PeerId::random());
        let found: Vec<PeerId> = hop.found(20).unwrap().into_iter().map(|(p, _)| p).collect();
        assert_eq!(found, truth);
    }

    #[test]
    fn an_answer_from_farther_out_does_not_stand_and_hops_end() {
        let all: Vec<PeerId> = (0..200).map(|_| PeerId::random()).collect();
        let target = [0x42u8; 32];
        let truth = nearest(&all, &target, 20);
        let least = (truth.iter())
            .map(|p| common_prefix(&target, &peer_hash(p)))
            .min()
            .unwrap();
        let outsider = *(all.iter())
            .find(|p| common_prefix(&target, &peer_hash(p)) < least)
            .unwrap();
        let mut hop = Hop::new(target, [(outsider, vec![])], 0);
        assert_eq!(hop.next().unwrap().0, outsider);
        hop.answered(outsider, &wire(&truth), &PeerId::random());
        assert!(
            hop.found(20).is_none(),
            "a node farther out than the region holds only some of it"
        );
        // The next hop asks the nearest node it has heard of; an empty answer is no answer.
        assert_eq!(hop.next().unwrap().0, truth[0]);
        hop.answered(truth[0], &[], &PeerId::random());
        assert!(hop.found(20).is_none());
        assert!(hop.next().is_some());
        assert!(hop.next().is_none(), "a walk after {MAX_HOPS} hops");
    }

    #[test]
    fn neither_the_asker_nor_a_node_that_failed_gets_the_region() {
        let all: Vec<PeerId> = (0..200).map(|_| PeerId::random()).collect();
        let target = [0x42u8; 32];
        let truth = nearest(&all, &target, 22);
        let (dead, me, answering) = (truth[0], truth[1], truth[2]);
        let mut hop = Hop::new(target, [(dead, vec![]), (answering, vec![])], 0);
        assert_eq!(hop.next().unwrap().0, dead);
        hop.failed(&dead);
        assert_eq!(hop.next().unwrap().0, answering);
        // The answer (20 nodes, the answering one not among them) names the dead node and
        // the asker too.
        let named: Vec<PeerId> = truth[..2].iter().chain(&truth[3..21]).copied().collect();
        hop.answered(answering, &wire(&named), &me);
        let found: Vec<PeerId> = hop.found(19).unwrap().into_iter().map(|(p, _)| p).collect();
        assert_eq!(found, truth[2..21]);
    }

    #[test]
    fn an_empty_answer_or_a_confused_one_names_nothing() {
        let target = [7u8; 32];
        let peer = PeerId::random();
        let mut hop = Hop::new(target, [(peer, vec![])], 0);
        hop.next();
        hop.answered(peer, &[], &PeerId::random());
        let junk = WirePeer {
            id: "not a peer".into(),
            addrs: vec!["nonsense".into()],
        };
        hop.answered(peer, &[junk], &PeerId::random());
        assert!(hop.found(1).is_none());
        assert_eq!(hop.known.len(), 1);
    }
}
