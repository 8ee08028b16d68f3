//! The libp2p [`ContentRouting`]: one task owns the `Swarm` (`event_loop/`); [`P2pRouter`] is
//! the cloneable handle the rest of Ferry holds. Invariant: nothing but the event loop touches
//! the swarm; a handle only sends commands.

mod anchor_handler;
mod anchors;
mod announce_plan;
mod announcer;
mod behaviour;
mod caps;
mod closest;
#[cfg(feature = "test-support")]
mod delay;
mod dials;
mod draws;
mod event_loop;
mod growth;
pub(crate) mod identity;
mod key_check;
mod peer_addrs;
mod per_ip;
mod rest;
mod spacing;
mod store;
mod sweep;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use futures::future::Either;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::transport::timeout::TransportTimeout;
use libp2p::core::upgrade::Version;
use libp2p::core::{ConnectedPoint, Endpoint};
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PnetOutput, PreSharedKey};
use libp2p::tcp::tokio::TcpStream;
use libp2p::{PeerId, SwarmBuilder, Transport, noise, tcp, yamux};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use anchors::ANCHORS;
pub use behaviour::{NODES_PER_INTERVAL, ProvideTiming, REPLICAS, agent_version, peer_addr_of};
pub use dials::DEFAULT_BOOTSTRAP_DIALS;

use super::bootstrap::{Bootstrap, tcp_multiaddr};
use super::{ContentRouting, Peer, PeerStream, RoutingError};
use crate::metrics::Metrics;
use crate::ops::problems::Problems;

/// A full command queue makes callers wait; it never drops a command.
const COMMAND_QUEUE: usize = 1024;
/// Providers buffered per lookup; a caller needs the first few.
const LOOKUP_BUFFER: usize = 32;
/// Connections without a stream close after this long, except anchors. Short: a round
/// reaches almost every node, and its connections kept a minute were N per node at once
/// (`docs/design/connections.md`); lookups reuse few of them anyway.
pub const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// How long picking a coordinator, on a pull's path, waits for a walk; then the closest node
/// that answered it (`CoordinatorNow`), at worst a second upstream fetch.
const COORDINATOR_WAIT: Duration = Duration::from_millis(500);

#[derive(Debug, Clone)]
pub struct P2pConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// `None` for a node that only asks.
    pub advertise: Option<IpAddr>,
    /// Announced through identify.
    pub peer_http_addr: SocketAddr,
    pub timing: ProvideTiming,
    /// From the cluster secret: nodes without it cannot connect.
    pub psk: Option<[u8; 32]>,
    /// Scale simulation only (`delay.rs`).
    #[cfg(feature = "test-support")]
    pub simulated_latency: Option<Duration>,
    /// The simulation in simulated time (issue #32): its in-memory network instead of TCP.
    #[cfg(feature = "test-support")]
    pub transport: Option<TransportFactory>,
    /// Bootstrap addresses dialled at once; Kademlia finds the rest.
    pub bootstrap_dials: usize,
    /// [`IDLE_CONNECTION_TIMEOUT`] in Ferry; tests set their own.
    pub idle_timeout: Duration,
    pub caps: ConnectionCaps,
    /// The seed of this node's random draws; `None` (Ferry): the process's own. The
    /// simulation sets it so that a seed replays a run.
    pub draws_seed: Option<u64>,
}

/// How many connections libp2p may hold: an outsider's connections never take what members
/// need (with a cluster secret, outsiders never get past the handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Incoming connections still in their handshake, from everyone together.
    pub pending_incoming: usize,
    /// Established connections, both directions.
    pub established: usize,
    /// Incoming connections from one address, pending or established (loopback exempt).
    pub per_ip: usize,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        ConnectionCaps {
            pending_incoming: 128,
            established: 2048,
            per_ip: PER_IP,
        }
    }
}

/// A member opens one connection to a node, two when both dial at once.
pub const PER_IP: usize = 8;
/// From accept to the private-network handshake and the key check done: both are a few bytes
/// each way, so a silent dialler is dropped long before libp2p's own upgrade bound.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// The whole upgrade (handshake, noise, yamux).
const UPGRADE_DEADLINE: Duration = Duration::from_secs(10);
/// A TCP connect inside a cluster is answered in one round trip; one unanswered this long went
/// into a partition or to a node that is gone, and a walk waiting on it holds one of its few
/// slots past the coordinator's 500 ms (docs/design/connections.md).
pub const CONNECT_DEADLINE: Duration = Duration::from_millis(250);

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
    /// Dial all (tests, `P2pRouter::dial`).
    Dial {
        addrs: Vec<libp2p::Multiaddr>,
    },
    /// Dial a few (bootstrap; `dials.rs`).
    Bootstrap {
        addrs: Vec<libp2p::Multiaddr>,
    },
    /// Sent once known (`closest.rs`); dropped if it cannot be.
    Coordinator {
        key: String,
        reply: mpsc::Sender<super::Peer>,
    },
    /// The closest node the walk reached so far (`Coordinator` was slow).
    CoordinatorNow {
        key: String,
        reply: mpsc::Sender<super::Peer>,
    },
}

/// Shared read-only view of the swarm's state, written only by the event loop.
#[derive(Debug, Default)]
pub(crate) struct Status {
    pub connected: AtomicUsize,
    /// Connected peers with a known peer address, updated one at a time (rebuilding it per
    /// connection event is costly); sorted when read.
    pub members: std::sync::RwLock<std::collections::HashMap<PeerId, Peer>>,
    /// When each peer's first open connection was established (by ID: changes outnumber reads).
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
    /// Builds the swarm, listens and spawns the task that owns it, until `token` is cancelled.
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
        let caps = config.caps;
        let draws =
            draws::Draws::new(config.draws_seed).derive(&key.public().to_peer_id().to_base58());
        let behaviour = move |key: &Keypair| {
            behaviour::Behaviour::new(key, peer_http_addr, timing, caps, draws.derive("anchors"))
        };
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
                dials::BootstrapDials::new(config.bootstrap_dials, own, draws.derive("dials")),
            ),
            (metrics, problems),
            (timing, local, draws.derive("announcer")),
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

    pub async fn dial(&self, addrs: Vec<libp2p::Multiaddr>) -> Result<(), RoutingError> {
        self.commands
            .send(Command::Dial { addrs })
            .await
            .map_err(|_| RoutingError::Stopped)
    }
}

/// TCP; with a cluster secret, the private-network handshake; on the answering side, the check
/// that the dialler holds the same key (`key_check.rs`); then noise and yamux.
fn peer_transport(
    key: &Keypair,
    psk: Option<[u8; 32]>,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    let noise = noise::Config::new(key)?;
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    Ok(
        TransportTimeout::with_outgoing_timeout(tcp, CONNECT_DEADLINE)
            .and_then(move |socket, endpoint| {
                let upgrade = checked(socket, endpoint, psk);
                async move {
                    tokio::time::timeout(HANDSHAKE_DEADLINE, upgrade)
                        .await
                        .map_err(|_| {
                            std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "no private-network handshake in time",
                            )
                        })?
                }
            })
            .upgrade(Version::V1Lazy)
            .authenticate(noise)
            .multiplex(yamux::Config::default())
            .timeout(UPGRADE_DEADLINE)
            .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
            .boxed(),
    )
}

/// The private-network handshake (with a key), then the check that the dialler speaks
/// libp2p under the same key (`key_check.rs`).
async fn checked(
    socket: TcpStream,
    endpoint: ConnectedPoint,
    psk: Option<[u8; 32]>,
) -> std::io::Result<key_check::Replay<Either<PnetOutput<TcpStream>, TcpStream>>> {
    let stream = match psk {
        Some(psk) => Either::Left(
            PnetConfig::new(PreSharedKey::new(psk))
                .handshake(socket)
                .await
                .map_err(|e| {
                    std::io::Error::other(format!("private-network handshake failed: {e}"))
                })?,
        ),
        None => Either::Right(socket),
    };
    // The side that answers multistream-select reads the header: the listener, or a dialler
    // told to act as one (libp2p's `upgrade::apply` does the same).
    let answering = match endpoint {
        ConnectedPoint::Listener { .. } => true,
        ConnectedPoint::Dialer { role_override, .. } => role_override == Endpoint::Listener,
    };
    if answering {
        key_check::expect_same_key(stream).await
    } else {
        Ok(key_check::Replay::unread(stream))
    }
}

pub type PeerTransport = Boxed<(PeerId, StreamMuxerBox)>;

/// Builds a node's transport from its key (the simulation's network).
#[cfg(feature = "test-support")]
#[derive(Clone)]
pub struct TransportFactory(
    #[allow(clippy::type_complexity)]
    pub  Arc<
        dyn Fn(&Keypair) -> Result<PeerTransport, Box<dyn std::error::Error + Send + Sync>>
            + Send
            + Sync,
    >,
);

#[cfg(feature = "test-support")]
impl std::fmt::Debug for TransportFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransportFactory")
    }
}

fn transport(
    key: &Keypair,
    config: &P2pConfig,
) -> Result<PeerTransport, Box<dyn std::error::Error + Send + Sync>> {
    #[cfg(feature = "test-support")]
    if let Some(factory) = &config.transport {
        return (factory.0)(key);
    }
    #[cfg(feature = "test-support")]
    if let (None, Some(latency)) = (config.psk, config.simulated_latency) {
        return delayed_transport(key, latency);
    }
    peer_transport(key, config.psk)
}

/// TCP whose received bytes are held for `latency`, then noise and yamux.
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
    /// Waits up to [`COORDINATOR_WAIT`] for the command's peer: `Err` when the wait ran out,
    /// `Ok(None)` when no answer can come.
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
        // If the task is gone the stream just ends.
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
        // The walk's own XOR rule over the nodes it reached; None (the caller's rendezvous
        // backup) when it reached too few to agree with other nodes' walks.
        tracing::info!(
            key,
            waited_ms = COORDINATOR_WAIT.as_millis() as u64,
            "the DHT walk for a coordinator is slow; picking the closest node it reached"
        );
        self.ask_for_peer(|reply| Command::CoordinatorNow { key, reply })
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
