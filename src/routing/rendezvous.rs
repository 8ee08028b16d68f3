//! An order of the nodes for each digest that every node computes alike with no message:
//! rendezvous (highest random weight) hashing. It picks the node that coordinates a digest
//! when the router cannot tell, and the nodes that keep a blob's last copies. Invariant: nodes
//! that see the same members agree; a node joining or leaving moves only 1/N of the digests.

use sha2::{Digest as _, Sha256};

use crate::oci::Digest;
use crate::routing::Peer;

/// The member with the highest weight for `digest`.
pub fn coordinator<'a>(
    digest: &Digest,
    members: impl IntoIterator<Item = &'a Peer>,
) -> Option<&'a Peer> {
    members
        .into_iter()
        .max_by(|a, b| order(&a.id, &b.id, digest))
}

/// Whether node `a` comes before node `b` in `digest`'s order.
pub fn ahead(a: &str, b: &str, digest: &Digest) -> bool {
    order(a, b, digest).is_gt()
}

fn order(a: &str, b: &str, digest: &Digest) -> std::cmp::Ordering {
    // Equal weights are astronomically unlikely; the id breaks ties deterministically.
    weight(a, digest).cmp(&weight(b, digest)).then(a.cmp(b))
}

fn weight(id: &str, digest: &Digest) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(id.as_bytes());
    h.update([0]);
    h.update(digest.to_string().as_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> Vec<Peer> {
        (0..n)
            .map(|i| Peer {
                id: format!("peer-{i}"),
                addr: format!("10.0.0.{}:5481", i + 1).parse().unwrap(),
            })
            .collect()
    }

    #[test]
    fn every_node_picks_the_same_coordinator_whatever_the_order() {
        let members = peers(8);
        let mut reversed = members.clone();
        reversed.reverse();
        for i in 0..50 {
            let d = Digest::sha256_of(format!("blob {i}").as_bytes());
            assert_eq!(coordinator(&d, &members), coordinator(&d, &reversed));
        }
        assert_eq!(coordinator(&Digest::sha256_of(b"x"), &[]), None);
    }

    #[test]
    fn the_coordinator_is_ahead_of_every_other_member() {
        let members = peers(5);
        for i in 0..20 {
            let d = Digest::sha256_of(format!("blob {i}").as_bytes());
            let first = coordinator(&d, &members).unwrap();
            for p in members.iter().filter(|p| p.id != first.id) {
                assert!(ahead(&first.id, &p.id, &d) && !ahead(&p.id, &first.id, &d));
            }
            assert!(!ahead(&first.id, &first.id, &d));
        }
    }

    #[test]
    fn digests_spread_over_the_nodes_and_a_leaving_node_moves_only_its_own() {
        let members = peers(8);
        let digests: Vec<Digest> = (0..800)
            .map(|i| Digest::sha256_of(format!("blob {i}").as_bytes()))
            .collect();
        let mut per_node = std::collections::HashMap::new();
        for d in &digests {
            *per_node
                .entry(coordinator(d, &members).unwrap().id.clone())
                .or_insert(0) += 1;
        }
        assert_eq!(per_node.len(), 8);
        assert!(
            per_node.values().all(|n| (50..150).contains(n)),
            "{per_node:?}"
        );
        let without: Vec<Peer> = members[1..].to_vec();
        for d in &digests {
            let before = coordinator(d, &members).unwrap();
            if before.id != members[0].id {
                assert_eq!(coordinator(d, &without).unwrap().id, before.id);
            }
        }
    }
}
