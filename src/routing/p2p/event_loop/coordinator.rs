//! The event loop's part in naming a digest's coordinator: a walk to the key, or the nearest
//! node the routing table knows when the walk is too slow.

use super::*;

impl EventLoop {
    /// The coordinator of `key`, to `reply`: from a walk that ended lately, else when the
    /// walk for the key now running ends (usually the miss's own provider walk: a lookup
    /// gives up waiting after its wait, `registry::peer::bound`, and its walk goes on), else
    /// from a walk for the key's closest nodes started now.
    pub(super) fn coordinator(&mut self, key: String, reply: mpsc::Sender<Peer>) {
        if let Some(found) = self.closest.coordinator(&key, Instant::now()) {
            self.send_coordinator(found, reply);
            return;
        }
        let walking = self.closest.is_walking(&key);
        self.coordinator_waiting
            .entry(key.clone())
            .or_default()
            .push(reply);
        if !walking {
            self.walk_for_coordinator(key);
        }
    }

    /// The coordinator of `key` among the nodes in the routing table or connected now, for a
    /// pull that could not wait for the walk: the XOR-closest, as a walk picks, so a node
    /// whose walk was slow names the node the others' walks named whenever it knows it.
    pub(super) fn nearest_known(&mut self, key: String, reply: mpsc::Sender<Peer>) {
        // The walk may have ended since the caller gave up on it.
        if let Some(found) = self.closest.coordinator(&key, Instant::now()) {
            self.send_coordinator(found, reply);
            return;
        }
        let mut known: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        for bucket in self.swarm.behaviour_mut().kad.kbuckets() {
            known.extend(bucket.iter().map(|e| *e.node.key.preimage()));
        }
        let found = self.closest.closest_of(&key, &known);
        self.send_coordinator(found, reply);
    }

    fn walk_for_coordinator(&mut self, key: String) {
        let id = self
            .swarm
            .behaviour_mut()
            .kad
            .get_closest_peers(key.as_bytes().to_vec());
        self.closest.walking(id, key);
        self.coordinator_walks.insert(id);
    }

    /// A walk for `key` ended, with the closest nodes that answered it if it ran to its end:
    /// the coordinator to whoever waits for one, or, from a walk that proves nothing (it
    /// found providers, or failed), a walk of their own.
    pub(super) fn walk_ended(&mut self, key: String, closest: Option<&[PeerId]>) {
        if !self.coordinator_waiting.contains_key(&key) {
            return;
        }
        match closest {
            Some(peers) => {
                let coordinator = self.closest.closest_of(&key, peers);
                for reply in self.coordinator_waiting.remove(&key).unwrap_or_default() {
                    self.send_coordinator(coordinator, reply);
                }
            }
            None if !self.closest.is_walking(&key) => self.walk_for_coordinator(key),
            None => {}
        }
    }

    fn send_coordinator(&mut self, found: Coordinator, reply: mpsc::Sender<Peer>) {
        match found {
            Coordinator::Me => {
                let _ = reply.try_send(self.local.clone());
            }
            Coordinator::Other(peer) => self.send_peer(peer, reply),
        }
    }

    /// Sends `peer` with its HTTP address, at once if identify gave it already, else when it
    /// does (dialling the peer if need be); a peer that cannot be reached drops `reply`.
    pub(super) fn send_peer(&mut self, peer: PeerId, reply: mpsc::Sender<Peer>) {
        match self.http_addrs.get(&peer) {
            Some(p) => {
                let _ = reply.try_send(p.clone());
            }
            None => {
                self.awaiting_identify.entry(peer).or_default().push(reply);
                if self.swarm.is_connected(&peer) {
                    return;
                }
                // Connections idle out (`anchors.rs`): a provider may be a node this one has
                // never been connected to, known only from its record here, which carries
                // its addresses (Kademlia adds those it knows, and those a walk just found).
                let addrs = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .store_mut()
                    .addresses_of(&peer)
                    .to_vec();
                let opts = DialOpts::peer_id(peer)
                    .addresses(addrs)
                    .extend_addresses_through_behaviour()
                    .build();
                match self.swarm.dial(opts) {
                    Ok(()) => {}
                    // Being dialled already (a walk's request): identify follows that one.
                    Err(DialError::DialPeerConditionFalse(_)) => {}
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "cannot dial peer");
                        self.awaiting_identify.remove(&peer);
                    }
                }
            }
        }
    }
}
