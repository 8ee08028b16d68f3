//! Coalescing within one node: requests of this node's containerd for a digest that another
//! request of it is transferring now. containerd serialises downloads of one digest within a
//! namespace itself (one writer per ref), so a second request comes from another namespace
//! (kubelet's `k8s.io` next to `nerdctl`'s `default`, say) and would start a second transfer:
//! instead it reads the first one's download out of containerd's ingest as it lands.
//!
//! The first request for a digest goes its usual way (peers, a coordinator, upstream); only
//! later ones share. Which download to read is decided by growth: the requester's own
//! download exists before it asks (containerd opens its writer first) but does not grow
//! while it waits for the answer, so a request never waits for itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::oci::Digest;

/// The digests this node's containerd is being sent now, by the mirror. One owner: this
/// table; a [`Transfer`] removes its entry when the response it belongs to ends.
#[derive(Debug, Default)]
pub(crate) struct Transfers {
    active: Mutex<HashMap<Digest, usize>>,
}

/// One request's part in a digest's transfers on this node; keep it alive as long as the
/// response body.
#[derive(Debug)]
pub struct Transfer {
    table: Arc<Transfers>,
    digest: Digest,
    /// No other request of this node was transferring the digest when this one began.
    pub first: bool,
}

impl Transfers {
    pub(crate) fn begin(self: &Arc<Self>, digest: &Digest) -> Transfer {
        let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        let count = active.entry(digest.clone()).or_insert(0);
        *count += 1;
        Transfer {
            table: self.clone(),
            digest: digest.clone(),
            first: *count == 1,
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        let mut active = self.table.active.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = active.get_mut(&self.digest) {
            *count -= 1;
            if *count == 0 {
                active.remove(&self.digest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_of_overlapping_requests_is_first() {
        let table = Arc::new(Transfers::default());
        let d = Digest::sha256_of(b"x");
        let a = table.begin(&d);
        let b = table.begin(&d);
        assert!(a.first && !b.first);
        assert!(table.begin(&Digest::sha256_of(b"y")).first, "per digest");
        drop(a);
        assert!(!table.begin(&d).first, "b still transfers");
        drop(b);
        assert!(table.begin(&d).first, "all ended");
        assert!(
            table.active.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }
}
