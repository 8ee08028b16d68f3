//! `futures_timer::Delay` as a tokio `Sleep`: it fires on the runtime's clock (paused and
//! advanced by the simulation), not on a helper thread's real time.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// Far enough to never fire in a run.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

pub struct Delay(Pin<Box<tokio::time::Sleep>>);

impl Delay {
    pub fn new(dur: Duration) -> Delay {
        Delay(Box::pin(tokio::time::sleep(dur.min(FAR))))
    }

    pub fn reset(&mut self, dur: Duration) {
        let at = tokio::time::Instant::now() + dur.min(FAR);
        self.0.as_mut().reset(at);
    }
}

impl Future for Delay {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl std::fmt::Debug for Delay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delay").field("deadline", &self.0.deadline()).finish()
    }
}
