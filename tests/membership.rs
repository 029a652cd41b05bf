//! Tier 0: named segments and leased membership through the engine's API, on the embedded
//! store (no server): publishing, finding and watching members, connecting by name, names
//! checked, and an endpoint ended when its peer's lease expires. Intra-node endpoints (engines
//! without rails) meet over a Unix socket, so no NIC or GPU is needed.

use futures_core::Stream;
use gpudirect::Error;
use gpudirect::transfer::membership::{
    Advertise, EmbeddedStore, MemberEvent, MetadataStore, SegmentName,
};
use gpudirect::transfer::{Engine, EngineConfig};
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

fn socket(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpudirect-membership-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.sock"));
    let _ = std::fs::remove_file(&p);
    p
}

fn engine() -> Engine {
    Engine::new(EngineConfig::local()).unwrap()
}

#[test]
fn members_are_published_found_and_watched() {
    let store = EmbeddedStore::new();
    let a = engine();
    let b = engine();
    a.publish_as("seg-a", &store, Advertise::local_only(socket("a")))
        .unwrap();
    assert!(b.watch_members().is_err(), "no store yet");
    b.use_store(&store).unwrap();
    let mut watch = b.watch_members().unwrap();
    match watch.next_timeout(Duration::from_secs(5)).unwrap() {
        Some(MemberEvent::Joined(r)) => assert_eq!(r.name.as_str(), "seg-a"),
        e => panic!("{e:?}"),
    }
    b.publish_as("seg-b", &store, Advertise::local_only(socket("b")))
        .unwrap();
    let names: Vec<String> = a
        .members()
        .unwrap()
        .into_iter()
        .map(|r| r.name.to_string())
        .collect();
    assert_eq!(names, ["seg-a", "seg-b"]);
    assert!(matches!(
        a.publish_as("seg-c", &store, Advertise::local_only(socket("c"))),
        Err(Error::InvalidArgument { .. })
    ));
    // The same name from another engine: taken.
    let c = engine();
    assert!(matches!(
        c.publish_as("seg-a", &store, Advertise::local_only(socket("c"))),
        Err(Error::NameTaken { .. })
    ));
    // A second store on one engine is refused.
    assert!(a.use_store(&EmbeddedStore::new()).is_err());
    // Polled as a Stream: the join of seg-b, then its leave.
    let mut cx = Context::from_waker(Waker::noop());
    let mut next = || {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            if let Poll::Ready(e) = Pin::new(&mut watch).poll_next(&mut cx) {
                return e.unwrap().unwrap();
            }
            assert!(Instant::now() < until, "no event");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    assert!(matches!(next(), MemberEvent::Joined(r) if r.name.as_str() == "seg-b"));
    b.unpublish().unwrap();
    assert!(matches!(next(), MemberEvent::Left { name, .. } if name.as_str() == "seg-b"));
    assert_eq!(store.members().unwrap().len(), 1);
    drop(a);
    assert!(
        store.members().unwrap().is_empty(),
        "the last clone revokes"
    );
}

#[test]
fn names_are_checked_input() {
    let store = EmbeddedStore::new();
    let a = engine();
    assert!(matches!(
        a.connect_name("seg-x", &[]),
        Err(Error::InvalidArgument { .. })
    ));
    a.use_store(&store).unwrap();
    for bad in ["", "a/b", "../x", "a b", &"x".repeat(129)] {
        assert!(
            matches!(a.connect_name(bad, &[]), Err(Error::InvalidArgument { .. })),
            "{bad:?}"
        );
        assert!(matches!(
            a.publish_as(bad, &store, Advertise::local_only(socket("bad"))),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(
        a.connect_name("nobody", &[]),
        Err(Error::UnknownName { .. })
    ));
    for at in [
        Advertise::rails(["10.0.0.1:7400"]),
        Advertise::local_only("relative.sock"),
        Advertise::local_only(socket("t")).ttl(Duration::from_millis(10)),
    ] {
        assert!(
            matches!(
                a.publish_as("a", &store, at.clone()),
                Err(Error::InvalidArgument { .. })
            ),
            "{at:?}"
        );
    }
    assert!(SegmentName::new("ok-1.two_3").is_ok());
}

#[test]
fn an_endpoint_ends_when_its_peer_lease_expires() {
    let store = EmbeddedStore::new();
    let server = engine();
    let path = socket("server");
    let listener = server.listen_local(&path).unwrap();
    let ttl = Duration::from_secs(1);
    server
        .publish_as("server", &store, Advertise::local_only(&path).ttl(ttl))
        .unwrap();
    let accept = std::thread::spawn(move || {
        let ep = listener.accept(&[], Duration::from_secs(10));
        (listener, ep)
    });
    let client = engine();
    client.use_store(&store).unwrap();
    let ep = match client.connect_name("server", &[]) {
        Ok(ep) => ep,
        Err(e) => {
            println!("SKIPPED: intra-node endpoints cannot be made here: {e}");
            return;
        }
    };
    let (_listener, accepted) = accept.join().unwrap();
    let _accepted = accepted.unwrap();
    assert!(ep.failure().is_none());
    // The server stops renewing its lease (stopped, cut off): within twice the TTL the
    // endpoint ends, typed.
    let t0 = Instant::now();
    assert!(store.suspend("server").unwrap());
    let until = t0 + 3 * ttl;
    while ep.failure().is_none() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = t0.elapsed();
    match ep.failure() {
        Some(Error::PeerLeft { name, .. }) => assert_eq!(name, "server"),
        other => panic!("{other:?} after {took:?}"),
    }
    assert!(took >= ttl && took <= 2 * ttl, "{took:?}");
    println!("endpoint ended {took:?} after the lease stopped (TTL {ttl:?})");
    assert!(matches!(
        ep.write(Vec::new(), Default::default()),
        Err(Error::PeerLeft { .. })
    ));
    assert!(client.connect_name("server", &[]).is_err());
    // It comes back: found again.
    assert!(store.resume("server"));
    assert!(
        client
            .members()
            .unwrap()
            .iter()
            .any(|r| r.name.as_str() == "server")
    );
}

/// Two threads publishing one name on one engine at once: one wins, and the name stays
/// published (the loser's publication, dropped, must not withdraw the winner's record).
#[test]
fn publishing_a_name_twice_at_once_keeps_it_published() {
    for t in 0..20 {
        let store = EmbeddedStore::new();
        let e = engine();
        let path = socket(&format!("twice-{t}"));
        let go = std::sync::Arc::new(std::sync::Barrier::new(2));
        let tries: Vec<_> = (0..2)
            .map(|_| {
                let (e, s, p, go) = (e.clone(), store.clone(), path.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    e.publish_as("twice", &s, Advertise::local_only(p)).is_ok()
                })
            })
            .collect();
        let won = tries
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|ok| *ok)
            .count();
        assert_eq!(won, 1, "trial {t}");
        let listed = store.lookup(&SegmentName::new("twice").unwrap()).unwrap();
        assert_eq!(
            listed.map(|r| r.node),
            e.published().map(|r| r.node),
            "trial {t}: the store lost the name the engine says it publishes"
        );
        assert!(e.published().is_some());
    }
}
