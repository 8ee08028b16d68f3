//! The simulated network: every node's libp2p transport dials the others through one in-memory
//! switchboard keyed by `ip:port`, and each byte written arrives `latency` later on the paused
//! tokio clock. Addresses keep libp2p's TCP shape (`/ip4/A/tcp/P`) so that Ferry's listen,
//! advertise, bootstrap and per-address limits run unchanged.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use ferry::routing::p2p::CONNECT_DEADLINE;
use futures::future::BoxFuture;
use futures::{AsyncRead, AsyncWrite, FutureExt};
use libp2p::core::multiaddr::{Multiaddr, Protocol};
use libp2p::core::transport::timeout::TransportTimeout;
use libp2p::core::transport::{DialOpts, ListenerId, TransportError, TransportEvent};
use libp2p::core::upgrade::Version;
use libp2p::core::{Transport, muxing::StreamMuxerBox};
use libp2p::identity::Keypair;
use libp2p::{PeerId, yamux};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

use crate::handshake::Handshake;

/// One direction of a connection: what was written, each chunk with the time it arrives.
#[derive(Default)]
struct Pipe {
    queue: VecDeque<(Instant, Vec<u8>)>,
    /// How much of the front chunk was read: a large write read in small pieces is not moved
    /// down once a read (that made reading it quadratic).
    read: usize,
    closed: bool,
    reader: Option<Waker>,
}

/// One end of a connection.
pub struct SimStream {
    incoming: Arc<Mutex<Pipe>>,
    outgoing: Arc<Mutex<Pipe>>,
    wait: Option<Pin<Box<Sleep>>>,
    net: SimNet,
    /// This end's address and the other's, for a partition between them.
    local: IpAddr,
    remote: IpAddr,
}

fn lock(pipe: &Mutex<Pipe>) -> std::sync::MutexGuard<'_, Pipe> {
    pipe.lock().unwrap_or_else(|e| e.into_inner())
}

/// Connection ends alive now and at most so far: each end is one node's connection.
static ENDS: AtomicUsize = AtomicUsize::new(0);
static ENDS_PEAK: AtomicUsize = AtomicUsize::new(0);
static OPENED: AtomicUsize = AtomicUsize::new(0);

/// Connections opened so far.
pub fn opened() -> usize {
    OPENED.load(Ordering::Relaxed)
}

/// Connection ends alive now, and the most alive at once so far.
pub fn ends() -> (usize, usize) {
    (
        ENDS.load(Ordering::Relaxed),
        ENDS_PEAK.load(Ordering::Relaxed),
    )
}

/// Both ends of a new connection between `dialler` and `listener`.
fn connection(net: &SimNet, dialler: IpAddr, listener: IpAddr) -> (SimStream, SimStream) {
    OPENED.fetch_add(1, Ordering::Relaxed);
    let now = ENDS.fetch_add(2, Ordering::Relaxed) + 2;
    ENDS_PEAK.fetch_max(now, Ordering::Relaxed);
    let (a, b) = (Arc::default(), Arc::default());
    let end = |incoming: &Arc<Mutex<Pipe>>, outgoing: &Arc<Mutex<Pipe>>, local, remote| SimStream {
        incoming: incoming.clone(),
        outgoing: outgoing.clone(),
        wait: None,
        net: net.clone(),
        local,
        remote,
    };
    (
        end(&a, &b, dialler, listener),
        end(&b, &a, listener, dialler),
    )
}

impl AsyncRead for SimStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            if let Some(wait) = self.wait.as_mut() {
                match wait.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => self.wait = None,
                }
            }
            let mut pipe = lock(&self.incoming);
            let Some((at, _)) = pipe.queue.front() else {
                if pipe.closed {
                    return Poll::Ready(Ok(0));
                }
                pipe.reader = Some(cx.waker().clone());
                return Poll::Pending;
            };
            let at = *at;
            if at > Instant::now() {
                drop(pipe);
                self.wait = Some(Box::pin(tokio::time::sleep_until(at)));
                continue;
            }
            let read = pipe.read;
            let (_, chunk) = pipe.queue.front().expect("front");
            let rest = &chunk[read..];
            let n = rest.len().min(buf.len());
            buf[..n].copy_from_slice(&rest[..n]);
            if n == rest.len() {
                pipe.queue.pop_front();
                pipe.read = 0;
            } else {
                pipe.read += n;
            }
            return Poll::Ready(Ok(n));
        }
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // Across a partition TCP keeps resending: the bytes arrive once it heals. A lost
        // segment arrives one retransmission timeout later, and what follows waits behind it.
        if buf.is_empty() {
            // Queued, it would read as the end of the stream.
            return Poll::Ready(Ok(0));
        }
        let latency = self.net.latency;
        let mut at = Instant::now() + latency;
        if self.net.lost() {
            at += RTO;
        }
        if let Some(heals) = self.net.held_until(self.local, self.remote) {
            at = at.max(heals + latency);
        }
        let mut pipe = lock(&self.outgoing);
        if pipe.closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        pipe.queue.push_back((at, buf.to_vec()));
        if let Some(w) = pipe.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut pipe = lock(&self.outgoing);
        pipe.closed = true;
        if let Some(w) = pipe.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        ENDS.fetch_sub(1, Ordering::Relaxed);
        for pipe in [&self.outgoing, &self.incoming] {
            let mut pipe = lock(pipe);
            pipe.closed = true;
            if let Some(w) = pipe.reader.take() {
                w.wake();
            }
        }
    }
}

/// A dialled connection as its listener receives it: the stream and the dialler's address.
type Accepted = (SimStream, SocketAddr);

/// Linux's least retransmission timeout: on links of a millisecond or two, every resend waits
/// this long.
const RTO: Duration = Duration::from_millis(200);
/// Linux's first SYN retransmission: a connect whose SYN is lost waits this long.
const SYN_RTO: Duration = Duration::from_secs(1);

/// The switchboard every node's transport shares.
#[derive(Clone)]
pub struct SimNet {
    inner: Arc<Mutex<Inner>>,
    latency: Duration,
    /// The share of writes whose first segment is lost (and of dials whose SYN is), and the
    /// draws' seed and count.
    loss: f64,
    seed: u64,
    draws: Arc<std::sync::atomic::AtomicU64>,
}

struct Inner {
    listeners: HashMap<SocketAddr, mpsc::UnboundedSender<Accepted>>,
    next_port: u16,
    split: Option<Split>,
}

/// A partition: the addresses on one side, and when it heals.
struct Split {
    side: HashSet<IpAddr>,
    heals: Instant,
}

impl SimNet {
    pub fn new(latency: Duration, loss: f64, seed: u64) -> SimNet {
        SimNet {
            inner: Arc::new(Mutex::new(Inner {
                listeners: HashMap::new(),
                next_port: 30_000,
                split: None,
            })),
            latency,
            loss,
            seed,
            draws: Arc::default(),
        }
    }

    /// Whether this write loses a segment: a draw from the seed, in the order writes happen.
    fn lost(&self) -> bool {
        if self.loss <= 0.0 {
            return false;
        }
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let draw = crate::Rng(self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next();
        (draw as f64 / u64::MAX as f64) < self.loss
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn latency(&self) -> Duration {
        self.latency
    }

    /// Cuts `side` off from every other address until `heals`.
    pub fn split(&self, side: HashSet<IpAddr>, heals: Instant) {
        self.inner().split = Some(Split { side, heals });
    }

    /// When what `a` sends `b` can arrive: `None` when nothing is between them now.
    pub fn held_until(&self, a: IpAddr, b: IpAddr) -> Option<Instant> {
        let inner = self.inner();
        let split = inner.split.as_ref()?;
        let across = split.side.contains(&a) != split.side.contains(&b);
        (across && Instant::now() < split.heals).then_some(split.heals)
    }

    /// Node `ip`'s transport: Ferry's connect deadline, the sim's handshake in place of noise
    /// (`handshake.rs`) and yamux, as Ferry's.
    pub fn transport(
        &self,
        ip: IpAddr,
        key: &Keypair,
    ) -> libp2p::core::transport::Boxed<(PeerId, StreamMuxerBox)> {
        let sim = SimTransport {
            net: self.clone(),
            ip,
            listeners: Vec::new(),
            events: VecDeque::new(),
        };
        TransportTimeout::with_outgoing_timeout(sim, CONNECT_DEADLINE)
            .upgrade(Version::V1Lazy)
            .authenticate(Handshake {
                local: key.public().to_peer_id(),
            })
            .multiplex(yamux::Config::default())
            // Ferry's own deadline on the upgrades (`UPGRADE_DEADLINE`).
            .timeout(Duration::from_secs(10))
            .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
            .boxed()
    }
}

fn socket_addr(addr: &Multiaddr) -> Option<SocketAddr> {
    let mut parts = addr.iter();
    let ip: IpAddr = match parts.next()? {
        Protocol::Ip4(ip) => ip.into(),
        Protocol::Ip6(ip) => ip.into(),
        _ => return None,
    };
    match parts.next()? {
        Protocol::Tcp(port) => Some(SocketAddr::new(ip, port)),
        _ => None,
    }
}

fn multiaddr(addr: SocketAddr) -> Multiaddr {
    Multiaddr::from(addr.ip()).with(Protocol::Tcp(addr.port()))
}

struct SimTransport {
    net: SimNet,
    ip: IpAddr,
    listeners: Vec<(ListenerId, SocketAddr, mpsc::UnboundedReceiver<Accepted>)>,
    events: VecDeque<TransportEvent<<Self as Transport>::ListenerUpgrade, io::Error>>,
}

impl Transport for SimTransport {
    type Output = SimStream;
    type Error = io::Error;
    type ListenerUpgrade = futures::future::Ready<Result<SimStream, io::Error>>;
    type Dial = BoxFuture<'static, Result<SimStream, io::Error>>;

    fn listen_on(
        &mut self,
        id: ListenerId,
        addr: Multiaddr,
    ) -> Result<(), TransportError<io::Error>> {
        let Some(mut at) = socket_addr(&addr) else {
            return Err(TransportError::MultiaddrNotSupported(addr));
        };
        if at.ip().is_unspecified() {
            at.set_ip(self.ip);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.net.inner().listeners.insert(at, tx);
        self.listeners.push((id, at, rx));
        self.events.push_back(TransportEvent::NewAddress {
            listener_id: id,
            listen_addr: multiaddr(at),
        });
        Ok(())
    }

    fn remove_listener(&mut self, id: ListenerId) -> bool {
        let before = self.listeners.len();
        self.listeners.retain(|(l, _, _)| *l != id);
        before != self.listeners.len()
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        _opts: DialOpts,
    ) -> Result<Self::Dial, TransportError<io::Error>> {
        let Some(to) = socket_addr(&addr) else {
            return Err(TransportError::MultiaddrNotSupported(addr));
        };
        let (net, ip) = (self.net.clone(), self.ip);
        let latency = net.latency;
        let listener = {
            let mut inner = self.net.inner();
            inner.next_port = inner.next_port.checked_add(1).unwrap_or(30_000);
            let from = SocketAddr::new(self.ip, inner.next_port);
            inner.listeners.get(&to).cloned().map(|tx| (tx, from))
        };
        let syn_lost = self.net.lost();
        Ok(async move {
            // A SYN into a partition is resent until it heals (`CONNECT_DEADLINE` cuts it).
            if let Some(heals) = net.held_until(ip, to.ip()) {
                tokio::time::sleep_until(heals).await;
            }
            if syn_lost {
                tokio::time::sleep(SYN_RTO).await;
            }
            // The SYN and its answer.
            tokio::time::sleep(latency * 2).await;
            let (tx, from) = listener.ok_or(io::ErrorKind::ConnectionRefused)?;
            let (mine, theirs) = connection(&net, ip, to.ip());
            tx.send((theirs, from))
                .map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
            Ok(mine)
        }
        .boxed())
    }

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<TransportEvent<Self::ListenerUpgrade, io::Error>> {
        if let Some(event) = self.events.pop_front() {
            return Poll::Ready(event);
        }
        for (id, local, rx) in self.listeners.iter_mut() {
            if let Poll::Ready(Some((stream, from))) = rx.poll_recv(cx) {
                return Poll::Ready(TransportEvent::Incoming {
                    listener_id: *id,
                    upgrade: futures::future::ready(Ok(stream)),
                    local_addr: multiaddr(*local),
                    send_back_addr: multiaddr(from),
                });
            }
        }
        Poll::Pending
    }
}
