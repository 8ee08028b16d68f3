//! Network plumbing, no policy: the accept loop, connection and request bounds, the sending
//! rate, the advertised address.

pub mod budget;
pub(crate) mod host_addr;
pub(crate) mod limits;
pub(crate) mod listen;
pub(crate) mod pace;
pub mod server;
