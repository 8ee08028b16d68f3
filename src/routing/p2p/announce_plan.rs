//! Batched announcements: which nodes store which of this node's provider records, planned
//! from one walk per region of the key space; each storing node gets one `ProvideBatch`.
//!
//! Invariant: a record lands on the nodes a per-key announcement would have picked, or their
//! nearest neighbours, so a lookup finds it as it finds Kademlia's own.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use libp2p::PeerId;
use libp2p::kad::{KBucketKey, RecordKey};
use serde::{Deserialize, Serialize};

/// A position in the Kademlia key space (SHA-256 of a key or of a peer ID).
pub(crate) type Hash = [u8; 32];

/// At most this many keys in one request: a request stays under 100 KiB.
pub(crate) const MAX_KEYS_PER_BATCH: usize = 1_000;
/// A longer key is refused: keys are digests and `<registry>/<repo>:<tag>` names.
pub(crate) const MAX_KEY_LEN: usize = 512;
pub(crate) const MAX_ADDRESSES: usize = 8;

/// "I provide these keys; reach me here". The provider is the authenticated sender, never a
/// field of the request. `closest_to` asks for the receiver's nodes nearest a key as well
/// (`sweep.rs`); older Ferrys ignore it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct ProvideBatch {
    pub keys: Vec<String>,
    pub addrs: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closest_to: Option<String>,
}

/// How many records the receiver stored, which keys (positions in the request) it refused
/// as already full without the sender (`rest.rs`), and the nodes asked for; `full` and
/// `closest` are absent from older Ferrys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct ProvideAck {
    pub stored: u32,
    #[serde(default)]
    pub full: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub closest: Vec<WirePeer>,
}

/// A node and where to reach it, as a Kademlia answer names it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WirePeer {
    pub id: String,
    pub addrs: Vec<String>,
}

pub(crate) fn key_hash(key: &str) -> Hash {
    to_hash(KBucketKey::new(RecordKey::new(&key)).hashed_bytes())
}

pub(crate) fn peer_hash(peer: &PeerId) -> Hash {
    to_hash(KBucketKey::from(*peer).hashed_bytes())
}

pub(crate) fn to_hash(bytes: &[u8]) -> Hash {
    let mut h = [0u8; 32];
    h.copy_from_slice(&bytes[..32]);
    h
}

/// How many leading bits `a` and `b` share (256 when equal).
pub(super) fn common_prefix(a: &Hash, b: &Hash) -> u32 {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let diff = x ^ y;
        if diff != 0 {
            return i as u32 * 8 + diff.leading_zeros();
        }
    }
    256
}

pub(super) fn xor(a: &Hash, b: &Hash) -> Hash {
    let mut d = [0u8; 32];
    for (i, out) in d.iter_mut().enumerate() {
        *out = a[i] ^ b[i];
    }
    d
}

/// `h` with every bit from `bits` on set to `one`: an end of the subtree of its first `bits`.
fn subtree_end(h: &Hash, bits: u32, one: bool) -> Hash {
    let mut out = *h;
    for (i, byte) in out.iter_mut().enumerate() {
        let first = i as u32 * 8;
        if first + 8 <= bits {
            continue;
        }
        let keep = bits.saturating_sub(first); // leading bits of this byte to keep
        let mask = if keep == 0 { 0 } else { 0xffu8 << (8 - keep) };
        *byte = if one { *byte | !mask } else { *byte & mask };
    }
    out
}

/// The keys waiting to be announced, by position in the key space.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    keys: BTreeMap<Hash, String>,
}

impl Pending {
    pub(super) fn insert(&mut self, key: String) {
        self.keys.insert(key_hash(&key), key);
    }

    pub(super) fn remove(&mut self, key: &str) {
        self.keys.remove(&key_hash(key));
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub(super) fn key(&self, at: &Hash) -> Option<String> {
        self.keys.get(at).cloned()
    }

    /// The first key after `at`, else the first.
    pub(super) fn after(&self, at: &Hash) -> Option<Hash> {
        use std::ops::Bound::{Excluded, Unbounded};
        self.keys
            .range((Excluded(*at), Unbounded))
            .next()
            .or_else(|| self.keys.iter().next())
            .map(|(h, _)| *h)
    }

    /// The first key at or after `at`, else the first.
    pub(super) fn pick(&self, at: Hash) -> Option<Hash> {
        self.keys
            .range(at..)
            .next()
            .or_else(|| self.keys.iter().next())
            .map(|(h, _)| *h)
    }

    /// A walk to `target` found `found` (this node excluded; `whole_network` when it found
    /// fewer than asked). Takes the keys it covers out of the queue, each to its `replicas`
    /// closest found nodes, and says where the covered region ends (`None` when it covered
    /// every key or none). A walk that found nobody decides nothing.
    pub(super) fn plan(
        &mut self,
        target: &Hash,
        found: &[PeerId],
        whole_network: bool,
        replicas: usize,
    ) -> (HashMap<PeerId, Vec<Arc<str>>>, Option<Hash>) {
        // Shared, not copied once per storing node (10,000 keys would be 20 MB).
        let mut out: HashMap<PeerId, Vec<Arc<str>>> = HashMap::new();
        let peers: Vec<(PeerId, Hash)> = found.iter().map(|p| (*p, peer_hash(p))).collect();
        if peers.is_empty() {
            return (out, None);
        }
        let mut end = None;
        let covered: Vec<Hash> = if whole_network {
            // The walk saw every node: every key is decided.
            self.keys.keys().copied().collect()
        } else {
            // Every node sharing more than `least` leading bits with the target was found.
            let least = peers
                .iter()
                .map(|(_, h)| common_prefix(target, h))
                .min()
                .unwrap_or(0);
            let bits = (least + 1).min(256);
            let (lo, hi) = (
                subtree_end(target, bits, false),
                subtree_end(target, bits, true),
            );
            end = Some(hi);
            self.keys.range(lo..=hi).map(|(h, _)| *h).collect()
        };
        for h in covered {
            let Some(key) = self.keys.remove(&h) else {
                continue;
            };
            let key: Arc<str> = key.into();
            let mut by_distance: Vec<(Hash, PeerId)> =
                peers.iter().map(|(p, ph)| (xor(&h, ph), *p)).collect();
            by_distance.sort_unstable_by_key(|(d, _)| *d);
            for (_, peer) in by_distance.into_iter().take(replicas) {
                out.entry(peer).or_default().push(key.clone());
            }
        }
        (out, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("sha256:{i:064x}")).collect()
    }

    /// The `k` nodes of `all` closest to `key`: where Kademlia would put its records.
    fn closest(all: &[(PeerId, Hash)], key: &str, k: usize) -> Vec<PeerId> {
        let h = key_hash(key);
        let mut v: Vec<_> = all.iter().map(|(p, ph)| (xor(&h, ph), *p)).collect();
        v.sort();
        v.into_iter().take(k).map(|(_, p)| p).collect()
    }

    #[test]
    fn subtree_ends() {
        let h = [0b1010_1010u8; 32];
        let lo = subtree_end(&h, 3, false);
        let hi = subtree_end(&h, 3, true);
        assert_eq!(lo[0], 0b1010_0000);
        assert_eq!(hi[0], 0b1011_1111);
        assert!(lo[1..].iter().all(|b| *b == 0) && hi[1..].iter().all(|b| *b == 0xff));
        assert_eq!(subtree_end(&h, 256, true), h);
        assert_eq!(subtree_end(&h, 0, false), [0u8; 32]);
        assert_eq!(common_prefix(&h, &h), 256);
        assert_eq!(common_prefix(&lo, &hi), 3);
    }

    #[test]
    fn in_a_small_network_one_walk_places_every_key_on_every_node() {
        let nodes: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let mut pending = Pending::default();
        keys(500).into_iter().for_each(|k| pending.insert(k));
        let target = pending.pick([0; 32]).unwrap();
        let (plan, end) = pending.plan(&target, &nodes, true, 20);
        assert_eq!(end, None);
        assert!(pending.is_empty());
        assert_eq!(plan.len(), 3);
        assert!(plan.values().all(|keys| keys.len() == 500));
    }

    #[test]
    fn a_large_network_takes_few_walks_and_records_land_where_kademlia_puts_them() {
        // Each walk is answered exactly, as a converged Kademlia walk returns.
        let all: Vec<(PeerId, Hash)> = (0..1_000)
            .map(|_| PeerId::random())
            .map(|p| (p, peer_hash(&p)))
            .collect();
        let mut pending = Pending::default();
        let keys = keys(10_000);
        keys.iter().cloned().for_each(|k| pending.insert(k));
        let mut walks = 0;
        let mut stored: HashMap<String, Vec<PeerId>> = HashMap::new();
        let mut requests = 0;
        while let Some(target) = pending.pick([0x5a; 32]) {
            walks += 1;
            let key = pending.keys[&target].clone();
            let found = closest(&all, &key, 20);
            let (plan, _) = pending.plan(&target, &found, false, 20);
            requests += plan.len();
            for (peer, keys) in plan {
                for k in keys {
                    stored.entry(k.to_string()).or_default().push(peer);
                }
            }
        }
        assert!(walks < 200, "{walks} walks for 10,000 keys on 1,000 nodes");
        assert!(requests < 4_000, "{requests} requests");
        // Mostly on the true closest nodes (a lookup asks all 20, so one suffices); checked
        // for every fifth key.
        let (mut exact, mut fewest) = (0, 20);
        assert!(keys.iter().all(|k| stored[k].len() == 20));
        let checked: Vec<&String> = keys.iter().step_by(5).collect();
        for k in &checked {
            let at = &stored[*k];
            let truth = closest(&all, k, 20);
            let hits = at.iter().filter(|p| truth.contains(p)).count();
            fewest = fewest.min(hits);
            assert!(hits >= 4, "{k}: only {hits} of 20 on the closest nodes");
            exact += hits;
        }
        let share = exact as f64 / (20.0 * checked.len() as f64);
        eprintln!("{walks} walks, {requests} requests, {share:.3} on the closest, fewest {fewest}");
        assert!(
            share > 0.8,
            "{share:.3} of the records on the closest nodes"
        );
    }

    #[test]
    fn a_walk_that_found_nobody_leaves_the_keys_waiting() {
        let mut pending = Pending::default();
        keys(10).into_iter().for_each(|k| pending.insert(k));
        let target = pending.pick([0; 32]).unwrap();
        assert!(pending.plan(&target, &[], true, 20).0.is_empty());
        assert_eq!(pending.len(), 10);
    }
}
