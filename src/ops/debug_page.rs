//! `/debug` (`--debug-page`): `ferry status` as a page, and a test pull through the peer path.
//! Invariant: rendered from `ops::status` on each request, for this host's clients only.

use std::fmt::Write;

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::oci::Digest;
use crate::ops::status::{Status, duration, human};
use crate::ops::{self, Sources};
use crate::registry::peer::diagnostic_pull::TestPull;

/// Only one test pull at a time: each may move a whole blob.
static TEST_PULL: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

pub(crate) async fn page(State(s): State<Sources>, request: axum::extract::Request) -> Response {
    if !ops::from_this_host(&request) {
        return ops::refused("/debug");
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    html(render(&ops::status(&s), now, s.fetcher.is_some()))
}

#[derive(Debug, Deserialize)]
pub(crate) struct TestPullQuery {
    digest: String,
    /// `json` for JSON; HTML otherwise.
    format: Option<String>,
}

/// `GET /debug/test-pull?digest=sha256:...`
pub(crate) async fn test_pull(
    State(s): State<Sources>,
    Query(q): Query<TestPullQuery>,
    request: axum::extract::Request,
) -> Response {
    if !ops::from_this_host(&request) {
        return ops::refused("/debug");
    }
    let digest: Digest = match q.digest.trim().parse() {
        Ok(d) => d,
        Err(e) => {
            let text = format!("not a digest: {e} (expected sha256:<64 hex digits>)\n");
            return (StatusCode::BAD_REQUEST, text).into_response();
        }
    };
    let Some(fetcher) = &s.fetcher else {
        let text = "peer-to-peer is off on this node: nothing to test\n";
        return (StatusCode::CONFLICT, text).into_response();
    };
    let Ok(_one) = TEST_PULL.try_acquire() else {
        let text = "a test pull is running; try again when it is done\n";
        return (StatusCode::TOO_MANY_REQUESTS, text).into_response();
    };
    let report = fetcher.test_pull(&digest).await;
    if q.format.as_deref() == Some("json") {
        return axum::Json(report).into_response();
    }
    html(render_test_pull(&report))
}

fn html(body: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // A page of this node's state: never kept by a browser or a proxy.
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// Text for HTML: everything shown passes through here.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const HEAD: &str = "<!doctype html><html><head><meta charset=\"utf-8\"><title>Ferry debug</title>\
<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:72em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;font-family:monospace}\
.bad{color:#b00;font-weight:bold}.ok{color:#070;font-weight:bold}</style></head><body>";

fn render(st: &Status, now: u64, peering: bool) -> String {
    let mut o = String::from(HEAD);
    let node = st
        .node
        .as_deref()
        .map_or(String::new(), |n| format!(" on {}", esc(n)));
    let ready = if st.ready {
        "<span class=\"ok\">ready</span>"
    } else {
        "<span class=\"bad\">NOT READY</span>"
    };
    let _ = write!(o, "<h1>Ferry {}{node}: {ready}</h1>", esc(&st.version));
    o.push_str("<h2>Readiness</h2><table>");
    for c in &st.conditions {
        let v = if c.ok {
            "<span class=\"ok\">yes</span>"
        } else {
            "<span class=\"bad\">no</span>"
        };
        let _ = write!(o, "<tr><td>{}</td><td>{v}</td></tr>", esc(&c.name));
    }
    o.push_str("</table><h2>Problems</h2>");
    if st.problems.is_empty() {
        o.push_str("<p>none</p>");
    } else {
        o.push_str("<table><tr><th>problem</th><th>what is wrong, and the fix</th></tr>");
        for p in &st.problems {
            let _ = write!(
                o,
                "<tr><td class=\"bad\">{}</td><td>{}</td></tr>",
                esc(&p.problem),
                esc(&p.detail)
            );
        }
        o.push_str("</table>");
    }
    o.push_str("<h2>Peers</h2>");
    match &st.this_node {
        None => o.push_str("<p>peer-to-peer is off</p>"),
        Some(me) => {
            let _ = write!(
                o,
                "<p>this node: {} at {}; {} peers connected; {} keys advertised ({} image tags)</p>",
                esc(&me.id),
                esc(&me.addr),
                st.peers.len(),
                st.advertised_keys,
                st.advertised_tags.len()
            );
            if let Some(wait) = st.lookup_wait_ms {
                let _ = write!(
                    o,
                    "<p>lookup wait: {wait} ms ({} lookups cut by it found a provider later)</p>",
                    st.lookups_found_late
                );
            }
            o.push_str("<table><tr><th>peer</th><th>peer address</th><th>connected</th></tr>");
            for p in &st.peers {
                let since = p.connected_s.map_or("-".to_string(), duration);
                let _ = write!(
                    o,
                    "<tr><td>{}</td><td>{}</td><td>{since}</td></tr>",
                    esc(&p.id),
                    esc(&p.addr)
                );
            }
            o.push_str("</table>");
            if !st.passed_over.is_empty() {
                o.push_str("<h3>Passed over (failed recently)</h3><table>");
                for p in &st.passed_over {
                    let what = if p.quarantined {
                        "<span class=\"bad\">quarantined: served bytes that did not match</span>"
                    } else {
                        "asked last"
                    };
                    let _ = write!(
                        o,
                        "<tr><td>{}</td><td>{what}</td><td>{}</td></tr>",
                        esc(&p.id),
                        duration(p.seconds_left)
                    );
                }
                o.push_str("</table>");
            }
        }
    }
    if let Some(keep) = &st.keep {
        let _ = write!(o, "<p>{}</p>", esc(&keep.line(super::status::human)));
    }
    if !st.in_flight.is_empty() {
        o.push_str("<h2>Downloads in a rollout</h2><table><tr><th>digest</th><th>role</th><th>source</th><th>followers</th><th>since</th></tr>");
        for p in &st.in_flight {
            let _ = write!(
                o,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&p.digest),
                esc(&p.role),
                esc(p.source.as_deref().unwrap_or("upstream")),
                esc(&p.followers.join(", ")),
                duration(p.age_s)
            );
        }
        o.push_str("</table>");
    }
    o.push_str("<h2>Served since start</h2><table><tr><th>to</th><th>kind</th><th>from</th><th>answers</th><th>bytes</th></tr>");
    for s in &st.served {
        let to = if s.listener == "peer" {
            "other nodes"
        } else {
            "this node's containerd"
        };
        let _ = write!(
            o,
            "<tr><td>{to}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&s.kind),
            esc(&s.source),
            s.requests,
            human(s.bytes)
        );
    }
    o.push_str("</table><h2>Recent pulls</h2><table><tr><th>ago</th><th>kind</th><th>source</th><th>bytes</th><th>what</th></tr>");
    for p in &st.recent {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            duration(now.saturating_sub(p.at)),
            esc(&p.kind),
            esc(&p.source),
            p.bytes.map_or("-".to_string(), human),
            esc(&p.what)
        );
    }
    o.push_str("</table>");
    if peering {
        o.push_str(
            "<h2>Test pull</h2><p>Fetches a blob or manifest by digest from the nodes that \
advertise it, through the peer path a pull takes, checks it against its digest and discards \
it (nothing reaches containerd).</p><form action=\"/debug/test-pull\" method=\"get\">\
<input name=\"digest\" size=\"80\" placeholder=\"sha256:...\"> <button>Test pull</button></form>",
        );
    }
    if !st.advertised_tags.is_empty() {
        o.push_str("<h2>Images this node advertises</h2><ul>");
        for t in &st.advertised_tags {
            let _ = write!(o, "<li>{}</li>", esc(t));
        }
        o.push_str("</ul>");
    }
    o.push_str("</body></html>\n");
    o
}

fn render_test_pull(r: &TestPull) -> String {
    let mut o = String::from(HEAD);
    let verdict = if r.ok {
        "<span class=\"ok\">OK</span>"
    } else {
        "<span class=\"bad\">FAILED</span>"
    };
    let _ = write!(
        o,
        "<h1>Test pull of {}: {verdict}</h1><p>{}</p><p>DHT lookup: {} ms, {} provider(s)</p>",
        esc(&r.digest),
        esc(&r.summary),
        r.lookup_ms,
        r.providers.len()
    );
    o.push_str(
        "<table><tr><th>peer</th><th>address</th><th>outcome</th><th>bytes</th><th>ms</th></tr>",
    );
    for a in &r.attempts {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&a.peer),
            esc(&a.addr),
            esc(&a.outcome),
            a.bytes,
            a.ms
        );
    }
    o.push_str("</table><p><a href=\"/debug\">back</a></p></body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everything_shown_is_escaped() {
        assert_eq!(
            esc("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
        let st = Status {
            version: "0.1.0".into(),
            node: Some("<script>".into()),
            ready: false,
            conditions: vec![],
            problems: vec![crate::ops::status::Problem {
                problem: "no_peers".into(),
                detail: "<b>".into(),
            }],
            this_node: None,
            peers: vec![],
            passed_over: vec![],
            in_flight: vec![],
            advertised_keys: 0,
            advertised_tags: vec![],
            served: vec![],
            lookup_wait_ms: None,
            lookups_found_late: 0,
            corrupt_blobs: 0,
            keep: None,
            recent: vec![],
        };
        let page = render(&st, 0, false);
        assert!(
            !page.contains("<script>") && !page.contains("<b>"),
            "{page}"
        );
        assert!(page.contains("NOT READY") && page.contains("peer-to-peer is off"));
        assert!(!page.contains("Test pull"), "no test pull without peers");
    }
}
