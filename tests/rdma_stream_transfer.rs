//! Tier 1 (Soft-RoCE VM, `bash ci/rxe-vm/run.sh`): the stream proxy's RDMA half with host-side
//! triggers, on a loopback endpoint pair of one engine (the first verbs device's IPv4 address).
//! Without a verbs device every test prints `SKIPPED` (and fails when `GPUDIRECT_REQUIRE` names
//! `rdma`).
//!
//! Bytes are random (the seed is printed; `STREAM_TEST_SEED` replays it) and compared exactly
//! against poisoned destinations.

mod support;

use gpudirect::Error;
use gpudirect::transfer::{
    Buffer, DescribedKind, Endpoint, Engine, EngineConfig, MemoryDescriptor, Region,
    STREAM_ERROR_BIT, StreamTransfer, TransferOptions,
};
use gpudirect_testing::{Hardware, skip};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);
/// The thousand requests' deadline: under TCG the 999 transfers before the first trigger take a
/// while, and an armed request must fire within its deadline.
const LONG: Duration = Duration::from_secs(240);

/// An engine on the first verbs device, and a connected pair of its endpoints: (client,
/// server), the server publishing `publish`.
fn pair(
    publish: impl FnOnce(&Engine) -> Vec<Region>,
) -> Option<(Engine, Endpoint, Endpoint, Vec<Region>)> {
    let engine = match gpudirect::rdma::DeviceList::non_empty() {
        Ok(l) => {
            let first = l.iter().map(|d| d.name()).min()?;
            Engine::new(EngineConfig::with_devices(&[first])).expect("engine")
        }
        Err(e) => {
            skip(Hardware::Rdma, e);
            return None;
        }
    };
    let Some(ip) = support::rdma::device_ipv4(&engine.devices()) else {
        skip(
            Hardware::Rdma,
            "no IPv4 address on the verbs device (rdma_cm needs one)",
        );
        return None;
    };
    let regions = publish(&engine);
    let descs: Vec<MemoryDescriptor> = regions.iter().map(|r| r.descriptor().unwrap()).collect();
    let l = engine.listen(&format!("{ip}:0")).expect("listen");
    let peer = format!("{ip}:{}", l.port());
    let srv = std::thread::spawn(move || l.accept(&descs, WAIT));
    let client = engine.connect(&[&peer], &[]).expect("connect");
    let server = srv.join().unwrap().expect("accept");
    Some((engine, client, server, regions))
}

fn seed() -> u64 {
    support::gpu::seed_from("STREAM_TEST_SEED")
}

fn host_region(engine: &Engine, bytes: Vec<u8>) -> Region {
    engine.register(Buffer::host(bytes).unwrap()).unwrap()
}

fn until(what: &str, timeout: Duration, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn host_triggered_writes_and_reads_move_exact_bytes_after_the_trigger() {
    const N: usize = 1 << 20;
    let Some((engine, client, _server, target)) = pair(|e| vec![host_region(e, vec![0xA5; N])])
    else {
        return;
    };
    let data = support::files::pattern(N, seed());
    let src = host_region(&engine, data.clone());
    let dst = client.peer_descriptors()[0];
    let t = client
        .write_triggered(vec![(src.all(), dst.all())], TransferOptions::default())
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !t.is_complete() && !t.is_released(),
        "ran before its trigger"
    );
    assert!(
        target[0].to_vec().unwrap().iter().all(|&b| b == 0xA5),
        "bytes moved before the trigger"
    );
    t.trigger().unwrap();
    let r = t.wait(WAIT).unwrap();
    assert_eq!(r.bytes, N as u64);
    assert_eq!(t.completion_value(), t.seq());
    assert!(target[0].to_vec().unwrap() == data, "written bytes differ");

    // Read them back into a poisoned region.
    let back = host_region(&engine, vec![0x5A; N]);
    let t = client
        .read_triggered(vec![(back.all(), dst.all())], TransferOptions::default())
        .unwrap();
    assert_eq!(t.seq(), 2);
    t.trigger().unwrap();
    assert_eq!(t.wait(WAIT).unwrap().bytes, N as u64);
    assert_eq!(t.completion_value(), 2);
    assert!(back.to_vec().unwrap() == data, "read bytes differ");

    // Checked before anything is armed: lengths that differ, a notification on a read.
    let e = client
        .write_triggered(
            vec![(src.range(0, 8).unwrap(), dst.range(0, 16).unwrap())],
            TransferOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = client
        .read_triggered(vec![(back.all(), dst.all())], TransferOptions::notify(1))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    // A host-triggered queue has no device word to wait on.
    let t = client
        .write_triggered(vec![(src.all(), dst.all())], TransferOptions::default())
        .unwrap();
    assert!(matches!(
        t.completion_word(),
        Err(Error::Unsupported { .. })
    ));
    t.trigger().unwrap();
    t.wait(WAIT).unwrap();
}

#[test]
fn a_thousand_triggers_fired_out_of_order_publish_the_word_in_order() {
    const K: usize = 1000;
    const EACH: usize = 64;
    let Some((engine, client, _server, target)) =
        pair(|e| vec![host_region(e, vec![0xA5; K * EACH])])
    else {
        return;
    };
    let s = seed();
    let data = support::files::pattern(K * EACH, s);
    let src = host_region(&engine, data.clone());
    let dst = client.peer_descriptors()[0];
    let ts: Vec<StreamTransfer> = (0..K)
        .map(|i| {
            let off = (i * EACH) as u64;
            client
                .write_triggered(
                    vec![(
                        src.range(off, EACH as u64).unwrap(),
                        dst.range(off, EACH as u64).unwrap(),
                    )],
                    TransferOptions::default().deadline(LONG),
                )
                .unwrap()
        })
        .collect();
    assert_eq!(ts[K - 1].seq(), K as u64);
    // Every trigger but the first, in a shuffled order.
    let mut order: Vec<usize> = (1..K).collect();
    let mut x = s | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut last = 0;
    for (n, &i) in order.iter().enumerate() {
        ts[i].trigger().unwrap();
        if n % 50 == 0 {
            let w = ts[0].completion_value();
            assert!(w >= last, "the word went back: {w} after {last}");
            last = w;
        }
    }
    until("the 999 later requests", LONG, || {
        ts[1..].iter().all(StreamTransfer::is_complete)
    });
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        ts[0].completion_value(),
        0,
        "published past request 1, which never started"
    );
    assert!(!ts[K - 1].is_released());
    ts[0].trigger().unwrap();
    until("the word at 1000", LONG, || {
        ts[0].completion_value() == K as u64
    });
    for t in &ts {
        assert_eq!(t.wait(WAIT).unwrap().bytes, EACH as u64);
    }
    assert!(
        target[0].to_vec().unwrap() == data,
        "bytes differ (seed {s})"
    );
}

#[test]
fn a_trigger_never_fired_is_released_with_the_error_bit_when_the_endpoint_goes() {
    let Some((engine, client, server, _target)) = pair(|e| vec![host_region(e, vec![0; 4096])])
    else {
        return;
    };
    let src = host_region(&engine, vec![1; 4096]);
    let dst = client.peer_descriptors()[0];
    let fired = client
        .write_triggered(vec![(src.all(), dst.all())], TransferOptions::default())
        .unwrap();
    fired.trigger().unwrap();
    fired.wait(WAIT).unwrap();
    let never: Vec<StreamTransfer> = (0..3)
        .map(|_| {
            client
                .write_triggered(vec![(src.all(), dst.all())], TransferOptions::default())
                .unwrap()
        })
        .collect();
    assert_eq!(never[0].completion_value(), 1);
    drop(client);
    for t in &never {
        let w = t.completion_value();
        assert_ne!(
            w & STREAM_ERROR_BIT,
            0,
            "released with the error bit: {w:#x}"
        );
        assert_eq!(w & !STREAM_ERROR_BIT, 1, "the successful prefix stays");
        assert!(t.is_released());
        assert!(t.wait(WAIT).is_err());
    }
    drop(server);
}

#[test]
fn a_failed_request_releases_its_word_with_the_error_bit_and_a_typed_error() {
    let Some((engine, client, _server, _target)) = pair(|e| vec![host_region(e, vec![0; 4096])])
    else {
        return;
    };
    let src = host_region(&engine, vec![1; 4096]);
    let good = client.peer_descriptors()[0];
    let bad = MemoryDescriptor::new(
        good.addr(),
        good.len(),
        DescribedKind::Host,
        &[good.rkeys()[0] ^ 0x5555],
    )
    .unwrap();
    let later = client
        .write_triggered(vec![(src.all(), good.all())], TransferOptions::default())
        .unwrap();
    let t = client
        .write_triggered(
            vec![(src.all(), bad.all())],
            TransferOptions::default().deadline(Duration::from_secs(20)),
        )
        .unwrap();
    t.trigger().unwrap();
    let e = t.wait(WAIT).unwrap_err();
    assert!(
        matches!(e, Error::WorkCompletion { .. } | Error::Timeout { .. }),
        "{e}"
    );
    assert_ne!(t.completion_value() & STREAM_ERROR_BIT, 0);
    // The armed request before it in the queue never fired: failed with the queue.
    assert!(later.is_released());
    assert!(later.wait(WAIT).is_err());
    // The endpoint failed: later requests are refused before anything is armed.
    assert!(
        client
            .write_triggered(vec![(src.all(), good.all())], TransferOptions::default())
            .is_err()
    );
}

#[test]
fn the_notification_counter_counts_without_consuming() {
    const K: u32 = 40;
    let Some((engine, client, server, target)) = pair(|e| vec![host_region(e, vec![0; 4096])])
    else {
        return;
    };
    let counter = server.notification_counter_host().unwrap();
    assert_eq!(counter.value(), 0);
    assert!(matches!(
        counter.device_address(),
        Err(Error::Unsupported { .. })
    ));
    let data = support::files::pattern(4096, seed());
    let src = host_region(&engine, data.clone());
    let dst = client.peer_descriptors()[0];
    for i in 0..K {
        let opts = TransferOptions::notify(i);
        if i % 2 == 0 {
            client
                .write(vec![(src.all(), dst.all())], opts)
                .unwrap()
                .wait()
                .unwrap();
        } else {
            let t = client
                .write_triggered(vec![(src.all(), dst.all())], opts)
                .unwrap();
            t.trigger().unwrap();
            t.wait(WAIT).unwrap();
        }
    }
    until("the counter at K", WAIT, || counter.value() == u64::from(K));
    assert!(target[0].to_vec().unwrap() == data);
    // Counted, not consumed: every notification is still delivered, in order.
    for i in 0..K {
        let n = server
            .next_notification(WAIT)
            .unwrap()
            .expect("a notification");
        assert_eq!(n.tag, i);
    }
    // The same counter again.
    assert_eq!(
        server.notification_counter_host().unwrap().value(),
        u64::from(K)
    );
    drop(client);
    drop(server);
    let v = counter.value();
    assert_eq!(
        v,
        u64::from(K) | STREAM_ERROR_BIT,
        "released at the close: {v:#x}"
    );
}
