//! Network plumbing, no policy: the accept loop with its deadlines, connection and request
//! bounds, the sending rate to other nodes, and the address other nodes reach this one at.

pub(crate) mod host_addr;
pub(crate) mod limits;
pub(crate) mod listen;
pub(crate) mod pace;
pub mod server;
