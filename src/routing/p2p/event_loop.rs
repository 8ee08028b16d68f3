//! The one task that owns the `Swarm`. Everything else talks to it through commands; every
//! pending lookup ends on every outcome (found, none, timeout, error, shutdown), because its
//! reply channel is dropped when the query is over.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::kad::{self, GetProvidersOk, QueryId, QueryResult};
use libp2p::swarm::SwarmEvent;
use libp2p::{PeerId, Swarm, identify};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::behaviour::{Behaviour, BehaviourEvent, IDENTIFY_PROTOCOL, peer_addr_of};
use super::{Command, Status};
use crate::metrics::{DirectionLabels, Metrics};
use crate::problems::Problems;
use crate::routing::Peer;
use crate::routing::bootstrap::Bootstrap;

/// While no peer is connected, the bootstrap sources are dialled again, first after this
/// long, then twice as long each time up to [`REBOOTSTRAP_MAX`]: a node of a new pool started
/// a moment before the nodes it bootstraps from are listening finds them within a fraction of
/// a second (a fixed 10 s left the kubelet's first pulls, right after the node turned ready,
/// all going upstream), and the first node of a cluster still finds the others as they come.
const REBOOTSTRAP_MIN: Duration = Duration::from_millis(50);
const REBOOTSTRAP_MAX: Duration = Duration::from_secs(10);
/// With peers connected, how often the loop looks whether it still has any (then the backoff
/// starts again from [`REBOOTSTRAP_MIN`]).
const CONNECTED_CHECK: Duration = Duration::from_secs(1);
/// How often other nodes' expired provider records are swept out of the store (see
/// `ProviderStore::expire`): a scan of every key, about a millisecond for 12,500 keys.
const EXPIRE_INTERVAL: Duration = Duration::from_secs(60);
/// A failed handshake is a problem (see `problems.rs`) until this long after the last one.
const HANDSHAKE_PROBLEM_FOR: Duration = Duration::from_secs(600);
/// With peers connected, the DHT routing table is refreshed this often.
const KAD_BOOTSTRAP_INTERVAL: Duration = Duration::from_secs(300);
/// Announcements (Kademlia queries) in flight at once. A node with 10,000 keys would
/// otherwise start 10,000 queries at once: measured, that took its memory from 15 to 140 MiB
/// (and glibc keeps it), for no faster an end.
const MAX_ANNOUNCEMENTS_IN_FLIGHT: usize = 32;
/// How often keys due for re-announcement are queued (at most; a tenth of a short interval).
const REPROVIDE_TICK: Duration = Duration::from_secs(1);

/// When to re-announce a key announced at `now`: after between three quarters of `interval`
/// and all of it, the fraction drawn per key and per announcement. The keys a node announced
/// together at start (all of them) spread over a quarter of the interval at the first round and
/// drift further apart each round, so re-announcement is a trickle through the queue, never a
/// burst at the interval's boundary; and never later than `interval`, which is shorter than
/// the records' TTL, so no record lapses.
fn next_announcement(key: &str, now: Instant, interval: Duration, seed: &RandomState) -> Instant {
    let draw = seed.hash_one((key, now)) as f64 / u64::MAX as f64;
    now + interval.mul_f64(0.75 + 0.25 * draw)
}

pub(crate) struct EventLoop {
    swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    /// To send ourselves `Dial` after an asynchronous bootstrap resolution.
    self_commands: mpsc::Sender<Command>,
    status: Arc<Status>,
    bootstrap: Arc<dyn Bootstrap>,
    metrics: Arc<Metrics>,
    problems: Arc<Problems>,
    /// HTTP peer addresses learned through identify.
    http_addrs: HashMap<PeerId, SocketAddr>,
    /// Open provider lookups, with the providers already sent.
    lookups: HashMap<QueryId, (mpsc::Sender<Peer>, HashSet<PeerId>)>,
    /// Providers found before we knew their HTTP address: delivered once identify arrives,
    /// dropped (ending those lookups' streams) when the dial fails or the peer goes away.
    awaiting_identify: HashMap<PeerId, Vec<mpsc::Sender<Peer>>>,
    /// Keys to announce, started as announcements in flight finish.
    to_announce: VecDeque<String>,
    announcing: HashSet<QueryId>,
    /// Keys announced, by when to announce them again (`next_announcement`); a key is here, or
    /// queued in `to_announce`, until withdrawn.
    reannounce: BTreeSet<(Instant, String)>,
    reannounce_at: HashMap<String, Instant>,
    reprovide_interval: Duration,
    jitter: RandomState,
    kad_bootstrapped: bool,
}

impl EventLoop {
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        commands: mpsc::Receiver<Command>,
        self_commands: mpsc::Sender<Command>,
        status: Arc<Status>,
        bootstrap: Arc<dyn Bootstrap>,
        (metrics, problems): (Arc<Metrics>, Arc<Problems>),
        reprovide_interval: Duration,
    ) -> Self {
        EventLoop {
            swarm,
            commands,
            self_commands,
            status,
            bootstrap,
            metrics,
            problems,
            http_addrs: HashMap::new(),
            lookups: HashMap::new(),
            awaiting_identify: HashMap::new(),
            to_announce: VecDeque::new(),
            announcing: HashSet::new(),
            reannounce: BTreeSet::new(),
            reannounce_at: HashMap::new(),
            reprovide_interval,
            jitter: RandomState::new(),
            kad_bootstrapped: false,
        }
    }

    pub(crate) async fn run(mut self, token: CancellationToken) {
        let rebootstrap = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(rebootstrap);
        let mut backoff = REBOOTSTRAP_MIN;
        let mut refresh = tokio::time::interval(KAD_BOOTSTRAP_INTERVAL);
        let mut expire = tokio::time::interval(EXPIRE_INTERVAL);
        let mut reprovide = tokio::time::interval(
            REPROVIDE_TICK
                .min(self.reprovide_interval / 10)
                .max(Duration::from_millis(10)),
        );
        reprovide.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = token.cancelled() => break,
                command = self.commands.recv() => match command {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                () = &mut rebootstrap => {
                    let next = if self.status.connected.load(Ordering::Relaxed) == 0 {
                        self.resolve_bootstrap();
                        let wait = backoff;
                        backoff = (backoff * 2).min(REBOOTSTRAP_MAX);
                        wait
                    } else {
                        backoff = REBOOTSTRAP_MIN;
                        CONNECTED_CHECK
                    };
                    rebootstrap.as_mut().reset(tokio::time::Instant::now() + next);
                }
                _ = reprovide.tick() => self.queue_due_announcements(Instant::now()),
                _ = expire.tick() => {
                    let gone = self.swarm.behaviour_mut().kad.store_mut().expire(Instant::now());
                    if gone > 0 {
                        tracing::debug!(gone, "expired provider records dropped");
                    }
                }
                _ = refresh.tick() => {
                    if self.status.connected.load(Ordering::Relaxed) > 0 {
                        let _ = self.swarm.behaviour_mut().kad.bootstrap();
                    }
                }
            }
        }
        tracing::debug!("peer-to-peer task stopped");
    }

    /// Counts a peer connection that reached the other side and failed its handshake, and
    /// keeps the problem visible for [`HANDSHAKE_PROBLEM_FOR`] after the last one.
    fn handshake_failed(&self, direction: &'static str, error: &str) {
        self.metrics
            .peer_handshake_failures
            .get_or_create(&DirectionLabels { direction })
            .inc();
        self.problems.set_for(
            "peer_handshake_failing",
            format!(
                "a peer connection ({direction}) failed its handshake: a node with a different cluster secret, or not a Ferry, on the peer-to-peer port; nodes with different secrets form separate networks and never share. Check that every node mounts the same secret (with GitOps, set clusterSecret.existingSecret). Last: {error}"
            ),
            HANDSHAKE_PROBLEM_FOR,
        );
    }

    /// DNS can be slow: resolve off the loop, then dial through our own command queue.
    fn resolve_bootstrap(&self) {
        let bootstrap = self.bootstrap.clone();
        let commands = self.self_commands.clone();
        tokio::spawn(async move {
            let addrs = bootstrap.peers().await;
            if !addrs.is_empty() {
                let _ = commands.send(Command::Dial { addrs }).await;
            }
        });
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Lookup { key, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_providers(key.into_bytes().into());
                self.lookups.insert(id, (reply, HashSet::new()));
            }
            Command::Advertise { keys, reply } => {
                self.to_announce.extend(keys);
                let _ = reply.send(self.announce_next());
            }
            Command::Withdraw { keys } => {
                let gone: HashSet<&String> = keys.iter().collect();
                self.to_announce.retain(|k| !gone.contains(k));
                for key in &keys {
                    if let Some(at) = self.reannounce_at.remove(key) {
                        self.reannounce.remove(&(at, key.clone()));
                    }
                }
                let kad = &mut self.swarm.behaviour_mut().kad;
                for key in keys {
                    kad.stop_providing(&key.into_bytes().into());
                }
                self.update_announce_queue();
            }
            Command::Dial { addrs } => {
                for addr in addrs {
                    if let Err(e) = self.swarm.dial(addr.clone()) {
                        tracing::debug!(%addr, error = %e, "dial failed");
                    }
                }
            }
        }
    }

    /// Starts queued announcements up to the in-flight limit. `start_providing` also puts the
    /// record in our own store, so this node answers for a key from the moment it starts.
    fn announce_next(&mut self) -> Result<(), String> {
        let mut error = None;
        while self.announcing.len() < MAX_ANNOUNCEMENTS_IN_FLIGHT {
            let Some(key) = self.to_announce.pop_front() else {
                break;
            };
            match self
                .swarm
                .behaviour_mut()
                .kad
                .start_providing(key.clone().into_bytes().into())
            {
                Ok(id) => {
                    self.announcing.insert(id);
                    self.schedule(key);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot announce a key; trying again at the next round");
                    error.get_or_insert(e.to_string());
                    self.schedule(key);
                }
            }
        }
        self.update_announce_queue();
        error.map_or(Ok(()), Err)
    }

    /// `key` was announced now: when to announce it again.
    fn schedule(&mut self, key: String) {
        let now = Instant::now();
        let at = next_announcement(&key, now, self.reprovide_interval, &self.jitter);
        if let Some(before) = self.reannounce_at.insert(key.clone(), at) {
            self.reannounce.remove(&(before, key.clone()));
        }
        self.reannounce.insert((at, key));
    }

    /// Moves the keys due for re-announcement into the announcement queue.
    fn queue_due_announcements(&mut self, now: Instant) {
        let mut due = false;
        while let Some((at, _)) = self.reannounce.first()
            && *at <= now
        {
            let Some((_, key)) = self.reannounce.pop_first() else {
                break;
            };
            self.reannounce_at.remove(&key);
            self.to_announce.push_back(key);
            due = true;
        }
        if due {
            let _ = self.announce_next();
        }
    }

    fn update_announce_queue(&self) {
        let n = self.to_announce.len() + self.announcing.len();
        self.metrics.announcements_pending.set(n as i64);
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Kad(event)) => self.on_kad_event(event),
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => self.on_identified(peer_id, info),
            SwarmEvent::ConnectionEstablished {
                peer_id, endpoint, ..
            } => {
                self.status
                    .connected_since
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(peer_id.to_base58())
                    .or_insert_with(std::time::SystemTime::now);
                if endpoint.is_dialer() {
                    // A bootstrap dial: Kademlia learns the address it worked at.
                    let addr = endpoint.get_remote_address().clone();
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
                self.update_connected();
                if !self.kad_bootstrapped {
                    self.kad_bootstrapped = self.swarm.behaviour_mut().kad.bootstrap().is_ok();
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established,
                ..
            } => {
                if num_established == 0 {
                    self.status
                        .connected_since
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&peer_id.to_base58());
                    self.awaiting_identify.remove(&peer_id);
                }
                self.update_connected();
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!(?peer_id, %error, "outgoing connection failed");
                // A refused or unreachable address is a node not up yet; a failed handshake
                // is a node that answered and could not agree on the key: another secret.
                // (libp2p's dial error keeps its cause only in its text.)
                if error.to_string().contains("Handshake failed") {
                    self.handshake_failed("outgoing", &error.to_string());
                }
                if let Some(peer) = peer_id {
                    self.awaiting_identify.remove(&peer);
                }
            }
            // Every incoming connection that fails did connect: it failed the handshake.
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => {
                tracing::debug!(%send_back_addr, %error, "incoming connection failed");
                self.handshake_failed("incoming", &format!("from {send_back_addr}: {error}"));
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::debug!(%address, "listening for peers");
            }
            other => tracing::trace!(event = ?other, "swarm event"),
        }
    }

    fn on_kad_event(&mut self, event: kad::Event) {
        match event {
            kad::Event::OutboundQueryProgressed {
                id,
                result: QueryResult::GetProviders(result),
                step,
                ..
            } => {
                match result {
                    Ok(GetProvidersOk::FoundProviders { providers, .. }) => {
                        for provider in providers {
                            self.deliver(id, provider);
                        }
                    }
                    Ok(GetProvidersOk::FinishedWithNoAdditionalRecord { .. }) => {
                        self.lookups.remove(&id);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "provider lookup ended");
                        self.lookups.remove(&id);
                    }
                }
                if step.last {
                    self.lookups.remove(&id);
                }
            }
            kad::Event::OutboundQueryProgressed {
                id,
                result: QueryResult::StartProviding(result),
                step,
                ..
            } => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "announcement did not reach every closest peer");
                }
                if step.last && self.announcing.remove(&id) {
                    let _ = self.announce_next();
                }
            }
            kad::Event::OutboundQueryProgressed {
                result: QueryResult::Bootstrap(Err(e)),
                ..
            } => {
                tracing::debug!(error = %e, "DHT bootstrap step failed");
            }
            other => tracing::trace!(event = ?other, "kademlia event"),
        }
    }

    fn deliver(&mut self, id: QueryId, provider: PeerId) {
        if provider == *self.swarm.local_peer_id() {
            return;
        }
        let Some((reply, sent)) = self.lookups.get_mut(&id) else {
            return;
        };
        if !sent.insert(provider) {
            return;
        }
        match self.http_addrs.get(&provider) {
            Some(addr) => {
                let _ = reply.try_send(Peer {
                    id: provider.to_base58(),
                    addr: *addr,
                });
            }
            None => {
                self.awaiting_identify
                    .entry(provider)
                    .or_default()
                    .push(reply.clone());
                if !self.swarm.is_connected(&provider)
                    && let Err(e) = self.swarm.dial(provider)
                {
                    tracing::debug!(%provider, error = %e, "cannot dial provider");
                    self.awaiting_identify.remove(&provider);
                }
            }
        }
    }

    fn on_identified(&mut self, peer_id: PeerId, info: identify::Info) {
        if info.protocol_version != IDENTIFY_PROTOCOL {
            tracing::debug!(%peer_id, protocol = %info.protocol_version, "not a ferry node; ignored");
            return;
        }
        let Some(http) = peer_addr_of(&info.agent_version) else {
            tracing::debug!(%peer_id, agent = %info.agent_version, "no peer address in identify");
            return;
        };
        for addr in info.listen_addrs {
            self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
        }
        self.http_addrs.insert(peer_id, http);
        self.publish_members();
        for reply in self.awaiting_identify.remove(&peer_id).unwrap_or_default() {
            let _ = reply.try_send(Peer {
                id: peer_id.to_base58(),
                addr: http,
            });
        }
    }

    fn update_connected(&self) {
        let n = self.swarm.connected_peers().count();
        self.status.connected.store(n, Ordering::Relaxed);
        self.metrics.peers_connected.set(n as i64);
        self.publish_members();
    }

    /// The connected peers with a known peer address, for whoever picks among live nodes.
    fn publish_members(&self) {
        let mut members: Vec<Peer> = self
            .swarm
            .connected_peers()
            .filter_map(|id| {
                self.http_addrs.get(id).map(|addr| Peer {
                    id: id.to_base58(),
                    addr: *addr,
                })
            })
            .collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        *self
            .status
            .members
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(members);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_announced_together_are_announced_again_spread_over_a_quarter_of_the_interval() {
        let seed = RandomState::new();
        let now = Instant::now();
        let interval = Duration::from_secs(600);
        let times: Vec<Duration> = (0..10_000)
            .map(|i| next_announcement(&format!("sha256:{i:064x}"), now, interval, &seed) - now)
            .collect();
        assert!(
            times
                .iter()
                .all(|t| *t >= interval.mul_f64(0.75) && *t <= interval)
        );
        // Spread, not bunched: every tenth of the window [0.75, 1.0] gets some.
        let mut buckets = [0u32; 10];
        for t in &times {
            let x = (t.as_secs_f64() / interval.as_secs_f64() - 0.75) / 0.25;
            buckets[((x * 10.0) as usize).min(9)] += 1;
        }
        assert!(buckets.iter().all(|&n| n > 800 && n < 1200), "{buckets:?}");
    }
}
