//! The announcement state machine: provided keys, walks, batches and rounds (planning is
//! `announce_plan.rs`). Invariant: every provided key is announced each round unless resting.

use crate::routing::clock::Instant;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use libp2p::kad::store::RecordStore;
use libp2p::kad::{PeerInfo, ProviderRecord, QueryId, RecordKey};
use libp2p::request_response::{self, OutboundRequestId};
use libp2p::{Multiaddr, PeerId, Swarm};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::announce_plan::{
    Hash, MAX_ADDRESSES, MAX_KEY_LEN, MAX_KEYS_PER_BATCH, Pending, ProvideAck, ProvideBatch,
    peer_hash, to_hash,
};
use super::behaviour::{Behaviour, ProvideTiming};
use super::draws::Draws;
use super::growth::{Growth, network_size};
use super::rest::Resting;
use crate::metrics::{DhtLabels, Metrics, OutcomeLabels};

/// Enough to cover a round's regions quickly, few enough that a start-up round never floods
/// the neighbours.
const MAX_WALKS_IN_FLIGHT: usize = 4;
const MAX_BATCHES_IN_FLIGHT: usize = 32;
/// A walk that found nobody is retried after this long, not in a busy loop.
const EMPTY_WALK_BACKOFF: std::time::Duration = std::time::Duration::from_secs(1);

type ProvideEvent = request_response::Event<ProvideBatch, ProvideAck>;

/// Keys planned for one node, with the addresses the walk found it at.
#[derive(Debug, Default)]
struct Outgoing {
    keys: Vec<Arc<str>>,
    addrs: Vec<Multiaddr>,
}

pub(crate) struct Announcer {
    timing: ProvideTiming,
    metrics: Arc<Metrics>,
    provided: HashSet<String>,
    pending: Pending,
    /// Walks in flight, by target.
    walks: HashMap<QueryId, Hash>,
    outbox: HashMap<PeerId, Outgoing>,
    /// Batch requests in flight, with their keys (an answer names refused ones by position).
    batches: HashMap<OutboundRequestId, Vec<Arc<str>>>,
    resting: Resting,
    /// The next round, 75-100% of the interval away (drawn per round): nodes started together
    /// drift apart, and records are renewed before their TTL runs out.
    next_round: Instant,
    random: Draws,
    draws: u64,
    walk_after: Option<Instant>,
    growth: Growth,
}

impl Announcer {
    pub(super) fn new(timing: ProvideTiming, metrics: Arc<Metrics>, random: Draws) -> Self {
        let next_round = Instant::now() + round_wait(&timing, &random, 0);
        Announcer {
            timing,
            metrics,
            provided: HashSet::new(),
            pending: Pending::default(),
            walks: HashMap::new(),
            outbox: HashMap::new(),
            batches: HashMap::new(),
            resting: Resting::new(timing.replicas),
            next_round,
            random,
            draws: 1,
            walk_after: None,
            growth: Growth::default(),
        }
    }

    pub(super) fn interval(&self) -> std::time::Duration {
        self.timing.interval
    }

    /// This node provides `keys` from now: its own store at once, other nodes after the walks.
    pub(super) fn advertise(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        keys: Vec<String>,
    ) -> Result<(), String> {
        let local = *swarm.local_peer_id();
        let mut error = None;
        for key in keys {
            let record = ProviderRecord::new(RecordKey::new(&key), local, Vec::new());
            if let Err(e) = swarm.behaviour_mut().kad.store_mut().add_provider(record) {
                tracing::warn!(error = %e, "cannot announce a key; trying again at the next round");
                error.get_or_insert(e.to_string());
            }
            self.pending.insert(key.clone());
            self.provided.insert(key);
        }
        self.progress(swarm);
        error.map_or(Ok(()), Err)
    }

    /// Stops announcing `keys`. Records already on other nodes lapse with their TTL.
    pub(super) fn withdraw(&mut self, swarm: &mut Swarm<Behaviour>, keys: Vec<String>) {
        let kad = &mut swarm.behaviour_mut().kad;
        for key in keys {
            self.pending.remove(&key);
            self.resting.forget(&key);
            kad.stop_providing(&RecordKey::new(&key));
            self.provided.remove(&key);
        }
        self.update_gauge();
    }

    /// Starts a round when one is due or the network has grown (`growth.rs`), then whatever
    /// can start.
    pub(super) fn tick(&mut self, swarm: &mut Swarm<Behaviour>, now: Instant) {
        if now >= self.next_round || self.grown(swarm, now) {
            self.growth.round_started();
            let mut rested = 0;
            for key in &self.provided {
                if self.resting.announce(key) {
                    self.pending.insert(key.clone());
                } else {
                    rested += 1;
                }
            }
            self.resting.round_started();
            self.metrics.announcements_rested.inc_by(rested);
            self.next_round = now + round_wait(&self.timing, &self.random, self.draws);
            self.draws += 1;
        }
        self.progress(swarm);
    }

    /// With no round running: whether the network grew enough for an early round.
    fn grown(&mut self, swarm: &mut Swarm<Behaviour>, now: Instant) -> bool {
        if self.provided.is_empty() || !self.idle() || !self.growth.due(now) {
            return false;
        }
        let size = estimate_size(swarm);
        let before = self.growth.baseline();
        let grown = self.growth.grown(size);
        if grown {
            tracing::info!(
                before = before.unwrap_or_default().round(),
                now = size.round(),
                "the network grew since the last round: announcing again now"
            );
            self.metrics.announce_rounds_early.inc();
        }
        grown
    }

    fn idle(&self) -> bool {
        self.pending.is_empty()
            && self.walks.is_empty()
            && self.outbox.is_empty()
            && self.batches.is_empty()
    }

    pub(super) fn progress(&mut self, swarm: &mut Swarm<Behaviour>) {
        let backing_off = self.walk_after.is_some_and(|t| Instant::now() < t);
        if swarm.connected_peers().next().is_some() && !backing_off {
            while self.walks.len() < MAX_WALKS_IN_FLIGHT && !self.start_walk(swarm) {}
        }
        self.send_batches(swarm);
        // The round's last answer: the network it placed the records in.
        if self.growth.baseline().is_none() && !self.provided.is_empty() && self.idle() {
            self.growth.round_ended(estimate_size(swarm));
        }
        self.update_gauge();
    }

    /// Starts one walk; true when there is nothing (more) to start.
    fn start_walk(&mut self, swarm: &mut Swarm<Behaviour>) -> bool {
        let walking: HashSet<&Hash> = self.walks.values().collect();
        // Random, so walks started together spread.
        let mut at = [0u8; 32];
        at[..8].copy_from_slice(&self.random.hash_one(self.draws).to_be_bytes());
        self.draws += 1;
        let Some(target) = self.pending.pick(at) else {
            return true;
        };
        if walking.contains(&target) {
            return true;
        }
        let Some(key) = self.pending.key(&target) else {
            return true;
        };
        let id = swarm
            .behaviour_mut()
            .kad
            .get_closest_peers(key.as_bytes().to_vec());
        self.walks.insert(id, target);
        false
    }

    /// A closest-peers query ended (`complete`: converged); false when it was not ours.
    pub(super) fn on_walk(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        id: QueryId,
        found: Vec<PeerInfo>,
        complete: bool,
    ) -> bool {
        let Some(target) = self.walks.remove(&id) else {
            return false;
        };
        let outcome = if complete { "converged" } else { "timed_out" };
        count(&self.metrics.announce_walks, outcome);
        if found.is_empty() {
            self.walk_after = Some(Instant::now() + EMPTY_WALK_BACKOFF);
        }
        // Fewer than asked from a converged walk means there are no others; a timed-out walk
        // says nothing of the rest (else every waiting key would go to the few it reached).
        let replicas = self.timing.replicas;
        let whole_network = complete && found.len() < replicas;
        let ids: Vec<PeerId> = found.iter().map(|p| p.peer_id).collect();
        let plan = self.pending.plan(&target, &ids, whole_network, replicas);
        let mut addrs: HashMap<PeerId, Vec<Multiaddr>> =
            found.into_iter().map(|p| (p.peer_id, p.addrs)).collect();
        for (peer, keys) in plan {
            let out = self.outbox.entry(peer).or_default();
            out.keys.extend(keys);
            if let Some(a) = addrs.remove(&peer)
                && !a.is_empty()
            {
                out.addrs = a;
            }
        }
        self.progress(swarm);
        true
    }

    /// Sends each node its batch once the round's walks are done (one request per node per
    /// round), or as soon as a full batch is ready.
    fn send_batches(&mut self, swarm: &mut Swarm<Behaviour>) {
        let round_planned = self.walks.is_empty() && self.pending.is_empty();
        let addrs: Vec<String> = swarm
            .external_addresses()
            .take(MAX_ADDRESSES)
            .map(|a| a.to_string())
            .collect();
        while self.batches.len() < MAX_BATCHES_IN_FLIGHT {
            let Some(peer) = self
                .outbox
                .iter()
                .find(|(_, o)| round_planned || o.keys.len() >= MAX_KEYS_PER_BATCH)
                .map(|(p, _)| *p)
            else {
                break;
            };
            let Some(out) = self.outbox.get_mut(&peer) else {
                break;
            };
            let n = out.keys.len().min(MAX_KEYS_PER_BATCH);
            let sent: Vec<Arc<str>> = out.keys.drain(..n).collect();
            let keys: Vec<String> = sent.iter().map(|k| k.to_string()).collect();
            let dial = out.addrs.clone();
            if out.keys.is_empty() {
                self.outbox.remove(&peer);
            }
            let request = ProvideBatch {
                keys,
                addrs: addrs.clone(),
            };
            let id = swarm
                .behaviour_mut()
                .provide
                .send_request_with_addresses(&peer, request, dial);
            self.batches.insert(id, sent);
        }
    }

    pub(super) fn on_provide_event(&mut self, swarm: &mut Swarm<Behaviour>, event: ProvideEvent) {
        match event {
            request_response::Event::Message {
                peer,
                message:
                    request_response::Message::Request {
                        request, channel, ..
                    },
                ..
            } => {
                self.metrics
                    .dht_requests
                    .get_or_create(&DhtLabels {
                        kind: "provide_batch",
                    })
                    .inc();
                let ack = self.store_batch(swarm, peer, request);
                // The asker may have given up.
                let _ = swarm.behaviour_mut().provide.send_response(channel, ack);
            }
            request_response::Event::Message {
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                count(&self.metrics.announce_batches, "delivered");
                if let Some(sent) = self.batches.remove(&request_id) {
                    // Positions out of range (a confused peer) name nothing.
                    for key in response.full.iter().filter_map(|&i| sent.get(i as usize)) {
                        self.resting.refused(key, self.random.hash_one(key));
                    }
                }
                self.progress(swarm);
            }
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                // The other replicas hold these keys; this node's next round tries again.
                tracing::debug!(%peer, %error, "a batch of provider records was not delivered");
                count(&self.metrics.announce_batches, "failed");
                self.batches.remove(&request_id);
                self.progress(swarm);
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, %error, "a batch of provider records from a peer failed");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
    }

    /// Stores `peer`'s records and says which keys were full without it. A batch out of
    /// bounds is refused whole: no Ferry sends one.
    fn store_batch(
        &self,
        swarm: &mut Swarm<Behaviour>,
        peer: PeerId,
        batch: ProvideBatch,
    ) -> ProvideAck {
        let mut ack = ProvideAck {
            stored: 0,
            full: Vec::new(),
        };
        if batch.keys.len() > MAX_KEYS_PER_BATCH
            || batch.addrs.len() > MAX_ADDRESSES
            || batch.keys.iter().any(|k| k.len() > MAX_KEY_LEN)
        {
            tracing::debug!(%peer, keys = batch.keys.len(), "provider batch out of bounds; refused");
            return ack;
        }
        let addrs: Vec<Multiaddr> = batch.addrs.iter().filter_map(|a| a.parse().ok()).collect();
        let now = Instant::now();
        let store = swarm.behaviour_mut().kad.store_mut();
        let keys = batch.keys.iter().map(|k| k.as_bytes());
        (ack.stored, ack.full) = store.add_batch(peer, &addrs, keys, now + self.timing.ttl, now);
        ack
    }

    fn update_gauge(&self) {
        let planned: usize = self.outbox.values().map(|o| o.keys.len()).sum();
        let sending: usize = self.batches.values().map(Vec::len).sum();
        let n = self.pending.len() + planned + sending;
        self.metrics.announcements_pending.set(n as i64);
    }
}

fn count(family: &Family<OutcomeLabels, Counter>, outcome: &'static str) {
    family.get_or_create(&OutcomeLabels { outcome }).inc();
}

fn estimate_size(swarm: &mut Swarm<Behaviour>) -> f64 {
    let local = peer_hash(swarm.local_peer_id());
    // Copied out per bucket: each bucket's view borrows it.
    let peers = swarm.behaviour_mut().kad.kbuckets().flat_map(|b| {
        b.iter()
            .map(|e| to_hash(e.node.key.hashed_bytes()))
            .collect::<Vec<Hash>>()
    });
    network_size(&local, peers)
}

fn round_wait(timing: &ProvideTiming, random: &Draws, draw: u64) -> std::time::Duration {
    let x = random.hash_one(draw) as f64 / u64::MAX as f64;
    timing.interval.mul_f64(0.75 + 0.25 * x)
}
