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
pub fn lazy_unix_channel(socket: PathBuf) -> Channel {
    // The URI is required by tonic but unused: the connector below dials the socket.
    let endpoint = Endpoint::from_static("http://[::1]:50051")
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT);
    endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
        let socket = socket.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(socket).await?;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    }))
}
