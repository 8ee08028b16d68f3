//! A gRPC channel to containerd's socket that connects lazily and reconnects by itself, so
//! Ferry can start before containerd and survive containerd restarts without being restarted.

use std::path::PathBuf;
use std::time::Duration;

use containerd_client::tonic::transport::{Channel, Endpoint};
use hyper_util::rt::TokioIo;

/// A local socket answers in microseconds; a connect that takes longer means containerd is
/// wedged, and a request waiting on it would hold up containerd's own pull.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Upper bound for one unary call (info, image get). Streams (content reads) are not bounded
/// by it as a whole: tonic applies the timeout to the response headers.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds the channel without touching the socket. Every call (re)connects on demand.
pub(super) fn lazy_unix_channel(socket: PathBuf) -> Channel {
    lazy_channel(socket, Some(CALL_TIMEOUT))
}

/// The same, with no bound on a call's response headers: for the event subscription, whose
/// headers containerd 1.6 sends only with the first event, minutes or hours later. (Under
/// [`CALL_TIMEOUT`] every subscription failed after 2 s on an idle node, and each retry
/// walked the whole store: a full walk every 10 s instead of following events.)
pub(super) fn lazy_unix_channel_for_streams(socket: PathBuf) -> Channel {
    lazy_channel(socket, None)
}

fn lazy_channel(socket: PathBuf, timeout: Option<Duration>) -> Channel {
    // The URI is required by tonic but unused: the connector below dials the socket.
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
