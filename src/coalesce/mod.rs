//! Storm-proof rollouts: when several nodes miss one digest at once, one node's containerd (the
//! leader) fetches it upstream and the others (followers) stream the leader's download as it
//! lands. The digest's coordinator answers each claim with *lead* or *follow* from its leases.
//!
//! Invariant: every step only makes a pull faster or hands it back at once (a 404, or a cut
//! transfer containerd resumes elsewhere); a wrong guess costs at most one more upstream fetch.

pub(crate) mod leases;
pub(crate) mod relay;
#[cfg(test)]
mod tests;
pub(crate) mod transfers;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::routing::clock::Instant;

use crate::metrics::{CoalesceLabels, Metrics};
use crate::oci::Digest;
use crate::routing::{ContentRouting, Peer, rendezvous};
use crate::store::ContentStore;
use crate::store::downloads::{self, Landing, Scope};
use axum::response::Response;
pub use leases::Grant;
use leases::{LEASE, Leases};
use relay::Received;
use transfers::{Transfer, Transfers};

/// A claim gets this long; a later answer counts as none and the miss goes upstream. Not
/// shorter: a claim on a busy node can take a few hundred ms (`docs/design/coalescing.md`).
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(1);
/// A relay's window is kept this long after its last byte arrived.
const WINDOW_KEPT: Duration = Duration::from_secs(30);
/// A window that received nothing this long belongs to a transfer that ended elsewhere.
const WINDOW_STALE: Duration = Duration::from_secs(120);
/// Digests this node takes part in at once, at most: misses of random digests would otherwise
/// grow the table without end; past it, the oldest part without followers goes.
const MAX_PARTS: usize = 4_096;
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Downloads on this node written longer ago than this were left by failed ones: not shared.
const SHARE_FRESH: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct CoalesceConfig {
    /// How long a follower waits for the leader's first byte, and a leader for its download.
    pub follow_timeout: Duration,
    /// Followers one node streams a blob to at once; 0: every follower streams from the leader.
    pub relay_fanout: usize,
}

/// This node's part in one digest's download.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Its containerd fetches from upstream.
    Lead,
    /// Streams from this peer (the leader or a relay).
    Follow(Peer),
}

#[derive(Debug)]
struct Part {
    role: Role,
    /// The leader the coordinator named, when this node follows.
    leader: Option<Peer>,
    since: Instant,
    followers: HashMap<String, usize>,
    received: Option<Arc<Received>>,
}

impl Part {
    /// Within its lease, or still streaming to a follower.
    fn live(&self) -> bool {
        self.since.elapsed() < LEASE || !self.followers.is_empty()
    }
}

/// One digest in flight, as `ferry status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InFlightPart {
    pub digest: String,
    /// `leader`, `relay` (a follower with followers) or `follower`.
    pub role: String,
    pub source: Option<String>,
    pub followers: Vec<String>,
    pub age_s: u64,
}

/// What a claim decided for one miss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// This node leads: answer 404 so its containerd fetches from upstream.
    Lead,
    Follow(Peer),
    /// No coordinator could be asked in time: behave as without coalescing (404).
    Alone,
}

/// One node's part: its coordinator table, the digests it leads, and claiming.
pub struct Coalescer {
    router: Arc<dyn ContentRouting>,
    store: Arc<dyn ContentStore>,
    config: CoalesceConfig,
    metrics: Arc<Metrics>,
    leases: Leases,
    parts: Mutex<HashMap<Digest, Part>>,
    /// When `parts` was last swept of expired parts and spent windows.
    swept: Mutex<Instant>,
    /// Told when a part takes a role, for requests that wait for one (`role_soon`).
    roles: tokio::sync::Notify,
    claims: Arc<dyn ClaimSender>,
    transfers: Arc<Transfers>,
}

impl std::fmt::Debug for Coalescer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Sends a claim to another node's peer address (the peer client signs it).
#[async_trait::async_trait]
pub trait ClaimSender: Send + Sync + 'static {
    async fn claim(
        &self,
        coordinator: &Peer,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
    ) -> Option<Grant>;
}

impl Coalescer {
    pub fn new(
        router: Arc<dyn ContentRouting>,
        store: Arc<dyn ContentStore>,
        config: CoalesceConfig,
        metrics: Arc<Metrics>,
        claims: Arc<dyn ClaimSender>,
    ) -> Coalescer {
        let relay_fanout = config.relay_fanout;
        Coalescer {
            router,
            store,
            config,
            metrics,
            leases: Leases::new(relay_fanout),
            parts: Mutex::new(HashMap::new()),
            swept: Mutex::new(Instant::now()),
            roles: tokio::sync::Notify::new(),
            claims,
            transfers: Arc::default(),
        }
    }

    pub fn config(&self) -> &CoalesceConfig {
        &self.config
    }

    /// Who fetches `digest` upstream (`failed`: a source this node could not follow).
    pub async fn decide(&self, digest: &Digest, failed: Option<&Peer>) -> Decision {
        let me = self.router.local();
        let Some(coordinator) = self.coordinator(digest, &me).await else {
            return Decision::Alone;
        };
        let coordinator = &coordinator;
        let failed_id = failed.map(|p| p.id.as_str());
        let mut grant = self.ask(coordinator, digest, &me, failed_id).await;
        let fallback = || self.leader_to_fall_back_on(digest, coordinator, failed);
        if grant.is_none() && fallback().is_none() {
            // Refused, or silent (stopped, overloaded): every node that finds it so asks the
            // same next one, so they still agree on one leader rather than each go upstream.
            if let Some(backup) = self.backup_coordinator(digest, &me, coordinator) {
                tracing::info!(%digest, coordinator = %coordinator.id, backup = %backup.id, "no answer from the coordinator; claiming at the next one");
                grant = self.ask(&backup, digest, &me, failed_id).await;
            }
        }
        let grant_missing = grant.is_none();
        let (decision, leader) = match grant {
            Some(Grant::Follow { source, leader }) if source.id != me.id => {
                (Decision::Follow(source), Some(leader))
            }
            Some(_) => (Decision::Lead, None),
            None => match self.leader_to_fall_back_on(digest, coordinator, failed) {
                Some(leader) => {
                    tracing::info!(%digest, leader = %leader.id, "no coordinator: following the leader it named before");
                    (Decision::Follow(leader.clone()), Some(leader))
                }
                None => (Decision::Alone, None),
            },
        };
        let role = match &decision {
            Decision::Lead => Some(Role::Lead),
            Decision::Follow(source) => Some(Role::Follow(source.clone())),
            Decision::Alone => None,
        };
        if let Some(role) = role {
            let mut parts = self.lock_parts();
            self.sweep(&mut parts);
            if parts.len() >= MAX_PARTS && !parts.contains_key(digest) {
                let oldest = parts
                    .iter()
                    .filter(|(_, p)| p.followers.is_empty())
                    .min_by_key(|(_, p)| p.since)
                    .map(|(d, _)| d.clone());
                if let Some(oldest) = oldest {
                    parts.remove(&oldest);
                }
            }
            let part = parts.entry(digest.clone()).or_insert_with(|| Part {
                role: role.clone(),
                leader: None,
                since: Instant::now(),
                followers: HashMap::new(),
                received: None,
            });
            part.role = role;
            part.leader = leader;
            part.since = Instant::now();
            drop(parts);
            self.roles.notify_waiters();
        }
        let (role, result) = match &decision {
            Decision::Lead => ("leader", "upstream"),
            Decision::Follow(_) if grant_missing => ("follower", "leader_fallback"),
            Decision::Follow(_) => ("follower", "assigned"),
            Decision::Alone => ("none", "coordinator_unreachable"),
        };
        self.count(role, result);
        tracing::debug!(%digest, coordinator = %coordinator.id, ?decision, "coalesce decision");
        decision
    }

    async fn ask(
        &self,
        coordinator: &Peer,
        digest: &Digest,
        me: &Peer,
        failed: Option<&str>,
    ) -> Option<Grant> {
        if coordinator.id == me.id {
            return Some(self.leases.claim(digest, me, failed, Instant::now()));
        }
        let sent = self.claims.claim(coordinator, digest, me, failed);
        let started = Instant::now();
        let grant = tokio::time::timeout(CLAIM_TIMEOUT, sent).await;
        if grant.is_err() {
            tracing::info!(%digest, coordinator = %coordinator.id, waited_ms = started.elapsed().as_millis() as u64, "the coordinator did not answer a claim in time");
        }
        grant.ok().flatten()
    }

    /// Rendezvous hashing over the nodes this one knows, without `gone`.
    fn backup_coordinator(&self, digest: &Digest, me: &Peer, gone: &Peer) -> Option<Peer> {
        let members = self.router.members();
        let alive = members.iter().chain(std::iter::once(me));
        rendezvous::coordinator(digest, alive.filter(|p| p.id != gone.id)).cloned()
    }

    /// The leader named before, unless it is the silent coordinator or the failed source (a
    /// relay that was also the coordinator dies; its followers go on).
    fn leader_to_fall_back_on(
        &self,
        digest: &Digest,
        coordinator: &Peer,
        failed: Option<&Peer>,
    ) -> Option<Peer> {
        let parts = self.lock_parts();
        let leader = parts.get(digest)?.leader.clone()?;
        let gone = leader.id == coordinator.id || failed.is_some_and(|f| f.id == leader.id);
        (!gone).then_some(leader)
    }

    /// A download of `digest` already in progress on this node (another request's, or the one
    /// this node leads) to read instead of starting another. Keep the transfer for the response.
    pub async fn share_local(&self, digest: &Digest) -> (Transfer, Landing) {
        let transfer = self.transfers.begin(digest);
        let store = self.store.as_ref();
        if transfer.first && !self.leads(digest) {
            // Another namespace of this node's containerd may have committed it a moment
            // ago (Ferry's store lists one): read that file rather than fetch it again. Only
            // then: what another namespace has kept is not the mirror's to serve.
            let landed = if store.landed_within(digest, SHARE_FRESH).await {
                self.count("local", "committed");
                Landing::Committed
            } else {
                Landing::Nothing
            };
            return (transfer, landed);
        }
        let fresh = Scope::AnyFresh(SHARE_FRESH);
        let candidates = store.downloads(digest, fresh).await;
        // A single download is the requester's own (containerd opens its writer before
        // it asks): nothing else to read, unless the other one has just landed.
        if candidates.len() < 2 {
            let landed = if store.landed_within(digest, SHARE_FRESH).await {
                Landing::Committed
            } else {
                Landing::Nothing
            };
            return (transfer, landed);
        }
        let wait = self.config.follow_timeout;
        let found = downloads::growing(store, digest, candidates, wait).await;
        let result = match found {
            Landing::InFlight(_) => "shared",
            Landing::Committed => "committed",
            Landing::Nothing => "nothing_growing",
        };
        self.count("local", result);
        tracing::debug!(%digest, result, "a second request of this node for a digest in transfer");
        (transfer, found)
    }

    async fn coordinator(&self, digest: &Digest, me: &Peer) -> Option<Peer> {
        if let Some(picked) = self
            .router
            .coordinator(&crate::routing::digest_key(digest))
            .await
        {
            return Some(picked);
        }
        let members = self.router.members();
        let everyone = members.iter().chain(std::iter::once(me));
        rendezvous::coordinator(digest, everyone).cloned()
    }

    /// The coordinator side of a claim from another node.
    pub fn claim(&self, digest: &Digest, claimant: &Peer, failed: Option<&str>) -> Grant {
        let grant = self.leases.claim(digest, claimant, failed, Instant::now());
        tracing::debug!(%digest, claimant = %claimant.id, ?grant, "claim");
        grant
    }

    /// This node's role in `digest`'s download now (then its peer address serves it).
    pub fn role(&self, digest: &Digest) -> Option<Role> {
        let mut parts = self.lock_parts();
        self.sweep(&mut parts);
        let part = parts.get(digest)?;
        part.live().then(|| part.role.clone())
    }

    /// Drops expired parts and spent relay windows, at most every [`SWEEP_EVERY`]: a sweep
    /// walks every part, and misses may come by the thousand.
    fn sweep(&self, parts: &mut HashMap<Digest, Part>) {
        {
            let mut swept = self.swept.lock().unwrap_or_else(|e| e.into_inner());
            if swept.elapsed() < SWEEP_EVERY {
                return;
            }
            *swept = Instant::now();
        }
        parts.retain(|_, p| p.live());
        for part in parts.values_mut() {
            if part
                .received
                .as_ref()
                .is_some_and(|r| r.spent(WINDOW_KEPT, WINDOW_STALE))
            {
                part.received = None;
            }
        }
    }

    /// `response`, teed for this node's own followers.
    pub fn relaying(&self, digest: &Digest, response: Response) -> Response {
        let Some(total) = relay::blob_total(&response) else {
            return response;
        };
        match self.window(digest, total) {
            Some(received) => relay::tee(response, &received),
            None => response,
        }
    }

    /// The window of `digest`'s bytes this node receives as a follower, made by whichever
    /// comes first: its own answer, or a follower of its own asking.
    pub(crate) fn window(&self, digest: &Digest, total: u64) -> Option<Arc<Received>> {
        let mut parts = self.lock_parts();
        let part = parts.get_mut(digest)?;
        let received = part
            .received
            .get_or_insert_with(|| Arc::new(Received::new(total, 0)));
        (received.total() == total).then(|| received.clone())
    }

    pub fn leads(&self, digest: &Digest) -> bool {
        self.role(digest) == Some(Role::Lead)
    }

    /// [`Coalescer::role`], waiting up to [`CLAIM_TIMEOUT`]: a follower may ask before the
    /// answer to this node's own claim has reached it.
    pub async fn role_soon(&self, digest: &Digest) -> Option<Role> {
        let deadline = tokio::time::Instant::now() + CLAIM_TIMEOUT;
        loop {
            // Registered before the check, so a role taken in between is not missed.
            let taken = self.roles.notified();
            if let Some(role) = self.role(digest) {
                return Some(role);
            }
            if tokio::time::timeout_at(deadline, taken).await.is_err() {
                return self.role(digest);
            }
        }
    }

    /// `follower` streams `digest` from this node while the guard lives.
    pub fn serving(self: &Arc<Self>, digest: &Digest, follower: &str) -> Serving {
        let mut parts = self.lock_parts();
        if let Some(part) = parts.get_mut(digest) {
            *part.followers.entry(follower.to_string()).or_insert(0) += 1;
        }
        Serving {
            coalescer: self.clone(),
            digest: digest.clone(),
            follower: follower.to_string(),
        }
    }

    pub fn in_flight(&self) -> Vec<InFlightPart> {
        let mut parts: Vec<InFlightPart> = self
            .lock_parts()
            .iter()
            .filter(|(_, p)| p.live())
            .map(|(digest, p)| {
                let mut followers: Vec<String> = p.followers.keys().cloned().collect();
                followers.sort();
                let (role, source) = match &p.role {
                    Role::Lead => ("leader", None),
                    Role::Follow(s) if followers.is_empty() => ("follower", Some(s.id.clone())),
                    Role::Follow(s) => ("relay", Some(s.id.clone())),
                };
                InFlightPart {
                    digest: digest.to_string(),
                    role: role.to_string(),
                    source,
                    followers,
                    age_s: p.since.elapsed().as_secs(),
                }
            })
            .collect();
        parts.sort_by_key(|p| p.age_s);
        parts
    }

    pub fn count(&self, role: &'static str, result: &'static str) {
        self.counter(role, result).inc();
    }

    pub(crate) fn counter(
        &self,
        role: &'static str,
        result: &'static str,
    ) -> prometheus_client::metrics::counter::Counter {
        self.metrics
            .coalesce
            .get_or_create(&CoalesceLabels { role, result })
            .clone()
    }

    fn lock_parts(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Part>> {
        self.parts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A follower's stream from this node: counted among the digest's followers until dropped.
#[derive(Debug)]
pub struct Serving {
    coalescer: Arc<Coalescer>,
    digest: Digest,
    follower: String,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let mut parts = self.coalescer.lock_parts();
        if let Some(part) = parts.get_mut(&self.digest)
            && let Some(n) = part.followers.get_mut(&self.follower)
        {
            *n -= 1;
            if *n == 0 {
                part.followers.remove(&self.follower);
            }
        }
    }
}
