//! The libp2p [`ContentRouting`]: one task owns the `Swarm` (see `event_loop.rs`); [`P2pRouter`] is
//! the cloneable handle the rest of Ferry holds, sending commands over a channel.

mod anchor_handler;
mod anchors;
mod announce_plan;
mod announcer;
mod behaviour;
mod closest;
#[cfg(feature = "test-support")]
mod delay;
mod dials;
mod event_loop;
mod growth;
pub(crate) mod identity;
mod key_check;
mod peer_addrs;
mod rest;
mod store;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use futures::future::Either;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::upgrade::Version;
use libp2p::core::{ConnectedPoint, Endpoint};
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::{PeerId, SwarmBuilder, Transport, noise, tcp, yamux};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use anchors::ANCHORS;
pub use behaviour::{ProvideTiming, REPLICAS, agent_version, peer_addr_of};
pub use dials::DEFAULT_BOOTSTRAP_DIALS;

use super::bootstrap::{Bootstrap, tcp_multiaddr};
use super::{ContentRouting, Peer, PeerStream, RoutingError};
use crate::metrics::Metrics;
use crate::ops::problems::Problems;

/// Commands queue up to this many; a full queue makes callers wait (backpressure), it never
/// drops a command.
const COMMAND_QUEUE: usize = 1024;
/// Providers buffered per lookup; a caller needs the first few.
const LOOKUP_BUFFER: usize = 32;
/// Connections without a stream are closed after this long, except the few anchors each node
/// holds (`anchors.rs`). Long enough to carry a lookup's walk and the pull behind it on the
/// connections it opened; short enough that the connections of an announcement round (one to
/// nearly every node) are gone well before the next one: 10 minutes kept every node connected
/// to every node (299 of 300 in the simulation). A walk that meets a node not connected pays a
/// handshake (a few round trips; the HTTP addresses of nodes once seen are kept).
pub const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);
/// How long picking a key's coordinator may wait for a walk of the DHT (milliseconds in a
/// cluster; usually the miss's own provider walk, already under way). It is on the path of a
/// pull, before the claim (`coalesce::CLAIM_TIMEOUT`): a walk slower than this falls back to
/// the closest of the nodes known (routing table and connections; its HTTP address, if
/// identify has not given it yet, waited for as long again), which in a large network may not
/// be the walk's pick and at worst costs a second upstream fetch. A node in the routing table
/// may be dead (the very node that slows the walk): its claim then runs out
/// (`coalesce::CLAIM_TIMEOUT`) and the pull goes upstream; no answer at all falls back to
/// rendezvous hashing (`coalesce`).
const COORDINATOR_WAIT: Duration = Duration::from_millis(500);

#[derive(Debug, Clone)]
pub struct P2pConfig {
    pub data_dir: PathBuf,
    /// Where the swarm listens (TCP).
    pub listen: SocketAddr,
    /// The address other nodes reach this node at; `None` announces no address (a node that
    /// only asks, never serves).
    pub advertise: Option<IpAddr>,
    /// This node's HTTP peer address, announced through identify.
    pub peer_http_addr: SocketAddr,
    pub timing: ProvideTiming,
    /// The private-network key (from the cluster secret): nodes without it cannot connect.
    pub psk: Option<[u8; 32]>,
    /// A one-way delay added to every received byte, for the scale simulation only (see
    /// `delay.rs`; without a private-network key).
    #[cfg(feature = "test-support")]
    pub simulated_latency: Option<Duration>,
    /// Bootstrap addresses dialled at once (`--bootstrap-dials`); Kademlia finds the rest.
    pub bootstrap_dials: usize,
    /// Connections other than anchors close after this long without a stream:
    /// [`IDLE_CONNECTION_TIMEOUT`] in Ferry; tests shorten it.
    pub idle_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum P2pError {
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error("cannot build the libp2p transport: {0}")]
    Transport(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot listen for peers on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: libp2p::TransportError<std::io::Error>,
    },
}

pub(crate) enum Command {
    Lookup {
        key: String,
        reply: mpsc::Sender<super::Peer>,
    },
    Advertise {
        keys: Vec<String>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    Withdraw {
        keys: Vec<String>,
    },
    /// Dial every one of these (tests, `P2pRouter::dial`).
    Dial {
        addrs: Vec<libp2p::Multiaddr>,
    },
    /// Dial a few of these (bootstrap sources; `dials.rs`).
    Bootstrap {
        addrs: Vec<libp2p::Multiaddr>,
    },
    /// The coordinator of `key` (`closest.rs`), sent once known; dropped if it cannot be.
    Coordinator {
        key: String,
        reply: mpsc::Sender<super::Peer>,
    },
    /// The closest to `key` of the nodes known now, without a walk (`Coordinator` was slow).
    NearestKnown {
        key: String,
        reply: mpsc::Sender<super::Peer>,
    },
}

/// Shared read-only view of the swarm's state, written only by the event loop.
#[derive(Debug, Default)]
pub(crate) struct Status {
    pub connected: AtomicUsize,
    /// Connected peers whose peer address is known (identify): the live member set.
    /// Kept up to date one peer at a time (an identify, a last connection closed): rebuilding
    /// the list on every connection event was a tenth of a 300-node simulation's CPU, each
    /// node connecting to hundreds of others over its first rounds. Read rarely (`ferry
    /// status`, the coordinator fallback), sorted then.
    pub members: std::sync::RwLock<std::collections::HashMap<PeerId, Peer>>,
    /// When each connected peer's first open connection was established, by peer ID (as an
    /// ID, not text: connections come and go far more often than anyone asks).
    pub connected_since: std::sync::RwLock<std::collections::HashMap<PeerId, SystemTime>>,
}

/// The handle. Cheap to clone; all clones talk to the same swarm task.
#[derive(Debug, Clone)]
pub struct P2pRouter {
    commands: mpsc::Sender<Command>,
    status: Arc<Status>,
    peer_id: PeerId,
    peer_http_addr: SocketAddr,
    alone: bool,
}

impl P2pRouter {
    /// Builds the swarm, starts listening and spawns the task that owns it. The task stops
    /// when `token` is cancelled.
    pub fn start(
        config: P2pConfig,
        bootstrap: Arc<dyn Bootstrap>,
        bootstrap_configured: bool,
        metrics: Arc<Metrics>,
        problems: Arc<Problems>,
        token: CancellationToken,
    ) -> Result<(P2pRouter, JoinHandle<()>), P2pError> {
        let key = identity::load_or_create(&config.data_dir)?;
        let peer_http_addr = config.peer_http_addr;
        let timing = config.timing;
        let idle = config.idle_timeout;
        let behaviour = move |key: &Keypair| behaviour::Behaviour::new(key, peer_http_addr, timing);
        let transport_err = |e: Box<dyn std::error::Error + Send + Sync>| P2pError::Transport(e);
        let mut swarm = SwarmBuilder::with_existing_identity(key)
            .with_tokio()
            .with_other_transport(|key| transport(key, &config))
            .map_err(|e| transport_err(e.into()))?
            .with_dns()
            .map_err(|e| transport_err(e.into()))?
            .with_behaviour(behaviour)
            .map_err(|e| transport_err(e.into()))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
            .build();
        let listen = tcp_multiaddr(config.listen.ip(), config.listen.port());
        swarm.listen_on(listen).map_err(|source| P2pError::Listen {
            addr: config.listen,
            source,
        })?;
        let own = config
            .advertise
            .map(|ip| tcp_multiaddr(ip, config.listen.port()));
        if let Some(addr) = &own {
            swarm.add_external_address(addr.clone());
        }
        let peer_id = *swarm.local_peer_id();
        let local = Peer {
            id: peer_id.to_base58(),
            addr: peer_http_addr,
        };
        tracing::info!(%peer_id, listen = %config.listen, peer_addr = %peer_http_addr, "peer-to-peer node started");
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let status = Arc::new(Status::default());
        let event_loop = event_loop::EventLoop::new(
            swarm,
            rx,
            tx.clone(),
            status.clone(),
            (
                bootstrap,
                dials::BootstrapDials::new(config.bootstrap_dials, own),
            ),
            (metrics, problems),
            (timing, local),
        );
        let task = tokio::spawn(event_loop.run(token));
        Ok((
            P2pRouter {
                commands: tx,
                status,
                peer_id,
                peer_http_addr,
                alone: !bootstrap_configured,
            },
            task,
        ))
    }

    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    pub fn connected_peers(&self) -> usize {
        self.status.connected.load(Ordering::Relaxed)
    }

    /// Dials these addresses (tests and late bootstrap).
    pub async fn dial(&self, addrs: Vec<libp2p::Multiaddr>) -> Result<(), RoutingError> {
        self.commands
            .send(Command::Dial { addrs })
            .await
            .map_err(|_| RoutingError::Stopped)
    }
}

/// TCP; with a cluster secret, the private-network handshake (a pre-shared key: a node
/// without it cannot even start noise, let alone reach Kademlia); listening, the check that
/// the dialler speaks libp2p in the clear or under the same key (`key_check.rs`); then noise
/// and yamux.
fn peer_transport(
    key: &Keypair,
    psk: Option<[u8; 32]>,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    let noise = noise::Config::new(key)?;
    Ok(
        tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
            .and_then(move |socket, endpoint| async move {
                let stream = match psk {
                    Some(psk) => Either::Left(
                        PnetConfig::new(PreSharedKey::new(psk))
                            .handshake(socket)
                            .await
                            .map_err(|e| {
                                std::io::Error::other(format!(
                                    "private-network handshake failed: {e}"
                                ))
                            })?,
                    ),
                    None => Either::Right(socket),
                };
                // The side that answers multistream-select reads the header: the listener,
                // or a dialler told to act as one (libp2p's `upgrade::apply` does the same).
                let answering = match endpoint {
                    ConnectedPoint::Listener { .. } => true,
                    ConnectedPoint::Dialer { role_override, .. } => {
                        role_override == Endpoint::Listener
                    }
                };
                if answering {
                    key_check::expect_same_key(stream).await
                } else {
                    Ok(key_check::Replay::unread(stream))
                }
            })
            .upgrade(Version::V1Lazy)
            .authenticate(noise)
            .multiplex(yamux::Config::default())
            .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
            .boxed(),
    )
}

type PeerTransport = Boxed<(PeerId, StreamMuxerBox)>;

/// The transport `config` asks for: the peer transport, or in the scale simulation the
/// delayed one.
fn transport(
    key: &Keypair,
    config: &P2pConfig,
) -> Result<PeerTransport, Box<dyn std::error::Error + Send + Sync>> {
    #[cfg(feature = "test-support")]
    if let (None, Some(latency)) = (config.psk, config.simulated_latency) {
        return delayed_transport(key, latency);
    }
    peer_transport(key, config.psk)
}

/// TCP whose received bytes are held for `latency` (the scale simulation), then noise and yamux.
#[cfg(feature = "test-support")]
fn delayed_transport(
    key: &Keypair,
    latency: Duration,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    let noise = noise::Config::new(key)?;
    Ok(
        tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
            .map(move |socket, _| delay::Delayed::new(socket, latency))
            .upgrade(Version::V1Lazy)
            .authenticate(noise)
            .multiplex(yamux::Config::default())
            .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
            .boxed(),
    )
}

impl P2pRouter {
    /// Sends the command `make` builds around a reply channel, and waits for the peer it
    /// answers with up to [`COORDINATOR_WAIT`]: `Err` when the wait ran out, `Ok(None)` when
    /// no answer can come (the event loop is gone, or dropped the reply).
    async fn ask_for_peer(
        &self,
        make: impl FnOnce(mpsc::Sender<Peer>) -> Command,
    ) -> Result<Option<Peer>, tokio::time::error::Elapsed> {
        let (reply, mut rx) = mpsc::channel(1);
        if self.commands.send(make(reply)).await.is_err() {
            return Ok(None);
        }
        tokio::time::timeout(COORDINATOR_WAIT, rx.recv()).await
    }
}

#[async_trait::async_trait]
impl ContentRouting for P2pRouter {
    fn ready(&self) -> bool {
        self.alone || self.connected_peers() > 0
    }

    fn local(&self) -> Peer {
        Peer {
            id: self.peer_id.to_base58(),
            addr: self.peer_http_addr,
        }
    }

    fn members(&self) -> Arc<Vec<Peer>> {
        let mut members: Vec<Peer> = self
            .status
            .members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        Arc::new(members)
    }

    fn connected_since(&self, id: &str) -> Option<SystemTime> {
        let id = id.parse::<PeerId>().ok()?;
        self.status
            .connected_since
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }

    async fn lookup(&self, key: &str) -> PeerStream {
        let (reply, rx) = mpsc::channel(LOOKUP_BUFFER);
        // If the task is gone the sender is dropped with the command: the stream just ends.
        let _ = self
            .commands
            .send(Command::Lookup {
                key: key.to_string(),
                reply,
            })
            .await;
        rx
    }

    async fn coordinator(&self, key: &str) -> Option<Peer> {
        let key = key.to_string();
        let walked = self.ask_for_peer(|reply| Command::Coordinator {
            key: key.clone(),
            reply,
        });
        if let Ok(found) = walked.await {
            return found;
        }
        // The walk is slow (a busy node): pick by the same rule among the nodes known now,
        // which is the walk's own answer wherever this node knows the key's closest nodes
        // (every node, in a cluster small enough that each knows all). Rendezvous hashing
        // instead would name another node than the other nodes' walks did: two leaders.
        tracing::info!(
            key,
            waited_ms = COORDINATOR_WAIT.as_millis() as u64,
            "the DHT walk for a coordinator is slow; picking the closest node known"
        );
        self.ask_for_peer(|reply| Command::NearestKnown { key, reply })
            .await
            .ok()
            .flatten()
    }

    async fn advertise(&self, keys: Vec<String>) -> Result<(), RoutingError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::Advertise { keys, reply })
            .await
            .map_err(|_| RoutingError::Stopped)?;
        rx.await
            .map_err(|_| RoutingError::Stopped)?
            .map_err(RoutingError::Advertise)
    }

    async fn withdraw(&self, keys: Vec<String>) -> Result<(), RoutingError> {
        self.commands
            .send(Command::Withdraw { keys })
            .await
            .map_err(|_| RoutingError::Stopped)
    }
}
