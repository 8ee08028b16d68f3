use super::*;

#[test]
fn only_clients_on_this_host_are_the_same_host() {
    let addrs = |remote: &str, local: &str| ConnAddrs {
        remote: remote.parse().unwrap(),
        local: Some(local.parse().unwrap()),
    };
    assert!(addrs("127.0.0.1:4000", "127.0.0.1:5483").same_host());
    assert!(addrs("[::1]:4000", "[::1]:5483").same_host());
    assert!(addrs("[::ffff:127.0.0.1]:4000", "[::ffff:127.0.0.1]:5483").same_host());
    assert!(
        addrs("10.0.0.5:4000", "10.0.0.5:5483").same_host(),
        "to its own address"
    );
    assert!(!addrs("10.0.0.6:4000", "10.0.0.5:5483").same_host());
    assert!(!addrs("[fd00::6]:4000", "[fd00::5]:5483").same_host());
}

/// A listener on loopback serving `router` with `bounds`; its address and the stop token.
async fn serving(
    router: axum::Router,
    bounds: Bounds,
) -> (std::net::SocketAddr, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let limited = LimitedListener::new(listener, 16);
    tokio::spawn(serve(limited, "test", router, bounds, stop.clone()));
    (addr, stop)
}

fn bounds(in_flight: usize, progress: Duration) -> Bounds {
    Bounds {
        head_deadline: HEAD_DEADLINE,
        in_flight,
        slot_wait: Duration::from_millis(200),
        progress_deadline: progress,
        busy: StatusCode::NOT_FOUND,
    }
}

/// `/stuck` sends one chunk, then nothing ever; `/ok` answers at once.
fn router() -> axum::Router {
    use futures::StreamExt;
    let stuck = || async {
        let first =
            futures::stream::once(async { Ok::<_, std::io::Error>(bytes::Bytes::from("x")) });
        Body::from_stream(first.chain(futures::stream::pending()))
    };
    axum::Router::new()
        .route("/stuck", axum::routing::get(stuck))
        .route("/ok", axum::routing::get(|| async { "ok" }))
}

/// Sends `GET path` and reads until the status line and `want` more bytes of the answer
/// arrived, or the connection ended: what was read.
async fn get(addr: std::net::SocketAddr, path: &str) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    (s, text)
}

#[tokio::test]
async fn a_request_that_finds_every_slot_taken_is_answered_at_once() {
    let (addr, stop) = serving(router(), bounds(1, Duration::from_secs(600))).await;
    let (holder, text) = get(addr, "/stuck").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let (_, text) = get(addr, "/ok").await;
    assert!(text.starts_with("HTTP/1.1 404"), "the busy answer: {text}");
    drop(holder);
    let ok = async {
        loop {
            let (_, text) = get(addr, "/ok").await;
            if text.starts_with("HTTP/1.1 200") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), ok)
        .await
        .expect("the slot given back when its holder left");
    stop.cancel();
}

#[tokio::test]
async fn a_response_that_stops_moving_is_cut_and_its_slot_given_back() {
    use tokio::io::AsyncReadExt;
    let (addr, stop) = serving(router(), bounds(1, Duration::from_millis(300))).await;
    let (mut stuck, text) = get(addr, "/stuck").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), stuck.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the stuck response was never cut");
    let (_, text) = get(addr, "/ok").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    stop.cancel();
}

#[tokio::test]
async fn http2_is_not_spoken() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, stop) = serving(router(), bounds(4, Duration::from_secs(600))).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The HTTP/2 connection preface, then an empty SETTINGS frame.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection was kept open");
    // An HTTP/2 server answers with its own SETTINGS frame (type 4); HTTP/1 refuses the
    // preface and closes.
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 "),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    stop.cancel();
}

#[tokio::test]
async fn a_page_rebound_to_loopback_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, stop) = serving(router(), bounds(4, Duration::from_secs(600))).await;
    for (host, status) in [
        ("evil.example:5480", "HTTP/1.1 421"),
        ("localhost:5480", "HTTP/1.1 200"),
        ("127.0.0.1", "HTTP/1.1 200"),
        ("[::1]:5480", "HTTP/1.1 200"),
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET /ok HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with(status), "{host}: {text}");
    }
    stop.cancel();
}

#[tokio::test]
async fn a_held_request_keeps_its_slot_after_its_response() {
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let released = Arc::new(Mutex::new(Some(released)));
    let hand_over = move |req: axum::extract::Request| {
        let released = released.clone();
        async move {
            // As the zero-copy send does: the response ends, the work goes on, held.
            let hold = req.extensions().get::<Hold>().cloned().expect("a hold");
            let released = released.lock().unwrap().take().expect("once");
            tokio::spawn(async move {
                let _hold = hold;
                let _ = released.await;
            });
            "handed over"
        }
    };
    let router = router().route("/hand-over", axum::routing::get(hand_over));
    let (addr, stop) = serving(router, bounds(1, Duration::from_secs(600))).await;
    let (_, text) = get(addr, "/hand-over").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let (_, text) = get(addr, "/ok").await;
    assert!(
        text.starts_with("HTTP/1.1 404"),
        "the slot is still held: {text}"
    );
    release.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, text) = get(addr, "/ok").await;
    assert!(text.starts_with("HTTP/1.1 200"), "given back: {text}");
    stop.cancel();
}
