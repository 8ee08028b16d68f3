//! The clock routing and coordination read: the standard one (`web_time` is `std::time` on
//! every native target), named apart so the simulation (issue #32) can run the same code on
//! simulated time by patching `web-time`, which libp2p reads too.

pub use web_time::Instant;
