//! Network plumbing, no policy: the accept loop with its deadlines, connection and request
//! bounds, and the address other nodes reach this one at.

pub mod host_addr;
pub mod limits;
pub mod listen;
pub mod server;
