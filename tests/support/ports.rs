//! Free ports for test processes to listen on, each handed out once per test process.
//!
//! A port is found by binding port 0 and letting go of it; the process it is for binds it a
//! moment later. Meanwhile a test running in parallel may be given the same port: on this
//! kernel one bind(0) in 300 returns one of the last 50 ports let go. Two daemons then share
//! a port (the second fails to start, or, with SO_REUSEPORT, takes half its connections), or a
//! test polls another test's daemon (a CI failure: a node's metrics said 0 peers for 20 s).

use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Mutex, OnceLock};

pub fn free_addr() -> SocketAddr {
    static GIVEN: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let given = GIVEN.get_or_init(Default::default);
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let addr = l.local_addr().expect("local addr");
        if given
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.port())
        {
            return addr;
        }
    }
}
