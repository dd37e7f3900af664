//! Links over real QUIC on loopback: tells and asks reach the named actor, replies come back,
//! a lost peer fails pending calls instead of hanging, malformed envelopes close the link, and a
//! sender cancelled mid-envelope leaves the stream whole.

use std::time::Duration;

use rtx_actors::{ActorError, Link, LinkListener, LinkOptions};

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq, Clone)]
enum Ping {
    Hello { from: String },
    Add { a: u64, b: u64 },
}

fn options() -> LinkOptions {
    LinkOptions { idle_timeout: Duration::from_secs(2), keep_alive: Duration::from_millis(300), connect_timeout: Duration::from_secs(5) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tells_and_asks_cross_a_real_quic_link() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, options())?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (link, mut inbound) = listener.accept().await.expect("a peer");
        let mut seen = Vec::new();
        while let Some(msg) = inbound.recv().await {
            assert_eq!(msg.to(), "calc");
            match msg.decode::<Ping>().expect("valid") {
                Ping::Hello { from } => seen.push(from),
                Ping::Add { a, b } => msg.reply(&(a + b)).await.expect("reply"),
            }
        }
        drop(link);
        seen
    });
    let (link, _inbound) = Link::dial(addr, options()).await?;
    let calc = link.remote::<Ping>("calc");
    calc.tell(&Ping::Hello { from: "client".into() }).await?;
    for i in 0..50u64 {
        let sum: u64 = calc.ask(&Ping::Add { a: i, b: 1000 }, Duration::from_secs(5)).await?;
        assert_eq!(sum, i + 1000);
    }
    // Channel binding material is the same on both ends of one connection only.
    let ekm = link.export_keying_material(b"test")?;
    assert_ne!(ekm, [0u8; 32]);
    // A thread outside the runtime tells too (the sender writes into the stream itself).
    let from_thread = calc.clone();
    std::thread::spawn(move || from_thread.blocking_tell(&Ping::Hello { from: "thread".into() })).join().expect("thread")?;
    let sum: u64 = calc.ask(&Ping::Add { a: 1, b: 1 }, Duration::from_secs(5)).await?;
    assert_eq!(sum, 2);
    link.close("done");
    let seen = server.await?;
    assert_eq!(seen, vec!["client".to_string(), "thread".to_string()]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_peer_fails_pending_calls_promptly() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, options())?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (link, mut inbound) = listener.accept().await.expect("a peer");
        // Take the call, never answer, then go away.
        let _msg = inbound.recv().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        link.close("server leaving");
        listener.close();
    });
    let (link, _inbound) = Link::dial(addr, options()).await?;
    let started = tokio::time::Instant::now();
    let answer: Result<u64, _> = link.remote::<Ping>("calc").ask(&Ping::Add { a: 1, b: 2 }, Duration::from_secs(30)).await;
    assert!(matches!(answer, Err(ActorError::LinkClosed { .. })), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    server.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_answer_times_out_with_a_typed_error() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, options())?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (_link, mut inbound) = listener.accept().await.expect("a peer");
        let msg = inbound.recv().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(msg);
    });
    let (link, _inbound) = Link::dial(addr, options()).await?;
    let answer: Result<u64, _> = link.remote::<Ping>("calc").ask(&Ping::Add { a: 1, b: 2 }, Duration::from_millis(100)).await;
    assert!(matches!(answer, Err(ActorError::Timeout { after_ms: 100, .. })), "{answer:?}");
    server.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_envelope_closes_the_link_with_a_reason() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, options())?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (link, mut inbound) = listener.accept().await.expect("a peer");
        assert!(inbound.recv().await.is_none(), "nothing malformed is delivered");
        link.closed().await
    });
    let (link, _inbound) = Link::dial(addr, options()).await?;
    // A valid tell whose body is garbage is delivered (decoding is the receiver's typed error);
    // an envelope with an unknown kind breaks the framing and closes the link.
    let bad_kind: Vec<u8> = [&12u32.to_le_bytes()[..], &[9u8], &[0u8; 8], &[0u8, 0], &[1u8]].concat();
    link.raw_send_for_tests(bad_kind).await?;
    let reason = tokio::time::timeout(Duration::from_secs(5), server).await??;
    assert!(reason.contains("unknown envelope kind"), "{reason}");
    Ok(())
}

// Goal: a sender that gives up on a send (its future dropped while the peer's flow control holds
// the stream) never leaves the stream cut mid-envelope: the envelope goes whole or not at all, the
// peer reads whole envelopes, and later calls still work. Method: the server does not drain its
// inbound queue, so its reader stops and the stream's window fills; a 4 MiB tell, several windows
// long, is then raced against a timeout. Draining the queue afterwards must yield the small tells,
// the large one whole if it was sent, and answer asks. (It guards the writing path: a sender that
// wrote into the stream itself, as tried in issue 20, failed it until the rest was finished.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_send_still_writes_its_envelope_whole() -> anyhow::Result<()> {
    const SMALL: usize = 300;
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, options())?;
    let addr = listener.local_addr()?;
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (link, mut inbound) = listener.accept().await.expect("a peer");
        let _ = go_rx.await;
        let (mut small, mut big) = (0, Vec::new());
        while let Some(msg) = inbound.recv().await {
            match msg.decode::<Ping>().expect("valid") {
                Ping::Hello { from } if from.len() > 1000 => big.push(from.len()),
                Ping::Hello { .. } => small += 1,
                Ping::Add { a, b } => msg.reply(&(a + b)).await.expect("reply"),
            }
        }
        drop(link);
        (small, big)
    });
    let (link, _inbound) = Link::dial(addr, options()).await?;
    let calc = link.remote::<Ping>("calc");
    // More tells than the server's inbound queue holds: its reader stops behind them.
    for i in 0..SMALL {
        calc.tell(&Ping::Hello { from: format!("small {i}") }).await?;
    }
    let big = "x".repeat(4 << 20);
    let sent = tokio::time::timeout(Duration::from_millis(200), calc.tell(&Ping::Hello { from: big.clone() })).await;
    go_tx.send(()).ok();
    for i in 0..5u64 {
        let sum: u64 = calc.ask(&Ping::Add { a: i, b: 1 }, Duration::from_secs(10)).await?;
        assert_eq!(sum, i + 1);
    }
    link.close("done");
    let (small, big_seen) = server.await?;
    assert_eq!(small, SMALL);
    match sent {
        Ok(result) => {
            result?;
            assert_eq!(big_seen, vec![big.len()]);
        }
        Err(_) => assert!(big_seen.is_empty() || big_seen == vec![big.len()], "{big_seen:?}"),
    }
    Ok(())
}

// Goal: the envelope protocol runs over any ordered byte streams, as the simulator uses it.
// Method: two in-memory pipes and a channel listener; tells, asks and keying material work as
// over QUIC, closing reaches the connection object, and calls on a closed link fail typed.
#[tokio::test]
async fn links_run_over_in_memory_streams_and_a_channel_listener() -> anyhow::Result<()> {
    struct Pipe(std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>);
    impl rtx_actors::StreamConn for Pipe {
        fn close(&self, _reason: &str) {
            if let Some(tx) = self.0.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
        fn export_keying_material(&self, label: &[u8]) -> [u8; 32] {
            let mut out = [7u8; 32];
            out[..label.len().min(32)].copy_from_slice(&label[..label.len().min(32)]);
            out
        }
        fn remote_address(&self) -> std::net::SocketAddr {
            "10.0.0.1:1".parse().unwrap()
        }
    }
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    let conn = std::sync::Arc::new(Pipe(std::sync::Mutex::new(Some(closed_tx))));
    let (a_write, b_read) = tokio::io::duplex(1 << 16);
    let (b_write, a_read) = tokio::io::duplex(1 << 16);
    let (listener, accept) = LinkListener::channel("10.255.0.1:1".parse()?, 4);
    let (server_link, server_inbound) = Link::over_stream("client".into(), conn.clone(), b_read, b_write);
    accept.send((server_link, server_inbound)).await.map_err(|_| anyhow::anyhow!("listener gone"))?;
    let server = tokio::spawn(async move {
        let (link, mut inbound) = listener.accept().await.expect("a link");
        let mut hellos = 0;
        let mut closed_rx = closed_rx;
        loop {
            let msg = tokio::select! {
                biased;
                _ = &mut closed_rx => break,
                msg = inbound.recv() => msg.expect("open until closed"),
            };
            match msg.decode::<Ping>().expect("valid") {
                Ping::Hello { .. } => hellos += 1,
                Ping::Add { a, b } => msg.reply(&(a + b)).await.expect("reply"),
            }
        }
        link.close("server done");
        hellos
    });
    let (link, _inbound) = Link::over_stream("server".into(), conn, a_read, a_write);
    let calc = link.remote::<Ping>("calc");
    calc.tell(&Ping::Hello { from: "c".into() }).await?;
    let sum: u64 = calc.ask(&Ping::Add { a: 2, b: 40 }, Duration::from_secs(5)).await?;
    assert_eq!(sum, 42);
    assert_eq!(link.export_keying_material(b"x")?[0], b'x');
    assert_eq!(link.remote_address(), "10.0.0.1:1".parse::<std::net::SocketAddr>()?);
    link.close("client done");
    assert!(link.closed_reason().is_some());
    let err = calc.ask::<u64>(&Ping::Add { a: 1, b: 1 }, Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(err, ActorError::LinkClosed { .. }), "{err}");
    assert_eq!(server.await?, 1);
    Ok(())
}
