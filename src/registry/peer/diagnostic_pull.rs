//! The debug page's test pull: one digest through the peer path as a pull takes it, reported
//! step by step. Invariant: nothing reaches containerd and peer health is untouched, so a test
//! never changes what pulls do.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::{PeerCall, PeerFetcher};
use crate::oci::Digest;
use crate::routing::{Peer, digest_key};

/// Longer than a pull waits, so a slow DHT shows as slow rather than as empty.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_ATTEMPTS: usize = 3;
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);
/// Any valid name: a peer serves by digest.
const TEST_NAME: &str = "ferry-debug/test-pull";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestPull {
    pub digest: String,
    pub lookup_ms: f64,
    /// Peer ID and peer address.
    pub providers: Vec<(String, String)>,
    pub attempts: Vec<Attempt>,
    /// A provider served every byte and they matched.
    pub ok: bool,
    pub summary: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub peer: String,
    pub addr: String,
    /// `verified`, or what went wrong.
    pub outcome: String,
    pub bytes: u64,
    pub ms: f64,
}

impl PeerFetcher {
    /// Pulls `digest` from the providers the DHT names now (not the cache).
    pub async fn test_pull(&self, digest: &Digest) -> TestPull {
        let started = Instant::now();
        let providers = self.lookup_all(&digest_key(digest)).await;
        let lookup_ms = ms(started);
        let mut attempts = Vec::new();
        for peer in providers.iter().take(MAX_ATTEMPTS) {
            let attempt = self.try_peer(peer, digest).await;
            let ok = attempt.outcome == "verified";
            attempts.push(attempt);
            if ok {
                break;
            }
        }
        let ok = attempts.iter().any(|a| a.outcome == "verified");
        let summary = match (providers.len(), attempts.iter().find(|a| a.outcome == "verified")) {
            (0, _) => "no node advertises this digest (is it in a node's k8s.io namespace? is this node connected to peers?)".to_string(),
            (_, Some(a)) => format!(
                "{} bytes from {} at {} in {:.0} ms, matching the digest",
                a.bytes, a.peer, a.addr, a.ms
            ),
            (n, None) => format!("{n} node(s) advertise it, and none served it correctly: see each attempt"),
        };
        TestPull {
            digest: digest.to_string(),
            lookup_ms,
            providers: providers
                .iter()
                .map(|p| (p.id.clone(), p.addr.to_string()))
                .collect(),
            attempts,
            ok,
            summary,
        }
    }

    async fn lookup_all(&self, key: &str) -> Vec<Peer> {
        let mut stream = self.router.lookup(key).await;
        let mut found = Vec::new();
        let deadline = tokio::time::sleep(LOOKUP_TIMEOUT);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                peer = stream.recv() => match peer {
                    Some(p) if !found.contains(&p) => found.push(p),
                    Some(_) => {}
                    None => break,
                },
                _ = &mut deadline => break,
            }
        }
        found
    }

    async fn try_peer(&self, peer: &Peer, digest: &Digest) -> Attempt {
        let started = Instant::now();
        let path = format!("/v2/{TEST_NAME}/blobs/{digest}");
        let call = PeerCall {
            method: &Method::GET,
            path: &path,
            ns: None,
            range: None,
            follow: None,
        };
        let mut bytes = 0u64;
        let outcome = match self.client.send(peer, call, &self.metrics).await {
            Err(failure) => failure.to_string(),
            Ok(r) if r.status() != StatusCode::OK => format!("answered {}", r.status()),
            Ok(r) => {
                let mut hasher = digest.hasher();
                let mut body = r.bytes_stream();
                let read = async {
                    while let Some(chunk) = body.next().await {
                        let chunk = chunk.map_err(|e| e.to_string())?;
                        bytes += chunk.len() as u64;
                        hasher.update(&chunk);
                    }
                    Ok::<(), String>(())
                };
                match tokio::time::timeout(TRANSFER_TIMEOUT, read).await {
                    Err(_) => format!("not done after {} s", TRANSFER_TIMEOUT.as_secs()),
                    Ok(Err(e)) => format!("the body failed: {e}"),
                    Ok(Ok(())) if hasher.matches(digest) => "verified".to_string(),
                    Ok(Ok(())) => "the bytes do not match the digest".to_string(),
                }
            }
        };
        Attempt {
            peer: peer.id.clone(),
            addr: peer.addr.to_string(),
            outcome,
            bytes,
            ms: ms(started),
        }
    }
}

fn ms(since: Instant) -> f64 {
    (since.elapsed().as_secs_f64() * 1000.0 * 10.0).round() / 10.0
}
