//! Kademlia's record store, sized for Ferry: provider records only, each key stored as a
//! 16-byte hash and each provider once, a key with one record 40 bytes in the table and
//! nothing on the heap (libp2p's own reserves about 4 KiB per key; with 10,000 digests on
//! each node a node holds some 40,000 keys, `docs/design/scale-sim.md`).
//!
//! Invariant: value records are refused; provider records are rebuilt when Kademlia asks,
//! with the key it asks by (this node's own keys are kept whole, for `provided`).

use crate::routing::clock::Instant;
use std::borrow::Cow;
use std::collections::hash_map::{self, HashMap, RandomState};
use std::hash::BuildHasher;
use std::time::Duration;

use libp2p::kad::store::{Error, RecordStore, Result};
use libp2p::kad::{K_VALUE, ProviderRecord, Record, RecordKey};
use libp2p::{Multiaddr, PeerId};

/// A key, by two SipHashes under this store's own random keys: 128 bits, so a collision among
/// 2^64 keys is unlikely and no member can aim for one.
type KeyHash = [u8; 16];

fn key_hash(keys: &RandomState, key: &[u8]) -> KeyHash {
    let mut hash = [0u8; 16];
    hash[..8].copy_from_slice(&keys.hash_one((0u8, key)).to_le_bytes());
    hash[8..].copy_from_slice(&keys.hash_one((1u8, key)).to_le_bytes());
    hash
}

/// One provider's record for one key; `expires` in nanoseconds after the store's epoch, plus
/// one (0: never). 16 bytes, against 24 with an `Option<Instant>`.
#[derive(Debug, Clone, Copy)]
struct Slot {
    provider: u32,
    expires: u64,
}

fn decode(epoch: Instant, expires: u64) -> Option<Instant> {
    (expires > 0).then(|| epoch + Duration::from_nanos(expires - 1))
}

/// Whether a slot's time is up at `now` (never for a record without an expiry).
fn up(epoch: Instant, slot: &Slot, now: Instant) -> bool {
    decode(epoch, slot.expires).is_some_and(|t| t <= now)
}

/// A key's records: most keys have one, held inline.
#[derive(Debug)]
enum Slots {
    One(Slot),
    Many(Vec<Slot>),
}

impl Slots {
    fn as_slice(&self) -> &[Slot] {
        match self {
            Slots::One(s) => std::slice::from_ref(s),
            Slots::Many(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [Slot] {
        match self {
            Slots::One(s) => std::slice::from_mut(s),
            Slots::Many(v) => v,
        }
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Grows one slot at a time: a key is capped at 20, and doubling would waste half.
    fn push(&mut self, slot: Slot) {
        match self {
            Slots::One(first) => *self = Slots::Many(vec![*first, slot]),
            Slots::Many(v) => {
                v.reserve_exact(1);
                v.push(slot);
            }
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&Slot) -> bool) {
        match self {
            Slots::One(s) if !keep(s) => *self = Slots::Many(Vec::new()),
            Slots::One(_) => {}
            Slots::Many(v) => v.retain(|s| keep(s)),
        }
    }
}

/// A provider, shared by all its records.
#[derive(Debug)]
struct Provider {
    id: PeerId,
    addresses: Vec<Multiaddr>,
    /// Records that name it; at 0 its number is free for the next new provider.
    records: usize,
}

#[derive(Debug)]
pub(super) struct ProviderStore {
    local: PeerId,
    max_keys: usize,
    slots: usize,
    providers: HashMap<KeyHash, Slots>,
    /// This node's own keys, whole: `provided` returns them.
    local_keys: HashMap<KeyHash, Box<[u8]>>,
    peers: Vec<Option<Provider>>,
    numbers: HashMap<PeerId, u32>,
    free: Vec<u32>,
    epoch: Instant,
    keys: RandomState,
}

impl ProviderStore {
    pub(super) fn new(local: PeerId, max_keys: usize) -> Self {
        ProviderStore {
            local,
            max_keys,
            slots: K_VALUE.get(),
            providers: HashMap::new(),
            local_keys: HashMap::new(),
            peers: Vec::new(),
            numbers: HashMap::new(),
            free: Vec::new(),
            epoch: Instant::now(),
            keys: RandomState::new(),
        }
    }

    fn encode(&self, expires: Option<Instant>) -> u64 {
        expires.map_or(0, |t| {
            let after = t.saturating_duration_since(self.epoch).as_nanos();
            u64::try_from(after).unwrap_or(u64::MAX - 1) + 1
        })
    }

    fn decode(&self, expires: u64) -> Option<Instant> {
        decode(self.epoch, expires)
    }

    /// At most `slots` providers per key (at least 1).
    pub(super) fn with_slots(mut self, slots: usize) -> Self {
        self.slots = slots.max(1);
        self
    }

    /// Forgets other nodes' expired records, and keys left with none; returns how many records
    /// went. libp2p drops an expired record only when its key is looked up, so unasked keys
    /// would stay for good. This node's own records are the announcer's.
    pub(super) fn expire(&mut self, now: Instant) -> usize {
        let local = self.number_of(&self.local);
        let mut released = Vec::new();
        let mut gone = 0;
        let epoch = self.epoch;
        self.providers.retain(|_, slots| {
            slots.retain(|s| {
                let keep = Some(s.provider) == local || !up(epoch, s, now);
                if !keep {
                    released.push(s.provider);
                }
                keep
            });
            !slots.is_empty()
        });
        gone += released.len();
        for n in released {
            self.release(n);
        }
        // Give memory back after a shrink.
        if self.providers.capacity() > 4 * self.providers.len().max(1024) {
            self.providers.shrink_to_fit();
        }
        gone
    }

    /// The addresses `id`'s records carry: to reach a provider this node has no connection to
    /// and Kademlia may not know.
    pub(super) fn addresses_of(&self, id: &PeerId) -> &[Multiaddr] {
        self.number_of(id)
            .and_then(|n| self.peers.get(n as usize)?.as_ref())
            .map_or(&[], |p| p.addresses.as_slice())
    }

    fn number_of(&self, id: &PeerId) -> Option<u32> {
        self.numbers.get(id).copied()
    }

    /// The provider's number, registering it (or its new addresses) as needed.
    fn acquire(&mut self, id: PeerId, addresses: &[Multiaddr]) -> u32 {
        if let Some(&n) = self.numbers.get(&id) {
            if let Some(Some(p)) = self.peers.get_mut(n as usize)
                && !addresses.is_empty()
                && p.addresses.as_slice() != addresses
            {
                p.addresses = addresses.to_vec();
            }
            return n;
        }
        let provider = Provider {
            id,
            addresses: addresses.to_vec(),
            records: 0,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.peers[n as usize] = Some(provider);
                n
            }
            None => {
                self.peers.push(Some(provider));
                (self.peers.len() - 1) as u32
            }
        };
        self.numbers.insert(id, n);
        n
    }

    fn retain(&mut self, n: u32) {
        if let Some(Some(p)) = self.peers.get_mut(n as usize) {
            p.records += 1;
        }
    }

    /// One record naming provider `n` is gone.
    fn release(&mut self, n: u32) {
        let Some(slot) = self.peers.get_mut(n as usize) else {
            return;
        };
        let unused = match slot {
            Some(p) => {
                p.records = p.records.saturating_sub(1);
                p.records == 0
            }
            None => false,
        };
        if unused && let Some(p) = slot.take() {
            self.numbers.remove(&p.id);
            self.free.push(n);
        }
    }

    fn record(&self, key: &[u8], slot: &Slot) -> Option<ProviderRecord> {
        let p = self.peers.get(slot.provider as usize)?.as_ref()?;
        Some(ProviderRecord {
            key: RecordKey::new(&key),
            provider: p.id,
            expires: self.decode(slot.expires),
            addresses: p.addresses.clone(),
        })
    }
}

impl RecordStore for ProviderStore {
    type RecordsIter<'a> = std::iter::Empty<Cow<'a, Record>>;
    type ProvidedIter<'a> = std::vec::IntoIter<Cow<'a, ProviderRecord>>;

    fn get(&self, _: &RecordKey) -> Option<Cow<'_, Record>> {
        None
    }

    fn put(&mut self, _: Record) -> Result<()> {
        Err(Error::MaxRecords)
    }

    fn remove(&mut self, _: &RecordKey) {}

    fn records(&self) -> Self::RecordsIter<'_> {
        std::iter::empty()
    }

    fn add_provider(&mut self, record: ProviderRecord) -> Result<()> {
        let whole: &[u8] = record.key.as_ref();
        let key = key_hash(&self.keys, whole);
        let n = self.acquire(record.provider, &record.addresses);
        let slot = Slot {
            provider: n,
            expires: self.encode(record.expires),
        };
        let placed = self.place(key, slot, Instant::now());
        if placed == Placed::Stored && record.provider == self.local {
            self.local_keys
                .entry(key)
                .or_insert_with(|| Box::from(whole));
        }
        self.release_if_unused(n);
        match placed {
            Placed::NoRoom => Err(Error::MaxProvidedKeys),
            Placed::Stored | Placed::Full => Ok(()),
        }
    }

    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        let whole: &[u8] = key.as_ref();
        self.providers
            .get(&key_hash(&self.keys, whole))
            .map(|slots| {
                (slots.as_slice().iter())
                    .filter_map(|s| self.record(whole, s))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// This node's own records, as libp2p asks only to republish, which Ferry turned off.
    fn provided(&self) -> Self::ProvidedIter<'_> {
        let Some(local) = self.number_of(&self.local) else {
            return Vec::new().into_iter();
        };
        self.local_keys
            .iter()
            .filter_map(|(hash, whole)| {
                let slots = self.providers.get(hash)?;
                let slot = slots.as_slice().iter().find(|s| s.provider == local)?;
                self.record(whole, slot)
            })
            .map(Cow::Owned)
            .collect::<Vec<_>>()
            .into_iter()
    }

    fn remove_provider(&mut self, key: &RecordKey, provider: &PeerId) {
        let Some(n) = self.number_of(provider) else {
            return;
        };
        let key = key_hash(&self.keys, key.as_ref());
        if *provider == self.local {
            self.local_keys.remove(&key);
        }
        let hash_map::Entry::Occupied(mut e) = self.providers.entry(key) else {
            return;
        };
        let before = e.get().len();
        e.get_mut().retain(|s| s.provider != n);
        let removed = before - e.get().len();
        if e.get().is_empty() {
            e.remove();
        }
        for _ in 0..removed {
            self.release(n);
        }
    }
}

/// What became of one record offered to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placed {
    Stored,
    /// The key has all its providers, all with time left, and this one is not among them.
    Full,
    /// The store holds its most keys and this is a new one.
    NoRoom,
}

impl ProviderStore {
    /// Stores `provider`'s records for `keys` (one announcement batch), each expiring at
    /// `expires`; returns how many were stored and the positions of the keys refused as full.
    /// One lookup per key and one provider registration per batch: the first round stores
    /// some 200,000 records a node.
    pub(super) fn add_batch<'k>(
        &mut self,
        provider: PeerId,
        addresses: &[Multiaddr],
        keys: impl IntoIterator<Item = &'k [u8]>,
        expires: Instant,
        now: Instant,
    ) -> (u32, Vec<u32>) {
        let (mut stored, mut full) = (0, Vec::new());
        let n = self.acquire(provider, addresses);
        let slot = Slot {
            provider: n,
            expires: self.encode(Some(expires)),
        };
        for (i, whole) in keys.into_iter().enumerate() {
            let key = key_hash(&self.keys, whole);
            match self.place(key, slot, now) {
                Placed::Stored if provider == self.local => {
                    stored += 1;
                    self.local_keys
                        .entry(key)
                        .or_insert_with(|| Box::from(whole));
                }
                Placed::Stored => stored += 1,
                Placed::Full => full.push(i as u32),
                Placed::NoRoom => {}
            }
        }
        self.release_if_unused(n);
        (stored, full)
    }

    /// Puts `slot` under `key`: a refresh, a new provider, or in place of one whose time is up.
    fn place(&mut self, key: KeyHash, slot: Slot, now: Instant) -> Placed {
        let (epoch, most) = (self.epoch, self.slots);
        if let Some(slots) = self.providers.get_mut(&key) {
            if let Some(known) =
                (slots.as_mut_slice().iter_mut()).find(|s| s.provider == slot.provider)
            {
                known.expires = slot.expires;
                return Placed::Stored;
            }
            if slots.len() < most {
                slots.push(slot);
            } else {
                // Full: one whose time is up makes way (the sweep may not have run yet).
                let Some(old) = slots.as_mut_slice().iter_mut().find(|s| up(epoch, s, now)) else {
                    return Placed::Full;
                };
                let gone = std::mem::replace(old, slot).provider;
                self.release(gone);
            }
            self.retain(slot.provider);
            return Placed::Stored;
        }
        if self.providers.len() >= self.max_keys {
            // Full: make room from expired records before refusing a key.
            self.expire(now);
            if self.providers.len() >= self.max_keys {
                return Placed::NoRoom;
            }
        }
        self.providers.insert(key, Slots::One(slot));
        self.retain(slot.provider);
        Placed::Stored
    }

    /// A provider registered for a record that was then not kept.
    fn release_if_unused(&mut self, n: u32) {
        if let Some(Some(p)) = self.peers.get(n as usize)
            && p.records == 0
        {
            self.retain(n);
            self.release(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::routing::clock::Instant;
    use std::time::Duration;

    use super::*;

    fn record(key: &str, provider: PeerId) -> ProviderRecord {
        ProviderRecord::new(RecordKey::new(&key), provider, Vec::new())
    }

    #[test]
    fn providers_are_added_refreshed_and_removed() {
        let (me, other) = (PeerId::random(), PeerId::random());
        let mut store = ProviderStore::new(me, 100);
        let key = RecordKey::new(&"sha256:aa");
        store.add_provider(record("sha256:aa", other)).unwrap();
        store.add_provider(record("sha256:aa", me)).unwrap();
        assert_eq!(store.providers(&key).len(), 2);
        assert_eq!(
            store.provided().count(),
            1,
            "only our own records are provided"
        );

        // A refresh replaces, it does not add.
        let mut refreshed = record("sha256:aa", other);
        refreshed.expires = Some(Instant::now() + Duration::from_secs(60));
        store.add_provider(refreshed.clone()).unwrap();
        let found = store.providers(&key);
        assert_eq!(found.len(), 2);
        assert!(found.iter().any(|p| p.expires == refreshed.expires));

        store.remove_provider(&key, &me);
        assert_eq!(store.provided().count(), 0);
        store.remove_provider(&key, &other);
        assert!(store.providers(&key).is_empty());
        assert!(store.providers.is_empty(), "an empty key is dropped");
    }

    #[test]
    fn a_full_key_refuses_newcomers_not_its_providers_and_an_expired_one_makes_way() {
        let mut store = ProviderStore::new(PeerId::random(), 10);
        let key = RecordKey::new(&"sha256:shared");
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let held: Vec<PeerId> = (0..K_VALUE.get()).map(|_| PeerId::random()).collect();
        for (i, p) in held.iter().enumerate() {
            let mut r = record("sha256:shared", *p);
            // The first one's time is up.
            r.expires = Some(if i == 0 { now } else { later });
            store.add_provider(r).unwrap();
        }
        let batch = |store: &mut ProviderStore, who: PeerId, keys: &[&RecordKey]| {
            store.add_batch(who, &[], keys.iter().map(|k| k.as_ref()), later, now)
        };
        let newcomer = PeerId::random();
        assert_eq!(
            batch(&mut store, newcomer, &[&key]),
            (1, vec![]),
            "a record with no time left makes way"
        );
        let providers: Vec<PeerId> = store.providers(&key).iter().map(|r| r.provider).collect();
        assert_eq!(providers.len(), K_VALUE.get());
        assert!(providers.contains(&newcomer) && !providers.contains(&held[0]));
        let other = RecordKey::new(&"other");
        let stranger = PeerId::random();
        assert_eq!(
            batch(&mut store, stranger, &[&other, &key]),
            (1, vec![1]),
            "the full key is refused by position, the other stored"
        );
        assert_eq!(
            batch(&mut store, held[1], &[&key]),
            (1, vec![]),
            "a held provider's refresh is stored, never refused"
        );
        // The provider that made way is forgotten with its last record, and one refused
        // everywhere is never registered.
        assert!(!store.numbers.contains_key(&held[0]));
        assert_eq!(batch(&mut store, PeerId::random(), &[&key]), (0, vec![0]));
        assert_eq!(store.numbers.len(), K_VALUE.get() + 1);
    }

    #[test]
    fn at_most_twenty_providers_per_key_and_a_bounded_number_of_keys() {
        let mut store = ProviderStore::new(PeerId::random(), 2);
        for _ in 0..30 {
            store.add_provider(record("k", PeerId::random())).unwrap();
        }
        assert_eq!(store.providers(&RecordKey::new(&"k")).len(), K_VALUE.get());
        store.add_provider(record("k2", PeerId::random())).unwrap();
        assert!(matches!(
            store.add_provider(record("k3", PeerId::random())),
            Err(Error::MaxProvidedKeys)
        ));
    }

    #[test]
    fn a_week_of_churn_leaves_only_the_records_whose_time_is_not_up() {
        // Hourly for a week, 1,000 other nodes' keys with a 24 h TTL, never looked up again.
        let (me, now) = (PeerId::random(), Instant::now());
        let ttl = Duration::from_secs(24 * 3600);
        let mut store = ProviderStore::new(me, 1_000_000);
        let mut most = 0;
        for hour in 0..7 * 24u64 {
            let t = now + Duration::from_secs(hour * 3600);
            for i in 0..1_000 {
                let mut r = record(&format!("sha256:{hour}-{i}"), PeerId::random());
                r.expires = Some(t + ttl);
                store.add_provider(r).unwrap();
            }
            store.expire(t);
            most = most.max(store.providers.len());
        }
        // One TTL's worth plus the hour just added.
        assert!(most <= 25_000, "{most} keys held");
        assert!(store.providers.capacity() <= 4 * 25_000 * 2);
        // Own records stay, even past their expiry.
        let mut own = record("sha256:own", me);
        own.expires = Some(now);
        store.add_provider(own).unwrap();
        store.expire(now + Duration::from_secs(365 * 24 * 3600));
        assert_eq!(store.provided().count(), 1);
        assert_eq!(store.providers.len(), 1, "every other record expired");
    }

    #[test]
    fn a_full_store_makes_room_from_expired_records_before_refusing() {
        let mut store = ProviderStore::new(PeerId::random(), 1);
        let mut old = record("k1", PeerId::random());
        old.expires = Some(Instant::now() - Duration::from_secs(1));
        store.add_provider(old).unwrap();
        store.add_provider(record("k2", PeerId::random())).unwrap();
        assert_eq!(store.providers(&RecordKey::new(&"k2")).len(), 1);
        assert!(store.providers(&RecordKey::new(&"k1")).is_empty());
    }

    #[test]
    fn a_provider_is_held_once_and_forgotten_with_its_last_record() {
        let (me, other, now) = (PeerId::random(), PeerId::random(), Instant::now());
        let mut store = ProviderStore::new(me, 100_000);
        let addr: Multiaddr = "/ip4/10.0.0.2/tcp/5482".parse().unwrap();
        for i in 0..1_000 {
            let mut r =
                ProviderRecord::new(RecordKey::new(&format!("k{i}")), other, vec![addr.clone()]);
            r.expires = Some(now + Duration::from_secs(60));
            store.add_provider(r).unwrap();
        }
        assert_eq!(store.numbers.len(), 1, "one provider, held once");
        let found = store.providers(&RecordKey::new(&"k7"));
        assert_eq!(
            (found[0].provider, &found[0].addresses),
            (other, &vec![addr.clone()])
        );
        assert_eq!(found[0].key, RecordKey::new(&"k7"));
        assert_eq!(store.addresses_of(&other), std::slice::from_ref(&addr));
        assert!(store.addresses_of(&PeerId::random()).is_empty());
        store.expire(now + Duration::from_secs(120));
        assert!(store.providers.is_empty());
        assert!(
            store.numbers.is_empty(),
            "the provider went with its last record"
        );
        // Its number is used again.
        store.add_provider(record("k", PeerId::random())).unwrap();
        assert_eq!(store.peers.len(), 1);
    }

    /// A key with one record costs its table entry alone: 40 bytes, nothing on the heap.
    #[test]
    fn a_key_with_one_record_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<(KeyHash, Slots)>(), 40);
    }

    #[test]
    fn value_records_are_refused() {
        let mut store = ProviderStore::new(PeerId::random(), 10);
        let r = Record::new(RecordKey::new(&"k"), b"value".to_vec());
        assert!(store.put(r).is_err());
        assert!(store.get(&RecordKey::new(&"k")).is_none());
        assert_eq!(store.records().count(), 0);
    }
}
