//! Zero-copy sending of stored blobs on the peer address: the asking Ferry offers an upgrade
//! (`Upgrade: ferry-blob/1`), this node answers `101` with the headers of the answer it would
//! have sent, then the bytes straight from the page cache with `sendfile(2)`.
//!
//! Invariant: anything else (a HEAD, a small blob, an asker that did not offer) is plain HTTP,
//! so an older Ferry on either side sees no difference.

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

use crate::net::limits::LimitedStream;

use crate::wire::{ZERO_COPY_LENGTH_HEADER, ZERO_COPY_PROTOCOL, ZERO_COPY_STATUS_HEADER};

/// Below this a copy through user space costs less than the new connection an upgrade takes
/// (an upgraded connection is not reused).
pub const MIN_BYTES: u64 = 1 << 20;
/// How long a reader may take nothing before its connection is closed (hyper's own path has
/// no such bound; a Ferry that gave up closes its end, which ends the send at once anyway).
pub const SEND_IDLE: Duration = Duration::from_secs(60);
/// Bytes per `sendfile` call at most; a non-blocking socket takes what its buffer has room for.
const CALL_BYTES: usize = 4 << 20;

/// Did the asker offer the upgrade?
pub fn offered(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ZERO_COPY_PROTOCOL))
}

/// Asks a peer for the upgrade (on a blob GET).
pub fn offer(headers: &mut HeaderMap) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(
        header::UPGRADE,
        HeaderValue::from_static(ZERO_COPY_PROTOCOL),
    );
}

/// What the sender needs: the open file, where to start and how much, and where to count it.
#[derive(Debug)]
pub struct FileSend {
    pub file: File,
    pub offset: u64,
    pub len: u64,
    pub idle: Duration,
    /// Each counts every byte sent: the served bytes of the peer address, and the zero-copy
    /// ones.
    pub counters: [Counter; 2],
}

/// Turns the answer of `status` (200 or 206) with the headers of `answer` into the 101 that
/// carries it, and sends the bytes once hyper hands over the connection.
pub fn switch(
    status: StatusCode,
    answer: axum::http::response::Builder,
    on_upgrade: OnUpgrade,
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
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "the asker never took the upgraded connection");
                return;
            }
        };
        let parts = match hyper_util::server::conn::auto::upgrade::downcast::<TokioIo<LimitedStream>>(
            upgraded,
        ) {
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

/// `send.len` bytes of `send.file` from `send.offset` onto `socket`, each call within the
/// idle timeout. A page-cache miss makes `sendfile` wait for the disk on this thread; the
/// kernel's readahead (asked for sequential access) keeps that rare for a whole blob.
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
