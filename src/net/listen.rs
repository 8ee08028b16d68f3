//! Binding a listener and serving a router on it with the bounds of `limits` and `server`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use axum::http::StatusCode;

use super::budget;
use super::limits::LimitedListener;
use super::server::{self, Bounds, HEAD_DEADLINE, PROGRESS_DEADLINE, SLOT_WAIT};

/// The accept queue (capped by `net.core.somaxconn`): 128 overflows under a burst at the
/// connection limit, and an overflow leaves a client believing it is connected for seconds.
const LISTEN_BACKLOG: i32 = 4096;

/// Binds `addr`; `[::]` takes IPv4 too (whatever `net.ipv6.bindv6only` says) and falls back to
/// `0.0.0.0` on a host without IPv6, so one value works on every node.
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

/// Serves `router` on `listener` with the bounds until `token` is cancelled; tracked for drain.
pub(crate) fn spawn(
    tracker: &TaskTracker,
    token: &CancellationToken,
    name: &'static str,
    listener: TcpListener,
    router: axum::Router,
    (budget, busy): (budget::Listener, StatusCode),
) {
    let listener = LimitedListener::new(listener, budget.connections);
    let bounds = Bounds {
        head_deadline: HEAD_DEADLINE,
        in_flight: budget.in_flight,
        slot_wait: SLOT_WAIT,
        progress_deadline: PROGRESS_DEADLINE,
        busy,
    };
    tracing::debug!(?budget, "{name} listener serving");
    let serving = server::serve(listener, name, router, bounds, token.clone());
    tracker.spawn(serving);
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
