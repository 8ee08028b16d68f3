//! Zero-copy sending of stored blobs on the peer address: the asker offers an upgrade, this
//! node answers `101` with the headers it would have sent, then `sendfile(2)`s the bytes
//! (`docs/design/zero-copy.md`). Invariant: anything else is plain HTTP, so an older Ferry on
//! either side sees no difference.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::net::limits::{Hold, LimitedStream};

use crate::wire::{ZERO_COPY_LENGTH_HEADER, ZERO_COPY_PROTOCOL, ZERO_COPY_STATUS_HEADER};

/// Below this a copy costs less than the new connection an upgrade takes (it is not reused).
pub const MIN_BYTES: u64 = 1 << 20;
/// A reader that takes nothing this long is cut off (hyper's own path has no such bound).
pub const SEND_IDLE: Duration = Duration::from_secs(60);
const CALL_BYTES: usize = 4 << 20;

pub fn offered(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ZERO_COPY_PROTOCOL))
}

/// A request's connection, to be taken over, and what keeps the request counted meanwhile.
#[derive(Debug)]
pub struct Upgrade {
    pub on_upgrade: OnUpgrade,
    /// Held until the send ends: the send stays inside the listener's request slots.
    pub hold: Option<Hold>,
}

/// Asks a peer for the upgrade.
pub fn offer(headers: &mut HeaderMap) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(
        header::UPGRADE,
        HeaderValue::from_static(ZERO_COPY_PROTOCOL),
    );
}

#[derive(Debug)]
pub struct FileSend {
    pub file: File,
    pub offset: u64,
    pub len: u64,
    pub idle: Duration,
    /// Each counts every byte sent.
    pub counters: [Counter; 2],
}

/// The 101 carrying the answer `status` with `answer`'s headers.
pub fn switch(
    status: StatusCode,
    answer: axum::http::response::Builder,
    upgrade: Upgrade,
    send: FileSend,
) -> Result<Response, axum::http::Error> {
    let mut out = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, ZERO_COPY_PROTOCOL)
        .header(ZERO_COPY_STATUS_HEADER, status.as_u16())
        .header(ZERO_COPY_LENGTH_HEADER, send.len);
    if let Some(headers) = answer.headers_ref() {
        for (name, value) in headers {
            if name != header::CONTENT_LENGTH {
                out = out.header(name, value);
            }
        }
    }
    let Upgrade { on_upgrade, hold } = upgrade;
    tokio::spawn(async move {
        let _hold = hold;
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "the asker never took the upgraded connection");
                return;
            }
        };
        let parts = match upgraded.downcast::<TokioIo<LimitedStream>>() {
            Ok(parts) => parts,
            Err(_) => {
                tracing::warn!("upgraded connection of an unexpected type; blob not sent");
                return;
            }
        };
        let stream = parts.io.into_inner();
        if let Err(e) = send_file(stream.tcp(), &send).await {
            // The asker resumes elsewhere; nothing here to clean up.
            tracing::debug!(error = %e, "zero-copy send ended early");
        }
    });
    out.body(Body::empty())
}

/// `send.len` bytes of `send.file` from `send.offset`, each call within the idle timeout.
/// Sequential readahead keeps a page-cache miss (a disk wait on this thread) rare.
async fn send_file(socket: &TcpStream, send: &FileSend) -> io::Result<()> {
    let _ = rustix::fs::fadvise(
        send.file.as_fd(),
        send.offset,
        std::num::NonZeroU64::new(send.len),
        rustix::fs::Advice::Sequential,
    );
    let mut offset = send.offset;
    let end = send.offset + send.len;
    while offset < end {
        let count = (end - offset).min(CALL_BYTES as u64) as usize;
        let sent = tokio::time::timeout(send.idle, async {
            loop {
                socket.writable().await?;
                match socket.try_io(Interest::WRITABLE, || {
                    rustix::fs::sendfile(socket, &send.file, Some(&mut offset), count)
                        .map_err(io::Error::from)
                }) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    other => return other,
                }
            }
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the asker stopped reading"))??;
        if sent == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the file is shorter than its size",
            ));
        }
        for counter in &send.counters {
            counter.inc_by(sent as u64);
        }
    }
    Ok(())
}
