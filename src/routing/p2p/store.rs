//! Kademlia's record store, sized for Ferry: provider records only, held compactly.
//!
//! libp2p's `MemoryStore` keeps every key's providers in a `SmallVec` with room for 20 records
//! inline, about 4 KiB per key whether one node provides it or twenty. A node with 2,500
//! images (10,000 digests, 12,500 keys) held 50 MiB in it (measured with massif; resident
//! memory 80 MiB). Here a key's providers are a `Vec` of the records that exist, usually one to
//! three. Ferry stores no values in the DHT: value records are refused.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, hash_map, hash_set};
use std::iter;
use std::time::Instant;

use libp2p::PeerId;
use libp2p::kad::store::{Error, RecordStore, Result};
use libp2p::kad::{K_VALUE, ProviderRecord, Record, RecordKey};

#[derive(Debug)]
pub struct ProviderStore {
    local: PeerId,
    max_keys: usize,
    providers: HashMap<RecordKey, Vec<ProviderRecord>>,
    /// This node's own records (also in `providers`): what Kademlia re-announces.
    provided: HashSet<ProviderRecord>,
}

impl ProviderStore {
    /// A store for `local`'s node that holds providers for at most `max_keys` keys.
    pub fn new(local: PeerId, max_keys: usize) -> Self {
        ProviderStore {
            local,
            max_keys,
            providers: HashMap::new(),
            provided: HashSet::new(),
        }
    }

    /// Forgets other nodes' records whose time is up, and keys left with none; returns how
    /// many records went. libp2p's Kademlia drops an expired record only when its key is
    /// looked up, so a key nobody asks for again would stay for the node's life (memory that
    /// grows with every image the cluster ever held, and once `max_keys` is reached, new
    /// keys kept out). This node's own records are left to Kademlia, which re-announces them.
    pub fn expire(&mut self, now: Instant) -> usize {
        let local = self.local;
        let mut gone = 0;
        self.providers.retain(|_, records| {
            let before = records.len();
            records.retain(|r| r.provider == local || !r.is_expired(now));
            gone += before - records.len();
            !records.is_empty()
        });
        // A map that held many more keys than it does now gives the memory back.
        if self.providers.capacity() > 4 * self.providers.len().max(1024) {
            self.providers.shrink_to_fit();
        }
        gone
    }
}

impl RecordStore for ProviderStore {
    type RecordsIter<'a> = iter::Empty<Cow<'a, Record>>;
    type ProvidedIter<'a> = iter::Map<
        hash_set::Iter<'a, ProviderRecord>,
        fn(&'a ProviderRecord) -> Cow<'a, ProviderRecord>,
    >;

    fn get(&self, _: &RecordKey) -> Option<Cow<'_, Record>> {
        None
    }

    fn put(&mut self, _: Record) -> Result<()> {
        Err(Error::MaxRecords)
    }

    fn remove(&mut self, _: &RecordKey) {}

    fn records(&self) -> Self::RecordsIter<'_> {
        iter::empty()
    }

    fn add_provider(&mut self, record: ProviderRecord) -> Result<()> {
        let keys = self.providers.len();
        let providers = match self.providers.entry(record.key.clone()) {
            hash_map::Entry::Occupied(e) => e.into_mut(),
            hash_map::Entry::Vacant(_) if keys >= self.max_keys => {
                // Full: make room from expired records before refusing a key.
                self.expire(Instant::now());
                if self.providers.len() >= self.max_keys {
                    return Err(Error::MaxProvidedKeys);
                }
                self.providers
                    .entry(record.key.clone())
                    .or_insert_with(|| Vec::with_capacity(1))
            }
            // Room for exactly one: most keys never have a second provider record here.
            hash_map::Entry::Vacant(e) => e.insert(Vec::with_capacity(1)),
        };
        let local = record.provider == self.local;
        if let Some(known) = providers.iter_mut().find(|p| p.provider == record.provider) {
            // A refresh: new expiry, maybe new addresses.
            *known = record.clone();
        } else if providers.len() < K_VALUE.get() {
            providers.push(record.clone());
        } else {
            return Ok(());
        }
        if local {
            self.provided.replace(record);
        }
        Ok(())
    }

    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        self.providers.get(key).cloned().unwrap_or_default()
    }

    fn provided(&self) -> Self::ProvidedIter<'_> {
        self.provided.iter().map(Cow::Borrowed)
    }

    fn remove_provider(&mut self, key: &RecordKey, provider: &PeerId) {
        let hash_map::Entry::Occupied(mut e) = self.providers.entry(key.clone()) else {
            return;
        };
        if let Some(i) = e.get().iter().position(|p| &p.provider == provider) {
            let gone = e.get_mut().swap_remove(i);
            if gone.provider == self.local {
                self.provided.remove(&gone);
            }
        }
        if e.get().is_empty() {
            e.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

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
        // Every hour for a week, 1,000 keys appear (images come and go) from other nodes, with
        // a 24 h TTL, and are never looked up again; the sweep runs every hour.
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
        // At most one TTL's worth (24 h + the hour just added): flat after the first day.
        assert!(most <= 25_000, "{most} keys held");
        assert!(store.providers.capacity() <= 4 * 25_000 * 2);
        // Our own records are Kademlia's to re-announce, even when their expiry is past.
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
    fn value_records_are_refused() {
        let mut store = ProviderStore::new(PeerId::random(), 10);
        let r = Record::new(RecordKey::new(&"k"), b"value".to_vec());
        assert!(store.put(r).is_err());
        assert!(store.get(&RecordKey::new(&"k")).is_none());
        assert_eq!(store.records().count(), 0);
    }
}
