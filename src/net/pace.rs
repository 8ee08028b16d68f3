//! A node's sending rate to other nodes (`--peer-upload-limit`), one schedule for every peer
//! response. Invariant: over any interval, at most the rate times the interval plus one burst
//! leaves.

use std::sync::Mutex;
use std::time::Duration;

use axum::body::Body;
use futures::StreamExt;
use tokio::time::Instant;

/// Sent ahead of the schedule at most: smooths the chunking.
const BURST: Duration = Duration::from_millis(50);

#[derive(Debug)]
pub(crate) struct Pace {
    bytes_per_second: u64,
    next: Mutex<Instant>,
}

impl Pace {
    /// `bytes_per_second` must not be 0.
    pub(crate) fn new(bytes_per_second: u64) -> Pace {
        Pace {
            bytes_per_second: bytes_per_second.max(1),
            next: Mutex::new(Instant::now()),
        }
    }

    /// Waits until `bytes` more may be sent. Callers are served in the order they reserve.
    pub(crate) async fn take(&self, bytes: usize) {
        let send_at = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second as f64);
            *next - BURST
        };
        tokio::time::sleep_until(send_at).await;
    }
}

pub(crate) fn paced(body: Body, pace: std::sync::Arc<Pace>) -> Body {
    let chunks = body.into_data_stream().then(move |chunk| {
        let pace = pace.clone();
        async move {
            if let Ok(bytes) = &chunk {
                pace.take(bytes.len()).await;
            }
            chunk
        }
    });
    Body::from_stream(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bodies_together_leave_at_the_rate() {
        let pace = std::sync::Arc::new(Pace::new(1 << 20));
        let start = Instant::now();
        let body = |n: usize| {
            let chunks = (0..n).map(|_| Ok::<_, std::io::Error>(vec![0u8; 256 << 10]));
            paced(
                Body::from_stream(futures::stream::iter(chunks)),
                pace.clone(),
            )
        };
        let (a, b) = tokio::join!(
            axum::body::to_bytes(body(8), usize::MAX),
            axum::body::to_bytes(body(8), usize::MAX)
        );
        assert_eq!(a.unwrap().len() + b.unwrap().len(), 4 << 20);
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(4) - BURST && took <= Duration::from_secs(4),
            "{took:?}"
        );
        // Idle time is not saved up: after a pause, the rate holds again.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let start = Instant::now();
        axum::body::to_bytes(body(8), usize::MAX).await.unwrap();
        assert!(start.elapsed() >= Duration::from_secs(2) - BURST);
    }
}
