//! A gRPC channel to containerd's socket that connects lazily and reconnects by itself, so
//! Ferry can start before containerd and outlive its restarts.

use std::path::PathBuf;
use std::time::Duration;

use containerd_client::tonic::transport::{Channel, Endpoint};
use hyper_util::rt::TokioIo;

/// A local socket answers in microseconds; a slower connect means containerd is wedged, and
/// waiting on it would hold up containerd's own pull.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Bound for one unary call. tonic applies it to the response headers, so streams are not
/// bounded as a whole.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds the channel without touching the socket; every call (re)connects on demand.
pub(super) fn lazy_unix_channel(socket: PathBuf) -> Channel {
    lazy_channel(socket, Some(CALL_TIMEOUT))
}

/// The same, unbounded: for the event subscription, whose headers containerd 1.6 sends only
/// with the first event, possibly hours later.
pub(super) fn lazy_unix_channel_for_streams(socket: PathBuf) -> Channel {
    lazy_channel(socket, None)
}

fn lazy_channel(socket: PathBuf, timeout: Option<Duration>) -> Channel {
    // tonic requires a URI; the connector below dials the socket instead.
    let mut endpoint = Endpoint::from_static("http://[::1]:50051").connect_timeout(CONNECT_TIMEOUT);
    if let Some(timeout) = timeout {
        endpoint = endpoint.timeout(timeout);
    }
    endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
        let socket = socket.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(socket).await?;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    }))
}
