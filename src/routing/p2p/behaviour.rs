//! The swarm's behaviour: Kademlia (server mode, private protocol name), identify, which
//! carries each node's HTTP peer address in its agent version, batched provider records and
//! the anchors that keep a few connections open (`anchors.rs`).

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{StreamProtocol, identify, kad, request_response};

use super::anchors;
use super::announce_plan::{ProvideAck, ProvideBatch};
use super::store::ProviderStore;

/// Kademlia protocol name: private, so Ferry's DHT never mixes with IPFS or other networks.
pub(super) const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/ferry/kad/1.0.0");
/// Identify protocol version; peers speaking another are not added to the DHT.
pub(super) const IDENTIFY_PROTOCOL: &str = "/ferry/id/1.0.0";
/// Batched provider records (`announce_plan.rs`), next to Kademlia.
pub(super) const PROVIDE_PROTOCOL: StreamProtocol = StreamProtocol::new("/ferry/provide/1.0.0");
/// A batch is at most 1,000 keys of at most 512 bytes (JSON-escaped, so twice that at worst).
const PROVIDE_REQUEST_MAX: u64 = 1_200_000;
/// Prefix of the identify agent version, followed by the node's HTTP peer address.
const AGENT_PREFIX: &str = "ferry/";
const PEER_ADDR_MARK: &str = " peer-addr=";

/// A bound on every Kademlia query, so every lookup and announcement finishes. A cluster DHT
/// answers in milliseconds; this only matters when a node stops answering mid-query (one
/// powered off leaves its connections open: requests on them just wait). libp2p waits 10 s
/// for one node's answer, then walks on without it; a walk that met such a node still
/// converges, as its failure arrives with the bound (test
/// `a_node_that_stops_answering_does_not_stop_announcement_walks_converging`). A longer bound
/// (20 s) was tried: it did not make walks under the scale simulation's overload converge
/// (5 of 18 per node timed out either way) and made its rounds longer.
pub(super) const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Keys with provider records in this node's store, its own and other nodes': a node serves
/// every digest of every image it holds, and 10,000 is common on a busy node.
const MAX_PROVIDED_KEYS: usize = 1_000_000;
/// Kademlia's alpha (see `Behaviour::new`).
const PARALLELISM: usize = 5;

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    pub kad: kad::Behaviour<ProviderStore>,
    pub identify: identify::Behaviour,
    pub provide: request_response::json::Behaviour<ProvideBatch, ProvideAck>,
    pub anchors: anchors::Behaviour,
}

/// How provider records are kept: their lifetime and re-announcement (`--provide-ttl`,
/// `--reprovide-interval`), and on how many nodes each key's records are stored.
#[derive(Debug, Clone, Copy)]
pub struct ProvideTiming {
    pub ttl: Duration,
    pub interval: Duration,
    /// Nodes that store each key's records, and providers each of them keeps per key:
    /// [`REPLICAS`] in Ferry. Tests lower it to fill a key's slots with a dozen nodes.
    pub replicas: usize,
}

/// Kademlia's replication factor (k).
pub const REPLICAS: usize = 20;

impl Behaviour {
    pub(super) fn new(key: &Keypair, peer_http_addr: SocketAddr, timing: ProvideTiming) -> Self {
        let peer_id = key.public().to_peer_id();
        let mut config = kad::Config::new(KAD_PROTOCOL);
        config
            .set_query_timeout(QUERY_TIMEOUT)
            .set_provider_record_ttl(Some(timing.ttl))
            // Ferry re-announces its keys itself, through its announcement queue and spread
            // over the interval (`event_loop.rs`): libp2p's own republication starts every
            // key's announcement at once, outside any bound (10,000 queries in one burst).
            .set_provider_publication_interval(None)
            // Ferry stores no values in the DHT, only provider records.
            .set_record_ttl(None)
            .set_publication_interval(None)
            // Ferry refreshes the routing table itself, only with peers connected: libp2p's
            // bootstrap at the first connection, then a walk to its own ID every 5 minutes
            // (`event_loop.rs`). libp2p's own periodic bootstrap would walk to its own ID and
            // once per bucket every time, a handshake for each node met that is no longer
            // connected.
            .set_periodic_bootstrap_interval(None);
        if let Some(n) = NonZeroUsize::new(timing.replicas) {
            config.set_replication_factor(n);
        }
        // Nodes asked at once per walk. A lookup that finds nothing has asked the 20 closest
        // nodes: three at a time (Kademlia's default) is seven round trips after the first
        // hop, five is four. Ten was tried: it doubled the requests of an announcement round
        // (274 -> 564 per node and round, 100 nodes in the scale simulation) and the
        // not-found median did not move (34.6 -> 35.1 ms).
        if let Some(n) = NonZeroUsize::new(PARALLELISM) {
            config.set_parallelism(n);
        }
        let store = ProviderStore::new(peer_id, MAX_PROVIDED_KEYS).with_slots(timing.replicas);
        let mut kad = kad::Behaviour::with_config(peer_id, store, config);
        // On a private network there may never be a confirmed external address, and a client
        // stores no records: be a server from the start.
        kad.set_mode(Some(kad::Mode::Server));
        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL.to_string(), key.public())
                .with_agent_version(agent_version(peer_http_addr))
                // Only the explicit external (advertise) address is shared, never the
                // expansion of 0.0.0.0 into every local address, loopback included.
                .with_hide_listen_addrs(true),
        );
        let provide = request_response::json::Behaviour::with_codec(
            request_response::json::codec::Codec::default()
                .set_request_size_maximum(PROVIDE_REQUEST_MAX)
                .set_response_size_maximum(1024),
            [(PROVIDE_PROTOCOL, request_response::ProtocolSupport::Full)],
            request_response::Config::default().with_request_timeout(QUERY_TIMEOUT),
        );
        Behaviour {
            kad,
            identify,
            provide,
            anchors: anchors::Behaviour::new(anchors::ANCHORS, anchors::MAX_INBOUND),
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
