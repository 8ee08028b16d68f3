//! Anchor connections: the few a node keeps open while the rest idle out, so it is never
//! without peers between rounds. Invariant: at most [`ANCHORS`] held, [`MAX_INBOUND`] taken.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::routing::clock::Instant;

use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::swarm::{
    CloseConnection, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, NotifyHandler,
    THandler, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};

use super::anchor_handler::{Command, Event, Handler};
use super::draws::Draws;

/// Connections this node holds open: two would do for reachability; four survive two peers
/// restarting at once.
pub const ANCHORS: usize = 4;
/// Anchors kept for others: drawn at random, a node is asked by about [`ANCHORS`]; four times
/// that bounds an unlucky one.
pub(super) const MAX_INBOUND: usize = 4 * ANCHORS;
/// A peer that released an anchor is not asked again for this long.
const REFUSED_FOR: Duration = Duration::from_secs(600);

/// Which connections are held, and by whom: the decisions, apart from the sockets.
#[derive(Debug)]
pub(super) struct Plan {
    want: usize,
    max_inbound: usize,
    connections: HashMap<PeerId, Vec<ConnectionId>>,
    /// Anchors held (asked for or open).
    held: HashMap<PeerId, ConnectionId>,
    inbound: HashMap<PeerId, ConnectionId>,
    refused: HashMap<PeerId, Instant>,
    random: Draws,
    draws: u64,
}

impl Plan {
    pub(super) fn new(want: usize, max_inbound: usize, random: Draws) -> Self {
        Plan {
            want,
            max_inbound,
            connections: HashMap::new(),
            held: HashMap::new(),
            inbound: HashMap::new(),
            refused: HashMap::new(),
            random,
            draws: 0,
        }
    }

    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.held.len()
    }

    /// Anchors held, and held for others.
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.held.len(), self.inbound.len())
    }

    pub(super) fn connected(&mut self, peer: PeerId, connection: ConnectionId) {
        self.connections.entry(peer).or_default().push(connection);
    }

    pub(super) fn closed(&mut self, peer: PeerId, connection: ConnectionId) {
        if let Some(list) = self.connections.get_mut(&peer) {
            list.retain(|c| *c != connection);
            if list.is_empty() {
                self.connections.remove(&peer);
            }
        }
        if self.held.get(&peer) == Some(&connection) {
            self.held.remove(&peer);
        }
        if self.inbound.get(&peer) == Some(&connection) {
            self.inbound.remove(&peer);
        }
    }

    /// The next peer to hold, if fewer are held than wanted: a random connected peer,
    /// preferring one that holds nothing here (two anchors on one socket keep one peer).
    pub(super) fn next(&mut self, now: Instant) -> Option<(PeerId, ConnectionId)> {
        if self.held.len() >= self.want {
            return None;
        }
        self.refused.retain(|_, until| *until > now);
        self.draws += 1;
        let draw = self.draws;
        let pick = self
            .connections
            .iter()
            .filter(|(p, _)| !self.held.contains_key(p) && !self.refused.contains_key(p))
            .min_by_key(|(p, _)| {
                (
                    self.inbound.contains_key(p),
                    self.random.hash_one((draw, p.to_bytes())),
                )
            })
            .and_then(|(p, list)| Some((*p, *list.first()?)))?;
        self.held.insert(pick.0, pick.1);
        Some(pick)
    }

    /// The anchor on `peer` was released (or never taken) without the connection closing.
    pub(super) fn lost(&mut self, peer: PeerId, now: Instant) {
        self.held.remove(&peer);
        self.refused.insert(peer, now + REFUSED_FOR);
    }

    /// `peer` anchored on this node: false when the anchor is to be released (enough held).
    pub(super) fn anchored(&mut self, peer: PeerId, connection: ConnectionId) -> bool {
        if self.inbound.len() >= self.max_inbound && !self.inbound.contains_key(&peer) {
            return false;
        }
        self.inbound.insert(peer, connection);
        true
    }

    pub(super) fn unanchored(&mut self, peer: PeerId, connection: ConnectionId) {
        if self.inbound.get(&peer) == Some(&connection) {
            self.inbound.remove(&peer);
        }
    }
}

pub(super) struct Behaviour {
    plan: Plan,
    actions: VecDeque<ToSwarm<Infallible, Command>>,
    /// The swarm polls on every event, and asking the plan scans every connection.
    changed: bool,
    waker: Option<Waker>,
}

impl Behaviour {
    pub(super) fn new(want: usize, max_inbound: usize, random: Draws) -> Self {
        Behaviour {
            plan: Plan::new(want, max_inbound, random),
            actions: VecDeque::new(),
            changed: false,
            waker: None,
        }
    }

    pub(super) fn counts(&self) -> (usize, usize) {
        self.plan.counts()
    }

    fn wake(&mut self) {
        self.changed = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = Handler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(Handler::default())
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(Handler::default())
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                self.plan.connected(e.peer_id, e.connection_id);
                self.wake();
            }
            FromSwarm::ConnectionClosed(e) => {
                self.plan.closed(e.peer_id, e.connection_id);
                self.wake();
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {
            Event::Held => tracing::debug!(%peer, "anchor held"),
            Event::Lost => {
                tracing::debug!(%peer, "anchor released by its peer");
                self.plan.lost(peer, Instant::now());
            }
            Event::Dead => {
                tracing::debug!(%peer, "anchor peer stopped answering; connection closed");
                self.plan.lost(peer, Instant::now());
                self.actions.push_back(ToSwarm::CloseConnection {
                    peer_id: peer,
                    connection: CloseConnection::One(connection),
                });
            }
            Event::Anchored => {
                if !self.plan.anchored(peer, connection) {
                    self.actions.push_back(ToSwarm::NotifyHandler {
                        peer_id: peer,
                        handler: NotifyHandler::One(connection),
                        event: Command::Release,
                    });
                }
            }
            Event::Unanchored => self.plan.unanchored(peer, connection),
        }
        self.wake();
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<Infallible, Command>> {
        if let Some(action) = self.actions.pop_front() {
            return Poll::Ready(action);
        }
        if self.changed {
            match self.plan.next(Instant::now()) {
                Some((peer, connection)) => {
                    return Poll::Ready(ToSwarm::NotifyHandler {
                        peer_id: peer,
                        handler: NotifyHandler::One(connection),
                        event: Command::Hold,
                    });
                }
                None => self.changed = false,
            }
        }
        self.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> Vec<PeerId> {
        (0..n).map(|_| PeerId::random()).collect()
    }

    #[test]
    fn holds_only_as_many_as_it_wants_of_its_connected_peers() {
        let mut plan = Plan::new(4, 16, Draws::new(None));
        let now = Instant::now();
        assert_eq!(plan.next(now), None, "nobody connected, nobody to hold");
        let all = peers(10);
        for p in &all {
            plan.connected(*p, ConnectionId::new_unchecked(0));
        }
        let mut held = Vec::new();
        while let Some((p, _)) = plan.next(now) {
            held.push(p);
        }
        held.sort();
        held.dedup();
        assert_eq!(held.len(), 4);
        assert!(held.iter().all(|p| all.contains(p)));
        // One closes: another is drawn in its place, never one already held.
        plan.closed(held[0], ConnectionId::new_unchecked(0));
        let (next, _) = plan.next(now).unwrap();
        assert!(!held.contains(&next));
        assert_eq!(plan.held(), 4);
    }

    #[test]
    fn a_peer_that_released_its_anchor_is_not_asked_again_for_a_while() {
        let mut plan = Plan::new(1, 16, Draws::new(None));
        let now = Instant::now();
        let [a, b] = [PeerId::random(), PeerId::random()];
        plan.connected(a, ConnectionId::new_unchecked(1));
        let (first, _) = plan.next(now).unwrap();
        assert_eq!(first, a);
        plan.lost(a, now);
        assert_eq!(plan.next(now), None, "a refused, nobody else connected");
        plan.connected(b, ConnectionId::new_unchecked(2));
        assert_eq!(plan.next(now).map(|(p, _)| p), Some(b));
        plan.lost(b, now);
        assert!(
            plan.next(now + REFUSED_FOR + Duration::from_secs(1))
                .is_some(),
            "asked again once the refusal is old"
        );
    }

    #[test]
    fn prefers_peers_that_hold_nothing_here() {
        let mut plan = Plan::new(1, 16, Draws::new(None));
        let now = Instant::now();
        let [a, b] = [PeerId::random(), PeerId::random()];
        plan.connected(a, ConnectionId::new_unchecked(1));
        plan.connected(b, ConnectionId::new_unchecked(2));
        assert!(plan.anchored(a, ConnectionId::new_unchecked(1)));
        assert_eq!(plan.next(now).map(|(p, _)| p), Some(b));
    }

    #[test]
    fn takes_a_bounded_number_of_anchors_from_others() {
        let mut plan = Plan::new(4, 3, Draws::new(None));
        let all = peers(5);
        let taken: Vec<bool> = all
            .iter()
            .map(|p| plan.anchored(*p, ConnectionId::new_unchecked(0)))
            .collect();
        assert_eq!(taken, [true, true, true, false, false]);
        plan.unanchored(all[0], ConnectionId::new_unchecked(0));
        assert!(plan.anchored(all[4], ConnectionId::new_unchecked(0)));
    }
}
