//! Binding a listener and serving a router on it with the bounds of `limits` and `server`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::limits::{LimitedListener, MAX_CONNECTIONS, MAX_IN_FLIGHT};
use super::server::{self, Bounds, HEAD_DEADLINE};

/// The kernel's queue of connections not yet accepted (capped by `net.core.somaxconn`). The
/// default of 128 overflows under a burst of connections at the connection limit, and an
/// overflowing queue drops the handshake's last packet: the client believes it is connected
/// while the server retries for seconds.
const LISTEN_BACKLOG: i32 = 4096;

/// Binds `addr`. The IPv6 wildcard `[::]` takes IPv4 connections too (whatever the host's
/// `net.ipv6.bindv6only`), so one value (the chart's) works on IPv4, IPv6 and dual-stack
/// nodes; on a host whose kernel has IPv6 turned off it falls back to `0.0.0.0`.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    match listen_on(addr) {
        Err(e) if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) => {
            let v4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port());
            let listener = listen_on(v4).map_err(|_| e)?;
            tracing::info!(%addr, %v4, "no IPv6 on this host: listening on IPv4 only");
            Ok(listener)
        }
        other => other,
    }
}

fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    // As std's and tokio's own `bind`: a restarted Ferry rebinds at once.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    TcpListener::from_std(socket.into())
}

/// Serves `router` on `listener`, with the connection, request and header bounds, until
/// `token` is cancelled; the task is tracked so shutdown can drain it.
pub(crate) fn spawn(
    tracker: &TaskTracker,
    token: &CancellationToken,
    name: &'static str,
    listener: TcpListener,
    router: axum::Router,
) {
    let listener = LimitedListener::new(listener, MAX_CONNECTIONS);
    let bounds = Bounds {
        head_deadline: HEAD_DEADLINE,
        in_flight: MAX_IN_FLIGHT,
    };
    tracing::debug!("{name} listener serving");
    tracker.spawn(server::serve(listener, router, bounds, token.clone()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_ipv6_wildcard_takes_ipv4_and_ipv6_connections() {
        let listener = bind("[::]:0".parse().unwrap()).unwrap();
        let port = listener.local_addr().unwrap().port();
        for client in ["127.0.0.1", "::1"] {
            let to = SocketAddr::new(client.parse().unwrap(), port);
            let (connected, accepted) =
                tokio::join!(tokio::net::TcpStream::connect(to), listener.accept());
            connected.unwrap_or_else(|e| panic!("{to}: {e}"));
            accepted.unwrap();
        }
    }
}
