//! Every request to another node's peer address (a first request, a resume, a claim): the
//! HTTP client, the hop header, the signed token, the timeouts.

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode, header};
use bytes::Bytes;
use futures::StreamExt;

use super::failure::PeerFailure;
use super::floor::Floor;
use super::response::PeerResponse;
use crate::coalesce::leases::Grant;
use crate::metrics::Metrics;
use crate::oci::{self, Digest};
use crate::registry::zero_copy;
use crate::routing::Peer;
use crate::trust::{ClusterSecret, token};
use crate::wire::{CLAIM_PATH, FOLLOW_HEADER, HOP_HEADER, TOKEN_HEADER};

/// Manifest media types we accept from peers, most specific first.
const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";
/// A claim's answer is a few dozen bytes of JSON.
const MAX_CLAIM_ANSWER: u64 = 4096;

#[derive(Debug, Clone)]
pub struct PeerClient {
    client: reqwest::Client,
    secret: Option<ClusterSecret>,
    pub first_byte: Duration,
    pub idle: Duration,
    zero_copy: bool,
    /// Sent with a follow request so the source can show its followers.
    me: String,
}

/// One request to a peer; with `follow`, the source may answer from a download in progress
/// and its wait adds to the first-byte bound.
#[derive(Debug, Clone, Copy)]
pub struct PeerCall<'a> {
    pub method: &'a Method,
    /// `/v2/...` without the query.
    pub path: &'a str,
    pub ns: Option<&'a str>,
    pub range: Option<&'a str>,
    pub follow: Option<Duration>,
}

impl PeerClient {
    pub fn new(
        connect: Duration,
        first_byte: Duration,
        idle: Duration,
        secret: Option<ClusterSecret>,
    ) -> Result<PeerClient, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(connect)
            .tcp_nodelay(true)
            // Peers are addressed by IP on the node network; never through a proxy.
            .no_proxy()
            .build()?;
        Ok(PeerClient {
            client,
            secret,
            first_byte,
            idle,
            zero_copy: true,
            me: "1".to_string(),
        })
    }

    pub fn offering_zero_copy(self, zero_copy: bool) -> Self {
        PeerClient { zero_copy, ..self }
    }

    /// The peer ID a follow request names its follower by.
    pub fn sent_by(self, me: String) -> Self {
        PeerClient { me, ..self }
    }

    /// Sends `call` to `peer` and waits for the response headers (any status).
    pub async fn send(
        &self,
        peer: &Peer,
        call: PeerCall<'_>,
        metrics: &Metrics,
    ) -> Result<PeerResponse, PeerFailure> {
        let target = path_and_query(call.path, call.ns);
        let mut request = self
            .client
            .request(call.method.clone(), format!("http://{}{target}", peer.addr))
            .header(HOP_HEADER, "1");
        if let Some(secret) = &self.secret {
            request = request.header(
                TOKEN_HEADER,
                token::sign(secret, call.method.as_str(), &target),
            );
        }
        if let Some(range) = call.range {
            request = request.header(header::RANGE, range);
        }
        if call.path.contains("/manifests/") {
            request = request.header(header::ACCEPT, MANIFEST_ACCEPT);
        }
        if self.zero_copy && call.method == Method::GET && call.path.contains("/blobs/") {
            let mut offer = axum::http::HeaderMap::new();
            zero_copy::offer(&mut offer);
            request = request.headers(offer);
        }
        // A leader answers once its download has started: its wait is part of ours.
        let first_byte = match call.follow {
            Some(wait) => {
                request = request.header(FOLLOW_HEADER, &self.me);
                wait + self.first_byte
            }
            None => self.first_byte,
        };
        let started = Instant::now();
        let answered = async {
            let response = request
                .send()
                .await
                .map_err(|e| PeerFailure::Connect(e.to_string()))?;
            PeerResponse::read(response).await
        };
        match tokio::time::timeout(first_byte, answered).await {
            Ok(Ok(r)) => {
                if call.follow.is_some() {
                    metrics.follow_wait.observe(started.elapsed().as_secs_f64());
                }
                Ok(r)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PeerFailure::FirstByte),
        }
    }

    /// Claims `digest` for `claimant`: `None` when not answered properly.
    pub async fn claim(
        &self,
        coordinator: &Peer,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
    ) -> Option<Grant> {
        let target = claim_target(digest, claimant, failed);
        let mut request = self
            .client
            .post(format!("http://{}{target}", coordinator.addr))
            .header(HOP_HEADER, "1");
        if let Some(secret) = &self.secret {
            request = request.header(TOKEN_HEADER, token::sign(secret, "POST", &target));
        }
        let response = match request.send().await {
            Ok(r) if r.status() == StatusCode::OK => r,
            Ok(r) => {
                tracing::debug!(coordinator = %coordinator.id, status = %r.status(), "claim refused");
                return None;
            }
            Err(e) => {
                tracing::debug!(coordinator = %coordinator.id, error = %e, "claim not answered");
                return None;
            }
        };
        let response = PeerResponse::read(response).await.ok()?;
        let body = read_capped(response, MAX_CLAIM_ANSWER, self.idle)
            .await
            .ok()?;
        let answer: ClaimAnswer = serde_json::from_slice(&body).ok()?;
        let peer = |p: ClaimPeer| Peer {
            id: p.id,
            addr: p.addr,
        };
        match (answer.lead, answer.leader) {
            (true, _) => Some(Grant::Lead),
            (false, Some(source)) => {
                let source = peer(source);
                // A coordinator of an earlier version names only the leader.
                let leader = answer.root.map_or_else(|| source.clone(), peer);
                Some(Grant::Follow { source, leader })
            }
            (false, None) => None,
        }
    }
}

/// A claim's answer, JSON on the peer address.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimAnswer {
    pub lead: bool,
    /// The peer to stream from (the leader or a relay; named before relays existed).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub leader: Option<ClaimPeer>,
    /// The leader itself.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub root: Option<ClaimPeer>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimPeer {
    pub id: String,
    pub addr: std::net::SocketAddr,
}

impl From<&Peer> for ClaimPeer {
    fn from(p: &Peer) -> ClaimPeer {
        ClaimPeer {
            id: p.id.clone(),
            addr: p.addr,
        }
    }
}

impl ClaimAnswer {
    pub fn from_grant(grant: &Grant) -> ClaimAnswer {
        match grant {
            Grant::Lead => ClaimAnswer {
                lead: true,
                leader: None,
                root: None,
            },
            Grant::Follow { source, leader } => ClaimAnswer {
                lead: false,
                leader: Some(ClaimPeer::from(source)),
                root: Some(ClaimPeer::from(leader)),
            },
        }
    }
}

/// `<CLAIM_PATH><digest>?peer=<id>&addr=<addr>[&failed=<id>]`, as sent and as signed.
pub(crate) fn claim_target(digest: &Digest, claimant: &Peer, failed: Option<&str>) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("peer", &claimant.id);
    query.append_pair("addr", &claimant.addr.to_string());
    if let Some(f) = failed {
        query.append_pair("failed", f);
    }
    format!("{CLAIM_PATH}{digest}?{}", query.finish())
}

/// `<path>?ns=<registry>`, as sent and as signed.
pub(crate) fn path_and_query(path: &str, ns: Option<&str>) -> String {
    match ns {
        Some(ns) => {
            let encoded: String = form_urlencoded::byte_serialize(ns.as_bytes()).collect();
            format!("{path}?{}={encoded}", oci::NS_PARAM)
        }
        None => path.to_string(),
    }
}

/// Reads a body of at most `limit` bytes, each chunk within `idle`.
pub(crate) async fn read_capped(
    response: PeerResponse,
    limit: u64,
    idle: Duration,
) -> Result<Bytes, PeerFailure> {
    if response.content_length().is_some_and(|l| l > limit) {
        return Err(PeerFailure::Body("larger than announced".into()));
    }
    let mut bytes = Vec::with_capacity(response.content_length().unwrap_or(0) as usize);
    let mut stream = response.bytes_stream();
    let mut floor = Floor::new(idle);
    while let Some(chunk) = tokio::time::timeout(idle, stream.next())
        .await
        .map_err(|_| PeerFailure::Body("stalled".into()))?
    {
        let chunk = chunk.map_err(|e| PeerFailure::Body(e.to_string()))?;
        if !floor.keeps_up(chunk.len()) {
            return Err(PeerFailure::Body("too slow".into()));
        }
        if (bytes.len() + chunk.len()) as u64 > limit {
            return Err(PeerFailure::Body("larger than announced".into()));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(bytes))
}
