//! The node-wide connection caps: incoming handshakes in progress and established connections,
//! from everyone together. It keeps one entry per open connection and nothing per peer:
//! libp2p's connection-limits keeps one for every peer ever connected
//! (docs/design/scale-sim.md).
//! Invariant: a connection is counted while it is pending or established, and no longer.

use std::collections::HashSet;
use std::convert::Infallible;
use std::task::{Context, Poll};

use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

use super::ConnectionCaps;

#[derive(Debug)]
pub(super) struct Behaviour {
    pending_incoming_max: usize,
    established_max: usize,
    pending_incoming: HashSet<ConnectionId>,
    established: HashSet<ConnectionId>,
}

/// The reason a connection was refused, in libp2p's log.
#[derive(Debug, thiserror::Error)]
#[error("{max} {what} connections already")]
struct Full {
    what: &'static str,
    max: usize,
}

impl Behaviour {
    pub(super) fn new(caps: &ConnectionCaps) -> Behaviour {
        Behaviour {
            pending_incoming_max: caps.pending_incoming,
            established_max: caps.established,
            pending_incoming: HashSet::new(),
            established: HashSet::new(),
        }
    }

    fn room_for_one_more(&self) -> Result<(), ConnectionDenied> {
        if self.established.len() >= self.established_max {
            return Err(ConnectionDenied::new(Full {
                what: "established",
                max: self.established_max,
            }));
        }
        Ok(())
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: ConnectionId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        if self.pending_incoming.len() >= self.pending_incoming_max {
            return Err(ConnectionDenied::new(Full {
                what: "pending incoming",
                max: self.pending_incoming_max,
            }));
        }
        self.pending_incoming.insert(id);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.pending_incoming.remove(&id);
        self.room_for_one_more()?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.room_for_one_more()?;
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                self.established.insert(e.connection_id);
            }
            FromSwarm::ConnectionClosed(closed) => {
                self.established.remove(&closed.connection_id);
            }
            FromSwarm::ListenFailure(failed) => {
                self.pending_incoming.remove(&failed.connection_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::core::ConnectedPoint;
    use libp2p::swarm::ListenError;
    use libp2p::swarm::behaviour::{ConnectionClosed, ConnectionEstablished, ListenFailure};

    fn caps(pending_incoming: usize, established: usize) -> Behaviour {
        Behaviour::new(&ConnectionCaps {
            pending_incoming,
            established,
            per_ip: 8,
        })
    }

    fn local() -> Multiaddr {
        "/ip4/10.0.0.1/tcp/5482".parse().unwrap()
    }

    fn remote() -> Multiaddr {
        "/ip4/10.0.0.2/tcp/40000".parse().unwrap()
    }

    fn listener() -> ConnectedPoint {
        ConnectedPoint::Listener {
            local_addr: local(),
            send_back_addr: remote(),
        }
    }

    /// An incoming connection from `peer`, as the swarm drives it; `false` if refused.
    fn accept(b: &mut Behaviour, id: ConnectionId, peer: PeerId) -> bool {
        if b.handle_pending_inbound_connection(id, &local(), &remote())
            .is_err()
        {
            return false;
        }
        if b.handle_established_inbound_connection(id, peer, &local(), &remote())
            .is_err()
        {
            let error = ListenError::Aborted;
            b.on_swarm_event(FromSwarm::ListenFailure(ListenFailure {
                local_addr: &local(),
                send_back_addr: &remote(),
                error: &error,
                connection_id: id,
                peer_id: Some(peer),
            }));
            return false;
        }
        b.on_swarm_event(FromSwarm::ConnectionEstablished(ConnectionEstablished {
            peer_id: peer,
            connection_id: id,
            endpoint: &listener(),
            failed_addresses: &[],
            other_established: 0,
        }));
        true
    }

    fn close(b: &mut Behaviour, id: ConnectionId, peer: PeerId) {
        b.on_swarm_event(FromSwarm::ConnectionClosed(ConnectionClosed {
            peer_id: peer,
            connection_id: id,
            endpoint: &listener(),
            cause: None,
            remaining_established: 0,
        }));
    }

    #[test]
    fn a_hundred_thousand_peers_come_and_go_and_nothing_stays() {
        let mut b = caps(128, 2);
        for i in 0..100_000 {
            let (id, peer) = (ConnectionId::new_unchecked(i), PeerId::random());
            assert!(accept(&mut b, id, peer), "room for connection {i}");
            close(&mut b, id, peer);
        }
        assert!(b.established.is_empty() && b.pending_incoming.is_empty());
        assert!(b.established.capacity() < 64, "no entry per peer ever seen");
    }

    #[test]
    fn the_established_cap_holds_both_ways_and_a_slot_comes_back() {
        let mut b = caps(128, 2);
        let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let ids: Vec<ConnectionId> = (0..3).map(ConnectionId::new_unchecked).collect();
        assert!(accept(&mut b, ids[0], peers[0]));
        assert!(accept(&mut b, ids[1], peers[1]));
        assert!(!accept(&mut b, ids[2], peers[2]), "a third is refused");
        assert!(b.pending_incoming.is_empty(), "its handshake slot is back");
        let out = ConnectionId::new_unchecked(9);
        let dialled = b.handle_established_outbound_connection(
            out,
            peers[2],
            &remote(),
            Endpoint::Dialer,
            PortUse::New,
        );
        assert!(dialled.is_err(), "so is one this node dialled");
        close(&mut b, ids[0], peers[0]);
        assert!(accept(&mut b, ids[2], peers[2]), "room once one closes");
    }

    #[test]
    fn handshakes_in_progress_are_capped_and_counted_until_they_end() {
        let mut b = caps(2, 100);
        let ids: Vec<ConnectionId> = (0..4).map(ConnectionId::new_unchecked).collect();
        for id in &ids[..2] {
            assert!(
                b.handle_pending_inbound_connection(*id, &local(), &remote())
                    .is_ok()
            );
        }
        assert!(
            b.handle_pending_inbound_connection(ids[2], &local(), &remote())
                .is_err(),
            "a third handshake is refused"
        );
        let error = ListenError::Aborted;
        b.on_swarm_event(FromSwarm::ListenFailure(ListenFailure {
            local_addr: &local(),
            send_back_addr: &remote(),
            error: &error,
            connection_id: ids[0],
            peer_id: None,
        }));
        assert!(
            accept(&mut b, ids[3], PeerId::random()),
            "a failed one's slot is back"
        );
        assert_eq!(
            b.pending_incoming.len(),
            1,
            "the one still in its handshake"
        );
    }
}
