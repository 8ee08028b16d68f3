//! One connection's side of the anchor protocol: the holder pings a byte every [`PING_EVERY`],
//! the other echoes. Invariant: the open stream keeps the connection on both sides; an
//! unanswered ping closes it.

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, FutureExt};
use libp2p::StreamProtocol;
use libp2p::core::upgrade::ReadyUpgrade;
use libp2p::swarm::handler::{ConnectionEvent, FullyNegotiatedInbound, FullyNegotiatedOutbound};
use libp2p::swarm::{ConnectionHandler, ConnectionHandlerEvent, SubstreamProtocol};

pub(super) const ANCHOR_PROTOCOL: StreamProtocol = StreamProtocol::new("/ferry/anchor/1.0.0");
/// Often enough that a dead peer is found before anyone relies on it again.
pub(super) const PING_EVERY: Duration = Duration::from_secs(15);
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// The echoing side lets go of an anchor whose holder has not pinged for this long.
const HOLDER_SILENT: Duration = Duration::from_secs(45);

#[derive(Debug)]
pub(super) enum Command {
    Hold,
    /// Let go of the peer's anchor here.
    Release,
}

#[derive(Debug)]
pub(super) enum Event {
    Held,
    /// The peer closed the anchor stream (or does not speak the protocol).
    Lost,
    /// Pings unanswered: close the connection.
    Dead,
    /// The peer holds this connection, or let go of it.
    Anchored,
    Unanchored,
}

#[derive(Debug, PartialEq)]
enum HoldEnd {
    Closed,
    Silent,
}

#[derive(Default)]
pub(super) struct Handler {
    requested: bool,
    holding: Option<BoxFuture<'static, HoldEnd>>,
    echoing: Option<BoxFuture<'static, ()>>,
    events: VecDeque<Event>,
}

async fn hold<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) -> HoldEnd {
    let mut byte = [0u8; 1];
    loop {
        tokio::time::sleep(PING_EVERY).await;
        if stream.write_all(&[1]).await.is_err() || stream.flush().await.is_err() {
            return HoldEnd::Closed;
        }
        match tokio::time::timeout(PING_TIMEOUT, stream.read_exact(&mut byte)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return HoldEnd::Closed,
            Err(_) => return HoldEnd::Silent,
        }
    }
}

async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    let mut byte = [0u8; 1];
    while let Ok(Ok(())) = tokio::time::timeout(HOLDER_SILENT, stream.read_exact(&mut byte)).await {
        if stream.write_all(&byte).await.is_err() || stream.flush().await.is_err() {
            return;
        }
    }
}

impl ConnectionHandler for Handler {
    type FromBehaviour = Command;
    type ToBehaviour = Event;
    type InboundProtocol = ReadyUpgrade<StreamProtocol>;
    type OutboundProtocol = ReadyUpgrade<StreamProtocol>;
    type InboundOpenInfo = ();
    type OutboundOpenInfo = ();

    fn listen_protocol(&self) -> SubstreamProtocol<Self::InboundProtocol> {
        SubstreamProtocol::new(ReadyUpgrade::new(ANCHOR_PROTOCOL), ())
    }

    fn on_behaviour_event(&mut self, command: Command) {
        match command {
            Command::Hold => {
                if self.holding.is_none() {
                    self.requested = true;
                }
            }
            Command::Release => {
                // Dropping the stream resets it: the holder's next ping fails.
                self.echoing = None;
            }
        }
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ConnectionHandlerEvent<Self::OutboundProtocol, (), Event>> {
        if let Some(event) = self.events.pop_front() {
            return Poll::Ready(ConnectionHandlerEvent::NotifyBehaviour(event));
        }
        if std::mem::take(&mut self.requested) {
            return Poll::Ready(ConnectionHandlerEvent::OutboundSubstreamRequest {
                protocol: SubstreamProtocol::new(ReadyUpgrade::new(ANCHOR_PROTOCOL), ()),
            });
        }
        if let Some(holding) = &mut self.holding
            && let Poll::Ready(end) = holding.poll_unpin(cx)
        {
            self.holding = None;
            let event = match end {
                HoldEnd::Closed => Event::Lost,
                HoldEnd::Silent => Event::Dead,
            };
            return Poll::Ready(ConnectionHandlerEvent::NotifyBehaviour(event));
        }
        if let Some(echoing) = &mut self.echoing
            && echoing.poll_unpin(cx).is_ready()
        {
            self.echoing = None;
            return Poll::Ready(ConnectionHandlerEvent::NotifyBehaviour(Event::Unanchored));
        }
        Poll::Pending
    }

    fn on_connection_event(
        &mut self,
        event: ConnectionEvent<Self::InboundProtocol, Self::OutboundProtocol>,
    ) {
        match event {
            ConnectionEvent::FullyNegotiatedOutbound(FullyNegotiatedOutbound {
                protocol: stream,
                ..
            }) => {
                self.holding = Some(hold(stream).boxed());
                self.events.push_back(Event::Held);
            }
            ConnectionEvent::FullyNegotiatedInbound(FullyNegotiatedInbound {
                protocol: stream,
                ..
            }) => {
                // A second anchor from the same peer on this connection replaces the first.
                self.echoing = Some(echo(stream).boxed());
                self.events.push_back(Event::Anchored);
            }
            ConnectionEvent::DialUpgradeError(_) => self.events.push_back(Event::Lost),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::compat::TokioAsyncReadCompatExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_anchor_answered_is_held_until_its_peer_lets_go() {
        let (a, b) = tokio::io::duplex(64);
        let echoing = tokio::spawn(echo(b.compat()));
        let holding = tokio::spawn(hold(a.compat()));
        tokio::time::sleep(PING_EVERY * 40).await;
        assert!(!holding.is_finished(), "held for ten minutes of pings");
        echoing.abort();
        assert_eq!(holding.await.unwrap(), HoldEnd::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_answering_is_found_within_a_ping_and_its_timeout() {
        // A node powered off: its socket stays open and never reads.
        let (a, _b) = tokio::io::duplex(64);
        let started = tokio::time::Instant::now();
        assert_eq!(hold(a.compat()).await, HoldEnd::Silent);
        assert_eq!(started.elapsed(), PING_EVERY + PING_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn an_anchor_whose_holder_went_quiet_is_let_go() {
        let (_a, b) = tokio::io::duplex(64);
        let started = tokio::time::Instant::now();
        echo(b.compat()).await;
        assert_eq!(started.elapsed(), HOLDER_SILENT);
    }
}
