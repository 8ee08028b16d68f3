//! The one task that owns the `Swarm`. Invariant: every pending lookup ends on every outcome,
//! as its reply channel is dropped when the query is over.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::routing::clock::Instant;

use futures::StreamExt;
use libp2p::kad::{self, GetProvidersOk, QueryId, QueryResult};
use libp2p::swarm::dial_opts::DialOpts;
use libp2p::swarm::{DialError, SwarmEvent};
use libp2p::{PeerId, Swarm, identify};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::announcer::Announcer;
use super::behaviour::{
    Behaviour, BehaviourEvent, IDENTIFY_PROTOCOL, PARALLELISM, ProvideTiming, peer_addr_of,
};
use super::closest::{Closest, Coordinator};
use super::dials::BootstrapDials;
use super::draws::Draws;
use super::key_check;
use super::peer_addrs::PeerAddrs;
use super::per_ip;
use super::{Command, Status};
use crate::metrics::{DhtLabels, DirectionLabels, Metrics, OutcomeLabels};
use crate::ops::problems::Problems;
use crate::routing::bootstrap::Bootstrap;
use crate::routing::{Peer, plausible_peer_ip};

mod coordinator;

/// Bootstrap retry with no peer, doubling up to [`REBOOTSTRAP_MAX`]: nodes started a moment
/// apart find each other before the kubelet's first pulls.
const REBOOTSTRAP_MIN: Duration = Duration::from_millis(50);
const REBOOTSTRAP_MAX: Duration = Duration::from_secs(10);
const CONNECTED_CHECK: Duration = Duration::from_secs(1);
/// How often expired records are swept (a scan of every key).
const EXPIRE_INTERVAL: Duration = Duration::from_secs(60);
const HANDSHAKE_PROBLEM_FOR: Duration = Duration::from_secs(600);
/// How often the node walks to its own ID: its nearest neighbours decide which keys it holds;
/// traffic keeps the rest of the table (docs/design/how-it-works.md).
const KAD_REFRESH_INTERVAL: Duration = Duration::from_secs(300);
/// The announcer's tick; at most a tenth of a short interval.
const ANNOUNCE_TICK: Duration = Duration::from_secs(1);

pub(crate) struct EventLoop {
    swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    /// For `Bootstrap` after an asynchronous resolution.
    self_commands: mpsc::Sender<Command>,
    status: Arc<Status>,
    bootstrap: Arc<dyn Bootstrap>,
    dials: BootstrapDials,
    metrics: Arc<Metrics>,
    problems: Arc<Problems>,
    local: Peer,
    http_addrs: PeerAddrs,
    /// Open lookups, with the providers already sent.
    lookups: HashMap<QueryId, (mpsc::Sender<Peer>, HashSet<PeerId>)>,
    /// Dials since start; those during a lookup's walk count for it.
    dialled: u64,
    /// `dialled` at each walk's start, and whether it found a provider.
    lookup_dials: HashMap<QueryId, (u64, bool)>,
    /// Providers awaiting identify; dropped when the dial fails or the peer goes away.
    awaiting_identify: HashMap<PeerId, Vec<mpsc::Sender<Peer>>>,
    closest: Closest,
    /// Who waits for a key's coordinator, until a walk for it ends.
    coordinator_waiting: HashMap<String, Vec<mpsc::Sender<Peer>>>,
    coordinator_walks: HashSet<QueryId>,
    announcer: Announcer,
    /// The full bootstrap ran since this node last had no peer.
    kad_bootstrapped: bool,
    /// Addresses of nodes (bootstrap, connected): only a failed handshake from one of them
    /// raises the problem, since anyone can send bytes that fail one.
    known_ips: HashSet<IpAddr>,
}

/// Enough for every node of a large cluster; past it, no new address is learnt.
const MAX_KNOWN_IPS: usize = 16_384;

impl EventLoop {
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        commands: mpsc::Receiver<Command>,
        self_commands: mpsc::Sender<Command>,
        status: Arc<Status>,
        (bootstrap, dials): (Arc<dyn Bootstrap>, BootstrapDials),
        (metrics, problems): (Arc<Metrics>, Arc<Problems>),
        (timing, local, draws): (ProvideTiming, Peer, Draws),
    ) -> Self {
        EventLoop {
            closest: Closest::new(*swarm.local_peer_id()),
            swarm,
            commands,
            self_commands,
            status,
            bootstrap,
            dials,
            announcer: Announcer::new(timing, metrics.clone(), draws),
            metrics,
            problems,
            local,
            http_addrs: PeerAddrs::new(timing.ttl),
            lookups: HashMap::new(),
            dialled: 0,
            lookup_dials: HashMap::new(),
            awaiting_identify: HashMap::new(),
            coordinator_waiting: HashMap::new(),
            coordinator_walks: HashSet::new(),
            kad_bootstrapped: false,
            known_ips: HashSet::new(),
        }
    }

    pub(crate) async fn run(mut self, token: CancellationToken) {
        let rebootstrap = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(rebootstrap);
        let mut backoff = REBOOTSTRAP_MIN;
        let mut refresh = tokio::time::interval(KAD_REFRESH_INTERVAL);
        // Not at once: the full bootstrap runs at the first connection instead.
        refresh.reset();
        let mut expire = tokio::time::interval(EXPIRE_INTERVAL);
        let mut announce = tokio::time::interval(
            ANNOUNCE_TICK
                .min(self.announcer.interval() / 10)
                .max(Duration::from_millis(10)),
        );
        announce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = token.cancelled() => break,
                command = self.commands.recv() => match command {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                () = &mut rebootstrap => {
                    // Anchor changes raise no event: read them every second.
                    self.update_anchored();
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
                _ = announce.tick() => self.announcer.tick(&mut self.swarm, Instant::now()),
                _ = expire.tick() => {
                    let now = Instant::now();
                    let gone = self.swarm.behaviour_mut().kad.store_mut().expire(now);
                    if gone > 0 {
                        tracing::debug!(gone, "expired provider records dropped");
                    }
                    let swarm = &self.swarm;
                    let forgotten = self.http_addrs.forget_stale(now, |p| swarm.is_connected(p));
                    if forgotten > 0 {
                        tracing::debug!(forgotten, known = self.http_addrs.len(), "peer addresses unheard of for a record's lifetime forgotten");
                    }
                }
                _ = refresh.tick() => {
                    if self.status.connected.load(Ordering::Relaxed) > 0 {
                        let local = *self.swarm.local_peer_id();
                        self.swarm.behaviour_mut().kad.get_closest_peers(local);
                    }
                }
            }
        }
        tracing::debug!("peer-to-peer task stopped");
    }

    /// Counted always; the problem is raised only for a node (`known`).
    fn handshake_failed(&self, direction: &'static str, error: &str, known: bool) {
        self.metrics
            .peer_handshake_failures
            .get_or_create(&DirectionLabels { direction })
            .inc();
        if !known {
            return;
        }
        self.problems.set_for(
            "peer_handshake_failing",
            format!(
                "a peer connection ({direction}) failed its handshake: a node with a different cluster secret, or not a Ferry, on the peer-to-peer port; nodes with different secrets form separate networks and never share. Check that every node mounts the same secret (with GitOps, set clusterSecret.existingSecret). Last: {error}"
            ),
            HANDSHAKE_PROBLEM_FOR,
        );
    }

    fn learn_ip(&mut self, addr: &libp2p::Multiaddr) {
        if self.known_ips.len() < MAX_KNOWN_IPS
            && let Some(ip) = per_ip::ip_of(addr)
        {
            self.known_ips.insert(ip);
        }
    }

    /// DNS and the Kubernetes API can be slow: resolve off the loop.
    fn resolve_bootstrap(&self) {
        let bootstrap = self.bootstrap.clone();
        let commands = self.self_commands.clone();
        tokio::spawn(async move {
            let addrs = bootstrap.peers().await;
            if !addrs.is_empty() {
                let _ = commands.send(Command::Bootstrap { addrs }).await;
            }
        });
    }

    fn bootstrap_dial(&mut self, addrs: Vec<libp2p::Multiaddr>) {
        for addr in &addrs {
            self.learn_ip(addr);
        }
        // A peer may have connected since the resolution started.
        if self.swarm.connected_peers().next().is_some() {
            return;
        }
        for addr in self.dials.pick(addrs) {
            let opts = DialOpts::unknown_peer_id().address(addr.clone()).build();
            let id = opts.connection_id();
            match self.swarm.dial(opts) {
                Ok(()) => {
                    self.dials.started(id);
                    self.metrics.bootstrap_dials.inc();
                }
                Err(e) => tracing::debug!(%addr, error = %e, "bootstrap dial failed"),
            }
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Lookup { key, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_providers(key.as_bytes().to_vec().into());
                self.closest.walking(id, key);
                self.lookups.insert(id, (reply, HashSet::new()));
                self.lookup_dials.insert(id, (self.dialled, false));
            }
            Command::Coordinator { key, reply } => self.coordinator(key, reply),
            Command::CoordinatorNow { key, reply } => self.coordinator_now(key, reply),
            Command::Bootstrap { addrs } => self.bootstrap_dial(addrs),
            Command::Advertise { keys, reply } => {
                let _ = reply.send(self.announcer.advertise(&mut self.swarm, keys));
            }
            Command::Withdraw { keys } => self.announcer.withdraw(&mut self.swarm, keys),
            Command::Dial { addrs } => {
                for addr in addrs {
                    if let Err(e) = self.swarm.dial(addr.clone()) {
                        tracing::debug!(%addr, error = %e, "dial failed");
                    }
                }
            }
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Kad(event)) => self.on_kad_event(event),
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => self.on_identified(peer_id, info),
            SwarmEvent::Behaviour(BehaviourEvent::Provide(event)) => {
                self.announcer.on_provide_event(&mut self.swarm, event)
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                endpoint,
                connection_id,
                ..
            } => {
                self.dials.ended(connection_id);
                self.learn_ip(endpoint.get_remote_address());
                self.status
                    .connected_since
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(peer_id)
                    .or_insert_with(std::time::SystemTime::now);
                if endpoint.is_dialer() {
                    self.dialled += 1;
                    // Kademlia learns the address a bootstrap dial worked at.
                    let addr = endpoint.get_remote_address().clone();
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
                self.update_connected();
                if !self.kad_bootstrapped {
                    self.kad_bootstrapped = self.swarm.behaviour_mut().kad.bootstrap().is_ok();
                }
                // Keys advertised before the first peer came wait for it.
                self.announcer.progress(&mut self.swarm);
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
                        .remove(&peer_id);
                    self.status
                        .members
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&peer_id);
                    self.awaiting_identify.remove(&peer_id);
                }
                self.update_connected();
                // Cut off: the table may be stale everywhere, so the next first connection
                // refills it (the periodic refresh keeps only the nearest).
                if self.status.connected.load(Ordering::Relaxed) == 0 {
                    self.kad_bootstrapped = false;
                }
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id,
                error,
                connection_id,
            } => {
                self.dials.ended(connection_id);
                tracing::debug!(?peer_id, %error, "outgoing connection failed");
                // Only a failed handshake (not a refusal) means another secret.
                let text = error.to_string();
                if key_check::dial_failed_handshake(&text) {
                    self.handshake_failed("outgoing", &text, true);
                }
                if let Some(peer) = peer_id {
                    self.awaiting_identify.remove(&peer);
                }
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => {
                let causes = key_check::causes(&error);
                tracing::debug!(%send_back_addr, error = %causes, "incoming connection failed");
                if key_check::incoming_failed_handshake(&causes) {
                    let known = per_ip::ip_of(&send_back_addr)
                        .is_some_and(|ip| self.known_ips.contains(&ip));
                    let error = format!("from {send_back_addr}: {causes}");
                    self.handshake_failed("incoming", &error, known);
                }
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
                stats,
            } => {
                match result {
                    Ok(GetProvidersOk::FoundProviders { providers, .. }) => {
                        if let Some((_, found)) = self.lookup_dials.get_mut(&id) {
                            *found |= !providers.is_empty();
                        }
                        for provider in providers {
                            self.deliver(id, provider);
                        }
                    }
                    Ok(GetProvidersOk::FinishedWithNoAdditionalRecord { closest_peers }) => {
                        // A miss: its coordinator is the closest of these.
                        let walked = self
                            .closest
                            .walked(&id, Some(&closest_peers), Instant::now());
                        if let Some((key, cut)) = walked {
                            self.walk_ended(key, Some(&closest_peers), cut);
                        }
                        self.lookups.remove(&id);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "provider lookup ended");
                        self.lookups.remove(&id);
                    }
                }
                if step.last {
                    self.lookup_ended(id, &stats);
                    if let Some((key, cut)) = self.closest.walked(&id, None, Instant::now()) {
                        self.walk_ended(key, None, cut);
                    }
                    self.lookups.remove(&id);
                }
                // Nobody reads it any more: end the walk (left running, it slows later lookups).
                if self
                    .lookups
                    .get(&id)
                    .is_some_and(|(reply, _)| reply.is_closed())
                {
                    self.lookups.remove(&id);
                    // Only walks that found providers are cut short; they prove nothing about
                    // a coordinator, so whoever waits gets a walk of its own.
                    if let Some(key) = self.closest.abandoned(&id) {
                        self.walk_ended(key, None, false);
                    }
                    if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                        query.finish();
                    }
                }
            }
            kad::Event::OutboundQueryProgressed {
                id,
                result: QueryResult::GetClosestPeers(result),
                stats,
                ..
            } => {
                let (found, complete) = match result {
                    Ok(ok) => (ok.peers, true),
                    // Its nodes can hold records, but are not the whole network.
                    Err(kad::GetClosestPeersError::Timeout { peers, .. }) => (peers, false),
                };
                if self.coordinator_walks.remove(&id) {
                    // A timed-out walk answers, but does not stand for the key afterwards.
                    let peers: Vec<PeerId> = found.iter().map(|p| p.peer_id).collect();
                    let walked = self.closest.walked(
                        &id,
                        complete.then_some(peers.as_slice()),
                        Instant::now(),
                    );
                    if let Some((key, cut)) = walked {
                        self.walk_ended(key, Some(&peers), cut);
                    }
                } else {
                    let all_answered = stats.num_failures() == 0;
                    (self.announcer).on_walk(&mut self.swarm, id, found, complete, all_answered);
                }
            }
            kad::Event::InboundRequest { request } => {
                let kind = match request {
                    kad::InboundRequest::FindNode { .. } => "find_node",
                    kad::InboundRequest::GetProvider { .. } => "get_providers",
                    kad::InboundRequest::AddProvider { .. } => "add_provider",
                    _ => "other",
                };
                self.metrics
                    .dht_requests
                    .get_or_create(&DhtLabels { kind })
                    .inc();
            }
            kad::Event::OutboundQueryProgressed {
                result: QueryResult::Bootstrap(Err(e)),
                ..
            } => {
                tracing::debug!(error = %e, "DHT bootstrap step failed");
            }
            kad::Event::RoutingUpdated {
                is_new_peer: true, ..
            } => self.announcer.table_grew(Instant::now()),
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
        let reply = reply.clone();
        self.send_peer(provider, reply);
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
        // A member names its own addresses: none that would point dials at this node itself.
        let own = self.local.addr.ip();
        if !plausible_peer_ip(http.ip(), own) {
            tracing::debug!(%peer_id, %http, "implausible peer address in identify; ignored");
            return;
        }
        for addr in info.listen_addrs {
            if per_ip::ip_of(&addr).is_none_or(|ip| plausible_peer_ip(ip, own)) {
                self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
            }
        }
        let peer = self.http_addrs.heard(peer_id, http, Instant::now());
        if self.swarm.is_connected(&peer_id) {
            self.status
                .members
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(peer_id, peer.clone());
        }
        for reply in self.awaiting_identify.remove(&peer_id).unwrap_or_default() {
            let _ = reply.try_send(peer.clone());
        }
    }

    fn update_anchored(&self) {
        let (held, inbound) = self.swarm.behaviour().anchors.counts();
        for (direction, n) in [("outgoing", held), ("incoming", inbound)] {
            self.metrics
                .peers_anchored
                .get_or_create(&DirectionLabels { direction })
                .set(n as i64);
        }
    }

    /// Counts a provider walk's cost (`ferry_provider_walk_*`) and logs it at debug level.
    fn lookup_ended(&mut self, id: QueryId, stats: &kad::QueryStats) {
        let (dials_at, found) = self
            .lookup_dials
            .remove(&id)
            .unwrap_or((self.dialled, false));
        let dialled = self.dialled - dials_at;
        let labels = OutcomeLabels {
            outcome: if found { "found" } else { "none" },
        };
        self.metrics.provider_walks.get_or_create(&labels).inc();
        self.metrics
            .provider_walk_requests
            .get_or_create(&labels)
            .inc_by(u64::from(stats.num_requests()));
        self.metrics
            .provider_walk_dials
            .get_or_create(&labels)
            .inc_by(dialled);
        tracing::debug!(
            requests = stats.num_requests(),
            answered = stats.num_successes(),
            failed = stats.num_failures(),
            dialled,
            found,
            ms = stats.duration().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            "provider walk ended"
        );
    }

    fn update_connected(&self) {
        self.update_anchored();
        let n = self.swarm.connected_peers().count();
        self.status.connected.store(n, Ordering::Relaxed);
        self.metrics.peers_connected.set(n as i64);
    }
}
