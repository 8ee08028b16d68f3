//! `web_time` with tokio's `Instant` (the runtime's clock, paused in the simulation);
//! everything else is `std::time`'s.

pub use std::time::{Duration, SystemTime, SystemTimeError, TryFromFloatSecsError, UNIX_EPOCH};
pub use tokio::time::Instant;
