//! Naming a key's coordinator: a walk to the key or, when the walk is too slow, the closest of
//! the nodes that answered it so far. Invariant: every waiting reply is answered or dropped.

use super::*;

impl EventLoop {
    /// From a recent walk, else the running one (usually the miss's own), else a new walk.
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

    /// For a pull that could not wait: the walk ends now, and the closest node that answered
    /// it names the coordinator. In a partition those are this side's nodes; the closest
    /// known node may be across (a claim that waits out its deadline).
    pub(super) fn coordinator_now(&mut self, key: String, reply: mpsc::Sender<Peer>) {
        // The walk may have ended since the caller gave up on it.
        if let Some(found) = self.closest.coordinator(&key, Instant::now()) {
            self.send_coordinator(found, reply);
            return;
        }
        let cut = self.closest.cut(&key);
        let mut ending = false;
        for id in cut {
            if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                query.finish();
                ending = true;
            }
        }
        if ending || self.closest.is_walking(&key) {
            self.coordinator_waiting.entry(key).or_default().push(reply);
        } else {
            let found = self.nearest_known(&key);
            self.send_coordinator(found, reply);
        }
    }

    fn known_nodes(&mut self) -> usize {
        let kad = &mut self.swarm.behaviour_mut().kad;
        kad.kbuckets().map(|b| b.num_entries()).sum()
    }

    /// The XOR-closest known node, as a walk picks.
    fn nearest_known(&mut self, key: &str) -> Coordinator {
        let mut known: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        for bucket in self.swarm.behaviour_mut().kad.kbuckets() {
            known.extend(bucket.iter().map(|e| *e.node.key.preimage()));
        }
        self.closest.closest_of(key, &known)
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

    /// A walk ended, with its closest nodes if it ran to its end; otherwise whoever waits
    /// gets a walk of their own.
    pub(super) fn walk_ended(&mut self, key: String, closest: Option<&[PeerId]>, cut: bool) {
        if !self.coordinator_waiting.contains_key(&key) {
            return;
        }
        match closest {
            // Cut before it heard more than its first round, which did not ask every node
            // this one knows: its pick would be this node's alone. Dropping the replies sends
            // the caller to its rendezvous backup, which such nodes share.
            Some(peers)
                if cut && peers.len() <= PARALLELISM && self.known_nodes() > PARALLELISM =>
            {
                self.coordinator_waiting.remove(&key);
            }
            Some(peers) => {
                // No node answered: this one may be cut off, or only slow.
                let coordinator = if peers.is_empty() {
                    self.nearest_known(&key)
                } else {
                    self.closest.closest_of(&key, peers)
                };
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

    /// Sends `peer` once identify gives its HTTP address (dialling it if need be); a peer
    /// that cannot be reached drops `reply`.
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
                // A provider may be known only from its record here, with its addresses.
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
                    // Already being dialled: identify follows that dial.
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
