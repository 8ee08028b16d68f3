//! Coalescing within one node: containerd downloads a digest once per namespace, so a second
//! request for a digest another request is transferring comes from another namespace; it
//! reads the first one's download as it lands instead of starting a second transfer.
//!
//! Invariant: a request never waits for itself: its own download exists before it asks but
//! does not grow while it waits, and only a growing download is shared.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::oci::Digest;

/// The digests this node's containerd is being sent now; a [`Transfer`] removes its entry
/// when its response ends.
#[derive(Debug, Default)]
pub(crate) struct Transfers {
    active: Mutex<HashMap<Digest, usize>>,
}

/// One request's part in a digest's transfers; keep it alive as long as the response body.
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
