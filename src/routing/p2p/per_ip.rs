//! At most a few incoming connections from one address, pending or established, so that one
//! outsider cannot fill the node's connection budget or handshake slots. Loopback is exempt:
//! nodes under test share it, and a process on the node has easier ways in.
//! Invariant: every connection counted is uncounted when it fails or closes.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::Endpoint;
use libp2p::core::multiaddr::Protocol;
use libp2p::core::transport::PortUse;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

#[derive(Debug)]
pub(super) struct Behaviour {
    max: usize,
    by_ip: HashMap<IpAddr, usize>,
    counted: HashMap<ConnectionId, IpAddr>,
}

/// The reason a connection was refused, in libp2p's log.
#[derive(Debug, thiserror::Error)]
#[error("{max} connections from {ip} already")]
struct TooMany {
    ip: IpAddr,
    max: usize,
}

impl Behaviour {
    pub(super) fn new(max: usize) -> Behaviour {
        Behaviour {
            max,
            by_ip: HashMap::new(),
            counted: HashMap::new(),
        }
    }

    fn release(&mut self, id: ConnectionId) {
        let Some(ip) = self.counted.remove(&id) else {
            return;
        };
        if let Some(n) = self.by_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.by_ip.remove(&ip);
            }
        }
    }
}

pub(super) fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: ConnectionId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        let Some(ip) = ip_of(remote).filter(|ip| !ip.to_canonical().is_loopback()) else {
            return Ok(());
        };
        let open = self.by_ip.entry(ip).or_default();
        if *open >= self.max {
            return Err(ConnectionDenied::new(TooMany { ip, max: self.max }));
        }
        *open += 1;
        self.counted.insert(id, ip);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
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
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionClosed(closed) => self.release(closed.connection_id),
            FromSwarm::ListenFailure(failed) => self.release(failed.connection_id),
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

    #[test]
    fn one_address_gets_at_most_max_and_its_slots_come_back() {
        let mut b = Behaviour::new(2);
        let local: Multiaddr = "/ip4/10.0.0.1/tcp/5482".parse().unwrap();
        let outsider: Multiaddr = "/ip4/10.0.0.9/tcp/40000".parse().unwrap();
        let member: Multiaddr = "/ip4/10.0.0.2/tcp/40000".parse().unwrap();
        let (a, c, d) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
            ConnectionId::new_unchecked(3),
        );
        assert!(
            b.handle_pending_inbound_connection(a, &local, &outsider)
                .is_ok()
        );
        assert!(
            b.handle_pending_inbound_connection(c, &local, &outsider)
                .is_ok()
        );
        assert!(
            b.handle_pending_inbound_connection(d, &local, &outsider)
                .is_err()
        );
        let other = ConnectionId::new_unchecked(4);
        assert!(
            b.handle_pending_inbound_connection(other, &local, &member)
                .is_ok(),
            "another address is not affected"
        );
        b.release(a);
        assert!(
            b.handle_pending_inbound_connection(d, &local, &outsider)
                .is_ok(),
            "a slot back once one ends"
        );
        let loopback: Multiaddr = "/ip4/127.0.0.1/tcp/40000".parse().unwrap();
        for i in 10..20 {
            let id = ConnectionId::new_unchecked(i);
            assert!(
                b.handle_pending_inbound_connection(id, &local, &loopback)
                    .is_ok()
            );
        }
        assert!(!b.counted.contains_key(&ConnectionId::new_unchecked(10)));
    }
}
