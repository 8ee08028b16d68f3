//! The announcement state machine: provided keys, walks, batches and rounds (planning is
//! `announce_plan.rs`). Invariant: every provided key is announced each round unless resting.

use crate::routing::clock::Instant;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use libp2p::kad::store::RecordStore;
use libp2p::kad::{PeerInfo, ProviderRecord, QueryId, RecordKey};
use libp2p::request_response::{self, OutboundFailure, OutboundRequestId};
use libp2p::{Multiaddr, PeerId, Swarm};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::announce_plan::{
    Hash, MAX_ADDRESSES, MAX_KEY_LEN, MAX_KEYS_PER_BATCH, Pending, ProvideAck, ProvideBatch,
    WirePeer, peer_hash, to_hash,
};
use super::behaviour::{Behaviour, ProvideTiming};
use super::draws::Draws;
use super::growth::{Growth, network_size};
use super::rest::Resting;
use super::spacing;
use super::sweep::{CONFIRM, Hop, answer, table_near};
use crate::metrics::{DhtLabels, Metrics, OutcomeLabels};

/// Walks and hops: enough to cover a round's regions quickly, few enough that a start-up round
/// never floods the neighbours.
const MAX_WALKS_IN_FLIGHT: usize = 4;
const MAX_BATCHES_IN_FLIGHT: usize = 32;
/// A table that gained a node this recently is still filling in, and so are its
/// neighbours': a hop's answer may miss nodes that just joined, so each region's nearest
/// nodes confirm it (`sweep.rs`).
const SETTLING: Duration = Duration::from_secs(10);
/// A walk that found nobody is retried after this long, not in a busy loop.
const EMPTY_WALK_BACKOFF: Duration = Duration::from_secs(1);

type ProvideEvent = request_response::Event<ProvideBatch, ProvideAck>;

/// Keys planned for one node, with the addresses the walk found it at.
#[derive(Debug, Default)]
struct Outgoing {
    keys: Vec<Arc<str>>,
    addrs: Vec<Multiaddr>,
    /// Keys sent once already, whose connection closed under them: not retried again.
    again: bool,
}

/// A batch request in flight: an answer names refused keys by position.
struct Sent {
    keys: Vec<Arc<str>>,
    addrs: Vec<Multiaddr>,
    /// A retry: not sent a third time.
    again: bool,
}

pub(crate) struct Announcer {
    timing: ProvideTiming,
    metrics: Arc<Metrics>,
    provided: HashSet<String>,
    pending: Pending,
    /// Walks in flight, by target.
    walks: HashMap<QueryId, Hash>,
    outbox: HashMap<PeerId, Outgoing>,
    batches: HashMap<OutboundRequestId, Sent>,
    /// Hops in flight (`sweep.rs`): the node asked and what is known near the target.
    hops: HashMap<OutboundRequestId, (PeerId, Hop)>,
    resting: Resting,
    /// The next round, 75-100% of the interval away (drawn per round): nodes started together
    /// drift apart, and records are renewed before their TTL runs out.
    next_round: Instant,
    random: Draws,
    draws: u64,
    walk_after: Option<Instant>,
    growth: Growth,
    /// This round started because the network grew: other nodes' tables are still filling
    /// in, so one answer cannot stand for a region (`sweep.rs`).
    early: bool,
    /// When this node's routing table last gained a node.
    grew: Option<Instant>,
}

impl Announcer {
    pub(super) fn new(timing: ProvideTiming, metrics: Arc<Metrics>, random: Draws) -> Self {
        let next_round = Instant::now() + round_wait(timing.interval, &random, 0);
        metrics
            .announce_interval
            .set(timing.interval.as_secs() as i64);
        Announcer {
            timing,
            metrics,
            provided: HashSet::new(),
            pending: Pending::default(),
            walks: HashMap::new(),
            outbox: HashMap::new(),
            batches: HashMap::new(),
            hops: HashMap::new(),
            resting: Resting::new(timing.replicas),
            next_round,
            random,
            draws: 1,
            walk_after: None,
            growth: Growth::default(),
            early: false,
            grew: None,
        }
    }

    pub(super) fn interval(&self) -> Duration {
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
        let due = now >= self.next_round;
        let early = !due && self.grown(swarm, now);
        if due || early {
            self.early = early;
            // The network the last round placed its records in.
            let interval = spacing::round_interval(&self.timing, self.growth.baseline());
            self.metrics
                .announce_interval
                .set(interval.as_secs() as i64);
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
            self.metrics.announce_rounds.inc();
            self.next_round = now + round_wait(interval, &self.random, self.draws);
            self.draws += 1;
        }
        self.progress(swarm);
        // Counted once its keys show as pending, so a reader of both sees the round running.
        if early {
            self.metrics.announce_rounds_early.inc();
        }
    }

    /// With no round running: whether the network grew enough for an early round.
    fn grown(&mut self, swarm: &mut Swarm<Behaviour>, now: Instant) -> bool {
        if self.provided.is_empty() || !self.idle() || !self.growth.due(now) {
            return false;
        }
        let size = estimate_size(swarm);
        let before = self.growth.baseline();
        let grown = self.growth.grown(size) && self.growth.paused(now, self.grew);
        if grown {
            tracing::info!(
                before = before.unwrap_or_default().round(),
                now = size.round(),
                "the network grew since the last round: announcing again now"
            );
        }
        grown
    }

    fn idle(&self) -> bool {
        self.pending.is_empty()
            && self.walks.is_empty()
            && self.hops.is_empty()
            && self.outbox.is_empty()
            && self.batches.is_empty()
    }

    pub(super) fn progress(&mut self, swarm: &mut Swarm<Behaviour>) {
        let backing_off = self.walk_after.is_some_and(|t| Instant::now() < t);
        if swarm.connected_peers().next().is_some() && !backing_off {
            while self.in_flight() < MAX_WALKS_IN_FLIGHT && !self.start_walk(swarm) {}
        }
        self.send_batches(swarm);
        // The round's last answer: the network it placed the records in.
        if self.growth.baseline().is_none() && !self.provided.is_empty() && self.idle() {
            self.growth.round_ended(estimate_size(swarm));
        }
        if self.idle() {
            self.release_round();
        }
        self.update_gauge();
    }

    /// A round's maps grow to a slot per node met; between rounds they hold nothing.
    fn release_round(&mut self) {
        self.walks.shrink_to_fit();
        self.outbox.shrink_to_fit();
        self.batches.shrink_to_fit();
        self.hops.shrink_to_fit();
    }

    fn in_flight(&self) -> usize {
        self.walks.len() + self.hops.len()
    }

    fn walking(&self, target: &Hash) -> bool {
        self.walks.values().any(|t| t == target)
            || self.hops.values().any(|(_, h)| &h.target == target)
    }

    /// Starts one walk; true when there is nothing (more) to start.
    fn start_walk(&mut self, swarm: &mut Swarm<Behaviour>) -> bool {
        // Random, so walks started together spread.
        let mut at = [0u8; 32];
        at[..8].copy_from_slice(&self.random.hash_one(self.draws).to_be_bytes());
        self.draws += 1;
        let Some(target) = self.pending.pick(at) else {
            return true;
        };
        if self.walking(&target) {
            return true;
        }
        // A table that small is most of the network: one walk plans every key.
        let table: usize = (swarm.behaviour_mut().kad.kbuckets())
            .map(|b| b.num_entries())
            .sum();
        if table < 2 * self.timing.replicas {
            return !self.walk(swarm, target);
        }
        self.hop_to(swarm, target, Vec::new());
        false
    }

    /// The routing table gained a node (Kademlia's event).
    pub(super) fn table_grew(&mut self, now: Instant) {
        self.grew = Some(now);
    }

    /// How many of a region's nearest nodes must answer a hop (`sweep.rs`): some in an
    /// early round and while tables are filling in, else none.
    fn confirm(&self) -> usize {
        let settled = self.grew.is_none_or(|t| t.elapsed() >= SETTLING);
        if self.early || !settled { CONFIRM } else { 0 }
    }

    /// A Kademlia walk to `target`; false when its key is no longer waiting.
    fn walk(&mut self, swarm: &mut Swarm<Behaviour>, target: Hash) -> bool {
        let Some(key) = self.pending.key(&target) else {
            return false;
        };
        let id = swarm
            .behaviour_mut()
            .kad
            .get_closest_peers(key.as_bytes().to_vec());
        self.walks.insert(id, target);
        true
    }

    /// After a region ending at `end`, the next waiting key's region: its nearest known node
    /// is asked (`sweep.rs`), unless another walk or hop has it.
    fn sweep_on(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        end: Option<Hash>,
        known: Vec<(PeerId, Vec<Multiaddr>)>,
    ) {
        let Some(next) = end.and_then(|end| self.pending.after(&end)) else {
            return;
        };
        if !self.walking(&next) {
            self.hop_to(swarm, next, known);
        }
    }

    /// Hops to `target` from what is `known` near it and this node's own table.
    fn hop_to(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        target: Hash,
        known: Vec<(PeerId, Vec<Multiaddr>)>,
    ) {
        let Some(key) = self.pending.key(&target) else {
            return;
        };
        let local = *swarm.local_peer_id();
        let table: Vec<(PeerId, Vec<Multiaddr>)> = table_near(swarm, &key, &local)
            .into_iter()
            .map(|p| (p.node_id, p.multiaddrs))
            .collect();
        let hop = Hop::new(target, known.into_iter().chain(table), self.confirm());
        self.hop(swarm, hop);
    }

    /// Asks `hop`'s next node, or walks when it has asked enough.
    fn hop(&mut self, swarm: &mut Swarm<Behaviour>, mut hop: Hop) {
        // Planned meanwhile by another walk's region.
        let Some(key) = self.pending.key(&hop.target) else {
            return;
        };
        let Some((peer, dial)) = hop.next() else {
            count(&self.metrics.announce_hops, "walked");
            self.walk(swarm, hop.target);
            return;
        };
        let request = ProvideBatch {
            keys: Vec::new(),
            addrs: own_addrs(swarm),
            closest_to: Some(key),
        };
        let id = swarm
            .behaviour_mut()
            .provide
            .send_request_with_addresses(&peer, request, dial);
        self.hops.insert(id, (peer, hop));
    }

    /// `peer` answered a hop with `closest`: the region is planned, or the next node asked.
    fn on_hop(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        peer: PeerId,
        mut hop: Hop,
        closest: &[WirePeer],
    ) {
        hop.answered(peer, closest, swarm.local_peer_id());
        let Some(found) = hop.found(self.timing.replicas) else {
            self.hop(swarm, hop);
            return;
        };
        let outcome = if hop.confirming() {
            "confirmed"
        } else {
            "planned"
        };
        count(&self.metrics.announce_hops, outcome);
        let end = self.take_plan(hop.target, found.clone(), false);
        self.sweep_on(swarm, end, found);
    }

    /// A closest-peers query ended (`complete`: converged; `all_answered`: no node it asked
    /// failed); false when it was not ours.
    pub(super) fn on_walk(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        id: QueryId,
        found: Vec<PeerInfo>,
        complete: bool,
        all_answered: bool,
    ) -> bool {
        let Some(target) = self.walks.remove(&id) else {
            return false;
        };
        let outcome = if complete { "converged" } else { "timed_out" };
        count(&self.metrics.announce_walks, outcome);
        if found.is_empty() {
            self.walk_after = Some(Instant::now() + EMPTY_WALK_BACKOFF);
        }
        // Fewer than asked from a converged walk means there are no others, unless a node it
        // asked failed (one gone, a restarted node's old identity): its nodes went unheard. A
        // timed-out walk says nothing of the rest (else every key would go to the few it reached).
        let whole_network = complete && all_answered && found.len() < self.timing.replicas;
        let found: Vec<(PeerId, Vec<Multiaddr>)> =
            found.into_iter().map(|p| (p.peer_id, p.addrs)).collect();
        let end = self.take_plan(target, found.clone(), whole_network);
        // A walk that timed out says too little of its neighbourhood to hop on from.
        if complete {
            self.sweep_on(swarm, end, found);
        }
        self.progress(swarm);
        true
    }

    /// Plans the keys `found` covers around `target` into the outbox; where the region ends.
    fn take_plan(
        &mut self,
        target: Hash,
        found: Vec<(PeerId, Vec<Multiaddr>)>,
        whole_network: bool,
    ) -> Option<Hash> {
        let ids: Vec<PeerId> = found.iter().map(|(p, _)| *p).collect();
        let (plan, end) = (self.pending).plan(&target, &ids, whole_network, self.timing.replicas);
        let mut addrs: HashMap<PeerId, Vec<Multiaddr>> = found.into_iter().collect();
        for (peer, keys) in plan {
            let out = self.outbox.entry(peer).or_default();
            out.keys.extend(keys);
            if let Some(a) = addrs.remove(&peer)
                && !a.is_empty()
            {
                out.addrs = a;
            }
        }
        end
    }

    /// Sends each node its batch once the round's walks are done (one request per node per
    /// round), or as soon as a full batch is ready.
    fn send_batches(&mut self, swarm: &mut Swarm<Behaviour>) {
        let round_planned =
            self.walks.is_empty() && self.hops.is_empty() && self.pending.is_empty();
        let addrs = own_addrs(swarm);
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
            let keys: Vec<Arc<str>> = out.keys.drain(..n).collect();
            let (dial, again) = (out.addrs.clone(), out.again);
            if out.keys.is_empty() {
                self.outbox.remove(&peer);
            }
            let request = ProvideBatch {
                keys: keys.iter().map(|k| k.to_string()).collect(),
                addrs: addrs.clone(),
                closest_to: None,
            };
            let id = (swarm.behaviour_mut().provide).send_request_with_addresses(
                &peer,
                request,
                dial.clone(),
            );
            let sent = Sent {
                keys,
                addrs: dial,
                again,
            };
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
                // A hop asks what a Kademlia walk's request asks.
                let kind = match request.keys.is_empty() && request.closest_to.is_some() {
                    true => "find_node",
                    false => "provide_batch",
                };
                self.metrics
                    .dht_requests
                    .get_or_create(&DhtLabels { kind })
                    .inc();
                let closest_to = request.closest_to.clone();
                let mut ack = self.store_batch(swarm, peer, request);
                if let Some(key) = closest_to {
                    ack.closest = answer(swarm, &peer, &key);
                }
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
                if let Some((asked, hop)) = self.hops.remove(&request_id) {
                    self.on_hop(swarm, asked, hop, &response.closest);
                    self.progress(swarm);
                    return;
                }
                count(&self.metrics.announce_batches, "delivered");
                if let Some(Sent { keys: sent, .. }) = self.batches.remove(&request_id) {
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
                if let Some((asked, mut hop)) = self.hops.remove(&request_id) {
                    hop.failed(&asked);
                    self.hop(swarm, hop);
                    self.progress(swarm);
                    return;
                }
                let sent = self.batches.remove(&request_id);
                match sent {
                    Some(sent) if closed(&error) && !sent.again => {
                        count(&self.metrics.announce_batches, "retried");
                        let out = self.outbox.entry(peer).or_default();
                        out.keys.extend(sent.keys);
                        out.addrs = sent.addrs;
                        out.again = true;
                    }
                    _ => {
                        // The other replicas hold these keys; the next round tries again.
                        tracing::debug!(%peer, %error, "a batch of provider records was not delivered");
                        count(&self.metrics.announce_batches, "failed");
                    }
                }
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
            closest: Vec::new(),
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
        let sending: usize = self.batches.values().map(|b| b.keys.len()).sum();
        let n = self.pending.len() + planned + sending;
        self.metrics.announcements_pending.set(n as i64);
    }
}

/// This node's addresses, as a batch names them.
fn own_addrs(swarm: &Swarm<Behaviour>) -> Vec<String> {
    (swarm.external_addresses())
        .take(MAX_ADDRESSES)
        .map(|a| a.to_string())
        .collect()
}

/// A request sent on a connection closing as it went out: an idle one closes a second after
/// its last stream, and a new request can reach it in that moment.
fn closed(error: &OutboundFailure) -> bool {
    matches!(error, OutboundFailure::ConnectionClosed)
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

fn round_wait(interval: Duration, random: &Draws, draw: u64) -> Duration {
    let x = random.hash_one(draw) as f64 / u64::MAX as f64;
    interval.mul_f64(0.75 + 0.25 * x)
}
