//! The swarm's behaviour: Kademlia, identify (carrying the HTTP peer address), batched
//! provider records, anchors. Invariant: every protocol name is Ferry's own.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{StreamProtocol, identify, kad, request_response};

use super::announce_plan::{ProvideAck, ProvideBatch};
use super::draws::Draws;
use super::store::ProviderStore;
use super::{ConnectionCaps, anchors, caps, per_ip};

pub(super) const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/ferry/kad/1.0.0");
/// Peers speaking another identify version are not added to the DHT.
pub(super) const IDENTIFY_PROTOCOL: &str = "/ferry/id/1.0.0";
pub(super) const PROVIDE_PROTOCOL: StreamProtocol = StreamProtocol::new("/ferry/provide/1.0.0");
/// 1,000 keys of at most 512 bytes, JSON-escaped.
const PROVIDE_REQUEST_MAX: u64 = 1_200_000;
/// An answer naming every key of a full batch as refused (1,000 positions of up to 4 bytes),
/// or a hop's 20 nodes with up to 8 addresses each.
const PROVIDE_ACK_MAX: u64 = 32 * 1024;
const AGENT_PREFIX: &str = "ferry/";
const PEER_ADDR_MARK: &str = " peer-addr=";

/// Bounds every query, so lookups and announcements finish even when a node stops answering
/// mid-query (a powered-off node leaves its connections open).
pub(super) const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Keys with records here, own and others' (a busy node provides 10,000).
const MAX_PROVIDED_KEYS: usize = 1_000_000;
/// Kademlia's alpha.
pub(super) const PARALLELISM: usize = 5;

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    // First, so that a refused connection reaches no other behaviour.
    pub caps: caps::Behaviour,
    pub per_ip: per_ip::Behaviour,
    pub kad: kad::Behaviour<ProviderStore>,
    pub identify: identify::Behaviour,
    pub provide: request_response::json::Behaviour<ProvideBatch, ProvideAck>,
    pub anchors: anchors::Behaviour,
}

/// Provider records' lifetime, re-announcement interval and replication.
#[derive(Debug, Clone, Copy)]
pub struct ProvideTiming {
    pub ttl: Duration,
    pub interval: Duration,
    /// [`REPLICAS`] in Ferry; tests lower it.
    pub replicas: usize,
    /// Beyond this many nodes rounds are spaced out in proportion (`spacing.rs`);
    /// [`NODES_PER_INTERVAL`] in Ferry, 0: never.
    pub nodes_per_interval: usize,
}

/// Every node receives about one batch from each other node a round: 4,000 nodes a round
/// every 10 minutes is under 8 batches a node a second.
pub const NODES_PER_INTERVAL: usize = 4_000;

/// Kademlia's replication factor (k).
pub const REPLICAS: usize = 20;

impl Behaviour {
    pub(super) fn new(
        key: &Keypair,
        peer_http_addr: SocketAddr,
        timing: ProvideTiming,
        caps: ConnectionCaps,
        draws: Draws,
    ) -> Self {
        let peer_id = key.public().to_peer_id();
        let mut config = kad::Config::new(KAD_PROTOCOL);
        config
            .set_query_timeout(QUERY_TIMEOUT)
            .set_provider_record_ttl(Some(timing.ttl))
            // Ferry re-announces, spread over the interval; libp2p's sends every key at once.
            .set_provider_publication_interval(None)
            // Ferry stores no values in the DHT, only provider records.
            .set_record_ttl(None)
            .set_publication_interval(None)
            // Ferry refreshes the table itself, more cheaply (`event_loop/`).
            .set_periodic_bootstrap_interval(None);
        if let Some(n) = NonZeroUsize::new(timing.replicas) {
            config.set_replication_factor(n);
        }
        // A miss asks the 20 closest: five at a time is four round trips after the first
        // hop, the default three seven; ten doubles a round's requests.
        if let Some(n) = NonZeroUsize::new(PARALLELISM) {
            config.set_parallelism(n);
        }
        let store = ProviderStore::new(peer_id, MAX_PROVIDED_KEYS).with_slots(timing.replicas);
        let mut kad = kad::Behaviour::with_config(peer_id, store, config);
        // A private network may never confirm an external address: server from the start.
        kad.set_mode(Some(kad::Mode::Server));
        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL.to_string(), key.public())
                .with_agent_version(agent_version(peer_http_addr))
                // Share only the advertise address, never 0.0.0.0's expansion (loopback too).
                .with_hide_listen_addrs(true),
        );
        let provide = request_response::json::Behaviour::with_codec(
            request_response::json::codec::Codec::default()
                .set_request_size_maximum(PROVIDE_REQUEST_MAX)
                .set_response_size_maximum(PROVIDE_ACK_MAX),
            [(PROVIDE_PROTOCOL, request_response::ProtocolSupport::Full)],
            request_response::Config::default().with_request_timeout(QUERY_TIMEOUT),
        );
        Behaviour {
            caps: caps::Behaviour::new(&caps),
            per_ip: per_ip::Behaviour::new(caps.per_ip),
            kad,
            identify,
            provide,
            anchors: anchors::Behaviour::new(anchors::ANCHORS, anchors::MAX_INBOUND, draws),
        }
    }
}

pub fn agent_version(peer_http_addr: SocketAddr) -> String {
    format!(
        "{AGENT_PREFIX}{}{PEER_ADDR_MARK}{peer_http_addr}",
        env!("CARGO_PKG_VERSION")
    )
}

/// The HTTP peer address announced in an agent version, if it is a Ferry's.
pub fn peer_addr_of(agent_version: &str) -> Option<SocketAddr> {
    if !agent_version.starts_with(AGENT_PREFIX) {
        return None;
    }
    agent_version.split_once(PEER_ADDR_MARK)?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_version_round_trip() {
        let addr: SocketAddr = "10.1.2.3:5481".parse().unwrap();
        assert_eq!(peer_addr_of(&agent_version(addr)), Some(addr));
        assert_eq!(peer_addr_of("rust-libp2p/0.1 peer-addr=1.2.3.4:1"), None);
        assert_eq!(peer_addr_of("ferry/0.1 peer-addr=nonsense"), None);
    }
}
