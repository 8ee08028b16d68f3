//! The coordinator's side: for each digest it coordinates, who leads its download. One owner
//! (this table, behind its handle); pure logic over an injected clock, tested directly.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::oci::Digest;
use crate::routing::Peer;

/// A leader is trusted this long from its grant. A blob that takes longer to download gets a
/// second leader (a second upstream fetch, never a failure); a leader that dies earlier is
/// replaced as soon as a follower reports it.
pub(crate) const LEASE: Duration = Duration::from_secs(600);
/// At most this many leases are kept (about 100 bytes each); beyond it the oldest go.
const MAX_LEASES: usize = 100_000;

/// What a claim got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The claimant leads: its containerd fetches from upstream.
    Lead,
    /// Someone else leads: stream from its peer address.
    Follow(Peer),
}

#[derive(Debug, Default)]
pub(crate) struct Leases {
    table: Mutex<HashMap<Digest, (Peer, Instant)>>,
}

impl Leases {
    /// `claimant` asks who leads `digest`, and reports `failed` (a leader it could not
    /// follow), if any. The first claimant leads until its lease ends or it is reported.
    pub(crate) fn claim(
        &self,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
        now: Instant,
    ) -> Grant {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((leader, granted)) = table.get(digest) {
            let live = now.saturating_duration_since(*granted) < LEASE;
            let reported = failed.is_some_and(|f| f == leader.id);
            if live && !reported {
                if leader.id == claimant.id {
                    return Grant::Lead;
                }
                return Grant::Follow(leader.clone());
            }
        }
        if table.len() >= MAX_LEASES {
            table.retain(|_, (_, granted)| now.saturating_duration_since(*granted) < LEASE);
            if table.len() >= MAX_LEASES {
                // Still full of live leases: forget the oldest rather than refuse.
                if let Some(oldest) = table
                    .iter()
                    .min_by_key(|(_, (_, g))| *g)
                    .map(|(d, _)| d.clone())
                {
                    table.remove(&oldest);
                }
            }
        }
        table.insert(digest.clone(), (claimant.clone(), now));
        Grant::Lead
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str) -> Peer {
        Peer {
            id: id.into(),
            addr: "10.0.0.1:5481".parse().unwrap(),
        }
    }

    #[test]
    fn the_first_claimant_leads_and_the_others_follow_it() {
        let leases = Leases::default();
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        assert_eq!(leases.claim(&d, &peer("a"), None, t), Grant::Lead);
        assert_eq!(
            leases.claim(&d, &peer("b"), None, t),
            Grant::Follow(peer("a"))
        );
        assert_eq!(
            leases.claim(&d, &peer("c"), None, t),
            Grant::Follow(peer("a"))
        );
        // The leader asking again (a retry of its own) still leads.
        assert_eq!(leases.claim(&d, &peer("a"), None, t), Grant::Lead);
        // Another digest has its own leader.
        let other = Digest::sha256_of(b"other layer");
        assert_eq!(leases.claim(&other, &peer("c"), None, t), Grant::Lead);
    }

    #[test]
    fn a_reported_or_expired_leader_is_replaced_by_the_claimant() {
        let leases = Leases::default();
        let d = Digest::sha256_of(b"layer");
        let t = Instant::now();
        leases.claim(&d, &peer("a"), None, t);
        // A report about someone else changes nothing.
        assert_eq!(
            leases.claim(&d, &peer("b"), Some("z"), t),
            Grant::Follow(peer("a"))
        );
        assert_eq!(leases.claim(&d, &peer("b"), Some("a"), t), Grant::Lead);
        assert_eq!(
            leases.claim(&d, &peer("c"), None, t),
            Grant::Follow(peer("b"))
        );
        let later = t + LEASE + Duration::from_secs(1);
        assert_eq!(leases.claim(&d, &peer("c"), None, later), Grant::Lead);
    }
}
