//! Which peers to pass over, and until when: one owner, shared by the fetcher and its bodies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::failure::{FAILED_PEER_BACKOFF, PeerFailure};
use crate::metrics::{Metrics, StageLabels};
use crate::routing::Peer;

#[derive(Debug)]
pub(super) struct PeerHealth {
    metrics: Arc<Metrics>,
    /// By peer ID.
    until: Mutex<HashMap<String, Instant>>,
}

impl PeerHealth {
    pub(super) fn new(metrics: Arc<Metrics>) -> PeerHealth {
        PeerHealth {
            metrics,
            until: Mutex::new(HashMap::new()),
        }
    }

    /// Counted, logged, and passed over for the failure's backoff.
    pub(super) fn failed(&self, peer: &Peer, failure: &PeerFailure) {
        let stage = failure.stage();
        tracing::warn!(peer = %peer.id, addr = %peer.addr, stage, reason = %failure, "peer fetch failed; trying the next provider");
        self.metrics
            .peer_failures
            .get_or_create(&StageLabels { stage })
            .inc();
        let now = Instant::now();
        let mut until = self.lock();
        until.retain(|_, t| *t > now);
        let t = until.entry(peer.id.clone()).or_insert(now);
        *t = (*t).max(now + failure.backoff());
    }

    /// Quarantined (it served bytes that did not match): not asked at all.
    pub(super) fn quarantined(&self, peer: &Peer) -> bool {
        self.lock()
            .get(&peer.id)
            .is_some_and(|until| *until > Instant::now() + FAILED_PEER_BACKOFF)
    }

    /// Peer ID, time left, and whether quarantined.
    pub(super) fn passed_over(&self) -> Vec<(String, Duration, bool)> {
        let now = Instant::now();
        let mut out: Vec<_> = self
            .lock()
            .iter()
            .filter(|(_, t)| **t > now)
            .map(|(id, t)| {
                let left = *t - now;
                (id.clone(), left, left > FAILED_PEER_BACKOFF)
            })
            .collect();
        out.sort();
        out
    }

    /// Recently failed peers last.
    pub(super) fn order(&self, mut peers: Vec<Peer>) -> Vec<Peer> {
        let until = self.lock();
        let now = Instant::now();
        peers.sort_by_key(|p| until.get(&p.id).is_some_and(|t| *t > now));
        peers
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.until.lock().unwrap_or_else(|e| e.into_inner())
    }
}
