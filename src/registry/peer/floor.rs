//! A peer's body must keep a minimum pace, not only avoid silence: one byte every few seconds
//! never trips the idle timeout and would hold a pull (and a request slot) for hours.
//! Invariant: a body that delivers less than [`MIN_BYTES`] in a window of twice the idle
//! timeout is given up, and its peer charged.

use std::time::Duration;

use tokio::time::Instant;

/// 64 KiB in 10 s (at the default idle timeout): 6.4 KB/s, far below any working link.
pub(crate) const MIN_BYTES: u64 = 64 * 1024;

#[derive(Debug)]
pub(crate) struct Floor {
    window: Duration,
    since: Instant,
    bytes: u64,
}

impl Floor {
    pub(crate) fn new(idle: Duration) -> Floor {
        Floor {
            window: idle * 2,
            since: Instant::now(),
            bytes: 0,
        }
    }

    /// Counts `n` more bytes; `false` when a window closed with fewer than [`MIN_BYTES`].
    pub(crate) fn keeps_up(&mut self, n: usize) -> bool {
        self.bytes += n as u64;
        if self.since.elapsed() < self.window {
            return true;
        }
        let kept_up = self.bytes >= MIN_BYTES;
        self.since = Instant::now();
        self.bytes = 0;
        kept_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_drip_is_caught_at_the_end_of_a_window_and_a_stream_is_not() {
        let mut drip = Floor::new(Duration::from_secs(5));
        for _ in 0..9 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(drip.keeps_up(1));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!drip.keeps_up(1), "10 bytes in 10 s");
        let mut stream = Floor::new(Duration::from_secs(5));
        for _ in 0..30 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(stream.keeps_up(16 * 1024));
        }
    }
}
