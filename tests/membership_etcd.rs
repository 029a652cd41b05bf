//! Tier 0 against a real etcd (feature `etcd`; `ci/run.sh` starts one and sets
//! `GPUDIRECT_ETCD=host:port`): keys, leases and keep-alives, watches, expiry of a publisher
//! that was SIGKILLed or SIGSTOPped (a child process of this test), publishing again, checks on
//! what is read, and etcd restarting (killed and started again on its data directory, then on
//! an empty one: this test starts its own etcd for that, from `GPUDIRECT_ETCD_BIN` or `etcd` on
//! the PATH). Without `GPUDIRECT_ETCD` every test prints `SKIPPED` (a failure when
//! `GPUDIRECT_REQUIRE` names `etcd`).

mod support;

use gpudirect::Error;
use gpudirect::transfer::membership::{
    Advertise, EtcdConfig, EtcdStore, HostId, MemberEvent, MemberRecord, MemberWatch,
    MetadataStore, NodeId, SegmentName,
};
use gpudirect::transfer::{Engine, EngineConfig};
use gpudirect_testing::{Hardware, skip};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The lease TTL of these tests (etcd's shortest is about 2 s with its default timings).
const TTL: Duration = Duration::from_secs(2);

fn etcd_addr() -> Option<String> {
    std::env::var("GPUDIRECT_ETCD")
        .ok()
        .filter(|s| !s.is_empty())
}

macro_rules! etcd {
    () => {
        match etcd_addr() {
            Some(a) => a,
            None => {
                skip(Hardware::Etcd, "no etcd (GPUDIRECT_ETCD unset)");
                return;
            }
        }
    };
}

/// A namespace of this test run alone.
fn ns(test: &str) -> String {
    format!("/gpudirect-test/{}-{test}/", std::process::id())
}

fn store(addr: &str, test: &str) -> EtcdStore {
    EtcdStore::connect(EtcdConfig::new([addr]).namespace(ns(test))).expect("etcd answers")
}

fn record(name: &str) -> MemberRecord {
    MemberRecord {
        name: SegmentName::new(name).unwrap(),
        node: NodeId::random().unwrap(),
        host: HostId::new("test-host").unwrap(),
        rails: vec!["10.9.0.1:7400".into()],
        local: None,
        ttl: TTL,
    }
}

fn next(w: &mut MemberWatch, within: Duration) -> Option<MemberEvent> {
    w.next_timeout(within).expect("the watch goes on")
}

fn etcdctl(addr: &str, args: &[&str]) -> bool {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={addr}"))
        .args(args)
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn keys_leases_lookups_and_names_taken() {
    let addr = etcd!();
    let s = store(&addr, "keys");
    let r = record("seg-a");
    let p = s.publish(&r).unwrap();
    assert_eq!(
        s.key_of(&r.name),
        format!("{}members/seg-a", ns("keys")),
        "the key layout"
    );
    assert_eq!(s.lookup(&r.name).unwrap(), Some(r.clone()));
    assert_eq!(s.members().unwrap(), vec![r.clone()]);
    let ops = s.ops();
    // The lookup, and the publication's read of its own key as its watch of it starts.
    assert_eq!((ops.grants, ops.puts), (1, 1), "{ops:?}");
    assert!((1..=2).contains(&ops.gets), "{ops:?}");
    // Another node (another store handle) cannot take the name.
    let other = store(&addr, "keys");
    let mut r2 = record("seg-a");
    r2.node = NodeId::random().unwrap();
    assert!(matches!(other.publish(&r2), Err(Error::NameTaken { .. })));
    // Keep-alives hold the lease past its TTL.
    std::thread::sleep(TTL * 2 + Duration::from_millis(500));
    assert_eq!(s.lookup(&r.name).unwrap(), Some(r.clone()));
    let ka = s.ops().keepalives;
    assert!(ka >= 3, "{ka} keep-alives in 2.25 TTLs");
    p.revoke(Duration::from_secs(3)).unwrap();
    assert_eq!(s.lookup(&r.name).unwrap(), None);
    // Free again.
    let _p2 = other.publish(&r2).unwrap();
    println!("ops per publish and lookup: {:?}", s.ops());
}

#[test]
fn a_watch_sees_joins_leaves_and_skips_bad_records() {
    let addr = etcd!();
    let s = store(&addr, "watch");
    let a = record("a");
    let _pa = s.publish(&a).unwrap();
    let mut w = s.watch().unwrap();
    assert_eq!(next(&mut w, TTL), Some(MemberEvent::Joined(a.clone())));
    let b = record("b");
    let pb = s.publish(&b).unwrap();
    assert_eq!(next(&mut w, TTL), Some(MemberEvent::Joined(b.clone())));
    drop(pb);
    assert_eq!(
        next(&mut w, TTL),
        Some(MemberEvent::Left {
            name: b.name.clone(),
            node: b.node
        })
    );
    // What another program wrote is checked: a bad record, another version, a key that is no
    // name are left out of lists and watches; a lookup says why.
    let key = |n: &str| format!("{}members/{n}", ns("watch"));
    let v2 = String::from_utf8(record("v").to_bytes().unwrap())
        .unwrap()
        .replace("member/1", "member/2");
    if etcdctl(&addr, &["put", &key("junk"), "junk"])
        && etcdctl(&addr, &["put", &key("v"), &v2])
        && etcdctl(&addr, &["put", &key("a/b"), "x"])
    {
        assert!(matches!(
            s.lookup(&SegmentName::new("junk").unwrap()),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            s.lookup(&SegmentName::new("v").unwrap()),
            Err(Error::UnknownVersion { found: 2, .. })
        ));
        assert_eq!(s.members().unwrap(), vec![a.clone()]);
        assert_eq!(next(&mut w, Duration::from_millis(500)), None);
        etcdctl(&addr, &["del", "--prefix", &ns("watch")]);
    } else {
        println!("(etcdctl not found: the bad-record half left out)");
    }
}

/// A publication revoked (or dropped) while its keep-alive is in flight stays revoked: the
/// keeper must not take the revoked lease for a lost one and publish the record again.
#[test]
fn a_revoke_during_a_keep_alive_stays_revoked() {
    let addr = etcd!();
    let s = store(&addr, "revoke");
    for i in 0..100u64 {
        let p = s.publish(&record(&format!("r{i}"))).unwrap();
        // The keeper opens its keep-alive stream at once: revoke while that is in flight.
        std::thread::sleep(Duration::from_micros(i * 37 % 3000));
        if i % 2 == 0 {
            p.revoke(Duration::from_secs(3)).unwrap();
        } else {
            drop(p);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let left = s.members().unwrap();
    assert!(left.is_empty(), "published again after a revoke: {left:?}");
}

/// The child side: publish `name` with a local-only engine and wait to be killed.
#[test]
fn child_publisher() {
    let (Ok(addr), Ok(name)) = (
        std::env::var("GPUDIRECT_ETCD"),
        std::env::var("GPUDIRECT_MEMBER_CHILD"),
    ) else {
        return;
    };
    let s = EtcdStore::connect(
        EtcdConfig::new([addr.as_str()]).namespace(std::env::var("GPUDIRECT_MEMBER_NS").unwrap()),
    )
    .unwrap();
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let path = std::env::temp_dir().join(format!("gpudirect-etcd-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = engine.listen_local(&path).unwrap();
    engine
        .publish_as(&name, &s, Advertise::local_only(&path).ttl(TTL))
        .unwrap();
    println!("published {}", engine.published().unwrap().node);
    loop {
        // Accept whoever connects (after a stop and resume, again).
        if let Ok(ep) = listener.accept(&[], Duration::from_secs(1)) {
            std::mem::forget(ep);
        }
    }
}

fn spawn_child(addr: &str, test: &str, name: &str) -> (Child, NodeId) {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_publisher",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("GPUDIRECT_ETCD", addr)
        .env("GPUDIRECT_MEMBER_CHILD", name)
        .env("GPUDIRECT_MEMBER_NS", ns(test))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(c.stdout.take().unwrap());
    for line in out.lines() {
        let line = line.unwrap();
        // After libtest's `test child_publisher ... `.
        if let Some((_, n)) = line.split_once("published ") {
            return (c, NodeId::parse(n.trim()).unwrap());
        }
    }
    let _ = c.kill();
    let _ = c.wait();
    panic!("the child did not publish");
}

fn signal(c: &Child, sig: i32) {
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(c.id() as i32, sig) }, 0);
}

/// Wait for `name`'s leave in `w` (other events skipped): how long it took.
fn until_left(w: &mut MemberWatch, name: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Some(MemberEvent::Left { name: n, .. }) = next(w, Duration::from_millis(100))
            && n.as_str() == name
        {
            return t0.elapsed();
        }
    }
    panic!("{name} did not leave within {within:?}");
}

#[test]
fn killed_and_stopped_publishers_expire_and_come_back() {
    let addr = etcd!();
    let s = store(&addr, "expiry");
    let engine = Engine::new(EngineConfig::local()).unwrap();
    engine.use_store(&s).unwrap();
    let mut w = s.watch().unwrap();

    // SIGKILL: no revoke, the lease expires within the TTL.
    let (mut k, _) = spawn_child(&addr, "expiry", "killed");
    let ep = engine.connect_name("killed", &[]);
    signal(&k, libc::SIGKILL);
    let took = until_left(&mut w, "killed", TTL * 3);
    let _ = k.wait();
    println!("SIGKILLed publisher: gone from the store after {took:?} (TTL {TTL:?})");
    assert!(took <= TTL + Duration::from_millis(1500), "{took:?}");
    assert_eq!(
        s.lookup(&SegmentName::new("killed").unwrap()).unwrap(),
        None
    );
    drop(ep);

    // SIGSTOP: the endpoint to it ends (typed, within 2 TTL); SIGCONT: it publishes again.
    let (mut st, node) = spawn_child(&addr, "expiry", "stopped");
    let ep = match engine.connect_name("stopped", &[]) {
        Ok(ep) => Some(ep),
        Err(e) => {
            println!("(no intra-node endpoint here: {e}; the store half only)");
            None
        }
    };
    let t0 = Instant::now();
    signal(&st, libc::SIGSTOP);
    let gone = until_left(&mut w, "stopped", TTL * 3);
    if let Some(ep) = &ep {
        while ep.failure().is_none() && t0.elapsed() < TTL * 3 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let ended = t0.elapsed();
        assert!(
            matches!(ep.failure(), Some(Error::PeerLeft { .. })),
            "{:?}",
            ep.failure()
        );
        println!(
            "SIGSTOPped publisher: its endpoint ended after {ended:?} (2 x TTL = {:?})",
            TTL * 2
        );
        assert!(ended <= TTL * 2, "{ended:?}");
    }
    println!("SIGSTOPped publisher: gone from the store after {gone:?}");
    signal(&st, libc::SIGCONT);
    let t1 = Instant::now();
    let back = loop {
        match next(&mut w, Duration::from_millis(100)) {
            Some(MemberEvent::Joined(r)) if r.name.as_str() == "stopped" => break r,
            _ => assert!(t1.elapsed() < TTL * 2, "not back"),
        }
    };
    assert_eq!(back.node, node, "the same node publishes again");
    println!(
        "resumed publisher: published again after {:?}",
        t1.elapsed()
    );
    let again = engine.connect_name("stopped", &[]);
    assert!(ep.is_none() || again.is_ok(), "{again:?}");
    drop(again);
    signal(&st, libc::SIGKILL);
    let _ = st.wait();
}

/// An etcd of this test's own (so that it can be killed), on free ports.
struct OwnEtcd {
    bin: PathBuf,
    dir: PathBuf,
    client: u16,
    peer: u16,
    child: Option<Child>,
    /// More of etcd's options.
    extra: Vec<&'static str>,
    /// One such etcd at a time in this process (tests run at once; starting several on two
    /// cores beside the shared etcd's load made one miss its start-up bound).
    _one: std::sync::MutexGuard<'static, ()>,
}

static ONE_OWN_ETCD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl OwnEtcd {
    fn new() -> Option<OwnEtcd> {
        let bin = std::env::var_os("GPUDIRECT_ETCD_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("PATH").and_then(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("etcd"))
                        .find(|f| f.is_file())
                })
            })?;
        // One directory per etcd: tests run at once in this process.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("gpudirect-etcd-restart-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let one = ONE_OWN_ETCD.lock().unwrap_or_else(|e| e.into_inner());
        Some(OwnEtcd {
            bin,
            dir,
            client: free_port(),
            peer: free_port(),
            child: None,
            extra: Vec::new(),
            _one: one,
        })
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }

    fn start(&mut self) {
        let c = format!("http://127.0.0.1:{}", self.client);
        let p = format!("http://127.0.0.1:{}", self.peer);
        // A port picked free may be taken again before etcd binds it (by another test's
        // outgoing connection): etcd then exits, perhaps after it listened on the other one.
        // Started again on the same ports (a restart keeps its data and its member's URLs).
        for _ in 0..5 {
            let mut child = support::etcd::single_member(&self.bin, "restart", &self.dir, &c, &p)
                .args(&self.extra)
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let until = Instant::now() + Duration::from_secs(20);
            let exited = |child: &mut std::process::Child| !matches!(child.try_wait(), Ok(None));
            let up = loop {
                if exited(&mut child) {
                    break false;
                }
                if std::net::TcpStream::connect(self.addr()).is_ok() {
                    // Still running a moment after it listened.
                    std::thread::sleep(Duration::from_millis(200));
                    break !exited(&mut child);
                }
                assert!(Instant::now() < until, "etcd did not start");
                std::thread::sleep(Duration::from_millis(50));
            };
            self.child = Some(child);
            if up {
                return;
            }
            self.kill();
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("etcd exited at each of 5 starts on {}", self.addr());
    }

    fn kill(&mut self) {
        support::etcd::stop(&mut self.child);
    }
}

/// An etcd of this test's own, started; `None` (after `SKIPPED`) without an etcd binary.
fn started_own_etcd() -> Option<OwnEtcd> {
    started_own_etcd_with(&[])
}

/// The same, with more of etcd's options.
fn started_own_etcd_with(extra: &[&'static str]) -> Option<OwnEtcd> {
    let Some(mut e) = OwnEtcd::new() else {
        skip(
            Hardware::Etcd,
            "no etcd binary (GPUDIRECT_ETCD_BIN unset, none on the PATH)",
        );
        return None;
    };
    e.extra = extra.to_vec();
    e.start();
    Some(e)
}

impl Drop for OwnEtcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn an_etcd_restart_loses_nothing() {
    let _addr = etcd!();
    let Some(mut e) = started_own_etcd() else {
        return;
    };
    let s = EtcdStore::connect(EtcdConfig::new([e.addr()]).namespace("/restart/")).unwrap();
    let r = record("kept");
    let p = s.publish(&r).unwrap();
    let mut w = s.watch().unwrap();
    assert!(matches!(next(&mut w, TTL), Some(MemberEvent::Joined(_))));
    let name = r.name.clone();
    let find = |within: Duration| {
        let t0 = Instant::now();
        loop {
            if let Ok(Some(found)) = s.lookup(&name) {
                return (found, t0.elapsed());
            }
            assert!(t0.elapsed() < within, "not found again within {within:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // Killed and started again on its data, down for longer than the TTL: leases are renewed
    // when etcd comes back, the record stays, no watcher hears of a leave.
    e.kill();
    std::thread::sleep(TTL + Duration::from_secs(1));
    e.start();
    let (found, took) = find(Duration::from_secs(10));
    assert_eq!(found, r);
    std::thread::sleep(TTL * 2);
    assert_eq!(
        s.lookup(&name).unwrap(),
        Some(r.clone()),
        "kept past the TTL"
    );
    let mut left = 0;
    while let Some(ev) = next(&mut w, Duration::from_millis(200)) {
        left += matches!(ev, MemberEvent::Left { .. }) as usize;
    }
    assert_eq!(left, 0, "a restart is not a leave");
    println!(
        "etcd restarted on its data: record found {took:?} after the restart, lease {} republished {}",
        p.lease_id(),
        p.republished()
    );

    // Started again without its data: the lease is gone; the record is published again.
    e.kill();
    let _ = std::fs::remove_dir_all(&e.dir);
    e.start();
    let (found, took) = find(TTL * 2);
    assert_eq!(found, r);
    assert!(p.republished() >= 1);
    println!("etcd restarted empty: record published again {took:?} after the restart");
    // The watch reports it (a leave and a join at most, within the grace an engine allows).
    let t0 = Instant::now();
    loop {
        match next(&mut w, Duration::from_millis(200)) {
            Some(MemberEvent::Joined(j)) if j.name == r.name => break,
            _ => assert!(t0.elapsed() < TTL * 3, "the watch did not catch up"),
        }
    }
    drop(p);
}

/// Clock ticks of CPU (user + system) process `pid` has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: fields 3 onward; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    n(11) + n(12)
}

/// What publishing, keeping alive and looking up cost etcd (docs/transfer.md works etcd's load
/// at 1,000 nodes out from these): wall time per operation seen by a client, and etcd's CPU
/// per operation, on an etcd of this test's own.
#[test]
fn store_costs() {
    let _addr = etcd!();
    let Some(e) = started_own_etcd() else {
        return;
    };
    let pid = e.child.as_ref().unwrap().id();
    let tick = 1e6 / 100.0; // µs per clock tick (USER_HZ is 100 on Linux)
    let s = EtcdStore::connect(EtcdConfig::new([e.addr()]).namespace("/costs/")).unwrap();
    const N: usize = 200;
    let ttl = Duration::from_secs(3);
    let (c0, t0) = (cpu_ticks(pid), Instant::now());
    let pubs: Vec<_> = (0..N)
        .map(|i| {
            let mut r = record(&format!("node-{i:04}"));
            r.ttl = ttl;
            s.publish(&r).unwrap()
        })
        .collect();
    let (publish_wall, publish_cpu) = (t0.elapsed(), cpu_ticks(pid) - c0);
    let ops0 = s.ops();
    let (c1, t1) = (cpu_ticks(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(12));
    let held = t1.elapsed();
    let ka = s.ops().keepalives - ops0.keepalives;
    let ka_cpu = cpu_ticks(pid) - c1;
    let (c2, t2) = (cpu_ticks(pid), Instant::now());
    for i in 0..N {
        let n = SegmentName::new(format!("node-{i:04}")).unwrap();
        assert!(s.lookup(&n).unwrap().is_some());
    }
    let (lookup_wall, lookup_cpu) = (t2.elapsed(), cpu_ticks(pid) - c2);
    let ops = s.ops();
    drop(pubs);
    let per = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    println!(
        "costs: {N} publishes: {:.0} µs each (client wall), etcd CPU {:.0} µs each; \
         ops {} grants + {} puts",
        per(publish_wall, N),
        publish_cpu as f64 * tick / N as f64,
        ops0.grants,
        ops0.puts
    );
    println!(
        "costs: {N} leases of TTL {ttl:?} held {held:.1?}: {ka} keep-alives ({:.1}/s), etcd CPU {:.0} µs each",
        ka as f64 / held.as_secs_f64(),
        ka_cpu as f64 * tick / ka.max(1) as f64
    );
    println!(
        "costs: {N} lookups: {:.0} µs each (client wall), etcd CPU {:.0} µs each; ops {:?}",
        per(lookup_wall, N),
        lookup_cpu as f64 * tick / N as f64,
        ops
    );
}

/// `etcdctl ARGS` fed `input` on its standard input; whether it succeeded.
fn etcdctl_in(addr: &str, args: &[&str], input: &[u8]) -> bool {
    use std::io::Write;
    let Ok(mut c) = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={addr}"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
    else {
        return false;
    };
    let fed = c
        .stdin
        .take()
        .is_some_and(|mut i| i.write_all(input).is_ok());
    fed && c.wait().is_ok_and(|s| s.success())
}

/// Until `f` holds, for at most `within`.
fn until(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Another job sharing the etcd deletes our key, then puts our own bytes back under no lease
/// (what a tool that "restores" keys does): the keeper puts the record back under its lease
/// each time, so it stays listed, and stays ours.
#[test]
fn a_record_deleted_or_detached_is_put_back() {
    let addr = etcd!();
    let s = store(&addr, "putback");
    let a = record("a");
    let p = s.publish(&a).unwrap();
    let key = s.key_of(&a.name);
    if !etcdctl(&addr, &["del", &key]) {
        println!("(etcdctl not found: left out)");
        return;
    }
    assert!(
        until(TTL * 2, || s.lookup(&a.name).unwrap() == Some(a.clone())),
        "the deleted record was not put back"
    );
    // Counted just after the put lands.
    assert!(until(TTL, || p.republished() >= 1));
    let before = p.republished();
    assert!(etcdctl_in(&addr, &["put", &key], &a.to_bytes().unwrap()));
    // Under no lease it is no live member's, until the keeper puts it under its lease again
    // (its watch of the key sees the put at once).
    assert!(
        until(TTL * 2, || s.lookup(&a.name).unwrap() == Some(a.clone())),
        "the detached record was not put back under a lease"
    );
    assert!(until(TTL, || p.republished() > before));
    // And a revoke withdraws it for good.
    p.revoke(TTL).unwrap();
    std::thread::sleep(TTL);
    assert_eq!(s.lookup(&a.name).unwrap(), None);
    assert!(s.members().unwrap().is_empty());
}

/// A valid record put under no lease (by hand, or a node's bytes copied by a tool) never
/// expires: it is no live member's, left out of lists, lookups and watches.
#[test]
fn a_record_under_no_lease_is_no_member() {
    let addr = etcd!();
    let s = store(&addr, "nolease");
    let a = record("a");
    let _pa = s.publish(&a).unwrap();
    let mut w = s.watch().unwrap();
    assert_eq!(next(&mut w, TTL), Some(MemberEvent::Joined(a.clone())));
    let ghost = record("ghost");
    let key = s.key_of(&ghost.name);
    if !etcdctl_in(&addr, &["put", &key], &ghost.to_bytes().unwrap()) {
        println!("(etcdctl not found: left out)");
        return;
    }
    assert_eq!(s.lookup(&ghost.name).unwrap(), None);
    assert_eq!(s.members().unwrap(), vec![a.clone()]);
    assert_eq!(next(&mut w, Duration::from_millis(500)), None);
    etcdctl(&addr, &["del", "--prefix", &ns("nolease")]);
}

/// Junk put over our key after our lease was lost: every try to publish again is a lease
/// granted, a transaction and a revoke; they back off (250 ms doubling to the TTL) instead of
/// running four times a second for as long as the junk stays.
#[test]
fn junk_over_a_lost_lease_is_retried_with_backoff() {
    let addr = etcd!();
    let s = store(&addr, "backoff");
    let a = record("a");
    let p = s.publish(&a).unwrap();
    let key = s.key_of(&a.name);
    let lease = format!("{:x}", p.lease_id());
    if !(etcdctl(&addr, &["put", &key, "junk"]) && etcdctl(&addr, &["lease", "revoke", &lease])) {
        println!("(etcdctl not found: left out)");
        return;
    }
    std::thread::sleep(Duration::from_secs(1));
    let g0 = s.ops().grants;
    std::thread::sleep(Duration::from_secs(5));
    let grants = s.ops().grants - g0;
    println!("lease grants in 5 s with junk under the key: {grants}");
    assert!(grants <= 5, "{grants} grants in 5 s");
    // Once the junk goes, the record is back.
    etcdctl(&addr, &["del", &key]);
    assert!(until(TTL * 3, || s.lookup(&a.name).unwrap() == Some(a.clone())));
    drop(p);
    etcdctl(&addr, &["del", "--prefix", &ns("backoff")]);
}

/// Values no record is, each under etcd's request limit, together larger than what the client
/// decodes in one answer: lists read them in smaller pages and leave them out.
#[test]
fn large_junk_values_are_left_out_of_lists() {
    let addr = etcd!();
    let s = store(&addr, "bigjunk");
    let a = record("a");
    let _pa = s.publish(&a).unwrap();
    let junk = vec![b'x'; 1400 * 1024];
    for i in 0..3 {
        let key = format!("{}members/junk-{i}", ns("bigjunk"));
        if !etcdctl_in(&addr, &["put", &key], &junk) {
            println!("(etcdctl not found: left out)");
            return;
        }
    }
    let members = s.members();
    let watch = s.watch();
    let e = Engine::new(EngineConfig::local()).unwrap();
    let attached = e.use_store(&s);
    etcdctl(&addr, &["del", "--prefix", &ns("bigjunk")]);
    assert_eq!(members.unwrap(), vec![a.clone()]);
    let mut w = watch.unwrap();
    assert_eq!(next(&mut w, TTL), Some(MemberEvent::Joined(a.clone())));
    assert!(attached.is_ok());
}

/// More members than a watch holds unread (65,536), written by another job: the watch's
/// first list does not count against that, so it starts; the engine's membership thread does
/// not list again in a loop.
#[test]
fn a_first_list_past_the_watch_queue_starts_the_watch() {
    let addr = etcd!();
    let granted = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={addr}"))
        .args(["lease", "grant", "600"])
        .output();
    // "lease 694d... granted with TTL(600s)"
    let Some(lease) = granted.ok().and_then(|o| {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.split_whitespace().nth(1).map(str::to_string)
    }) else {
        println!("(etcdctl not found: left out)");
        return;
    };
    let n = 66_000;
    let prefix = format!("{}members/", ns("many"));
    let mut i = 0;
    while i < n {
        let mut txn = String::from("\n");
        for _ in 0..128.min(n - i) {
            let node = format!("{:032x}", i as u128 + 1);
            txn.push_str(&format!(
                "put --lease={lease} {prefix}m{i:06} \"gpudirect-member/1\\nname=m{i:06}\\nnode={node}\\nhost=test-host\\nttl_ms=2000\\nrail=10.0.0.1:1\\n\"\n"
            ));
            i += 1;
        }
        txn.push_str("\n\n");
        assert!(etcdctl_in(&addr, &["txn"], txn.as_bytes()));
    }
    let s = store(&addr, "many");
    let mut w = s.watch().unwrap();
    let first = w.next_timeout(Duration::from_secs(5));
    let e = Engine::new(EngineConfig::local()).unwrap();
    let attached = e.use_store(&s);
    let lists = s.ops().lists;
    std::thread::sleep(Duration::from_secs(5));
    let again = s.ops().lists - lists;
    drop((e, w));
    etcdctl(&addr, &["lease", "revoke", &lease]);
    assert!(
        matches!(first, Ok(Some(MemberEvent::Joined(_)))),
        "{first:?}"
    );
    assert!(attached.is_ok());
    assert_eq!(
        again, 0,
        "the membership thread listed {again} pages again in 5 s"
    );
}

/// An etcd that stalls in the middle of a publish (SIGSTOP, then SIGCONT once the publish
/// returned): a publish that returns an error leaves no record behind (none listed a few
/// seconds after etcd runs again, long before the lease's TTL), even though etcd applies the
/// requests the client gave up on once it runs again.
#[test]
fn a_failed_publish_leaves_no_record() {
    let _addr = etcd!();
    let Some(e) = started_own_etcd() else {
        return;
    };
    let child = e.child.as_ref().expect("started");
    let mut cfg = EtcdConfig::new([e.addr()]).namespace("/stall/");
    cfg.op_timeout = Duration::from_secs(1);
    let s = EtcdStore::connect(cfg).unwrap();
    let (mut failed, mut ghosts) = (0, 0);
    for t in 0..8u64 {
        let mut r = record(&format!("g{t}"));
        r.ttl = Duration::from_secs(30);
        let (s2, r2) = (s.clone(), r.clone());
        let h = std::thread::spawn(move || s2.publish(&r2));
        // Stopped a few milliseconds in: after the grant, in the transaction, at times.
        std::thread::sleep(Duration::from_micros(500 * (t % 8) + 1500));
        signal(child, libc::SIGSTOP);
        let res = h.join().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        signal(child, libc::SIGCONT);
        if res.is_err() {
            failed += 1;
            // Gone within a few seconds of etcd running again, not after its 30 s TTL.
            let gone = until(Duration::from_secs(4), || {
                s.lookup(&r.name).is_ok_and(|f| f.is_none())
            });
            ghosts += !gone as usize;
        }
        drop(res);
    }
    println!("{failed} of 8 publishes failed; {ghosts} left a record");
    assert_eq!(ghosts, 0);
}

/// One record published twice: through one store handle the second is refused; through two
/// handles (the same node's record) neither puts it back over the other (a record under a
/// lease with the publication's bytes is held), and when one goes the other puts it back.
#[test]
fn a_record_published_twice_is_kept_once() {
    let addr = etcd!();
    let (s1, s2) = (store(&addr, "twice"), store(&addr, "twice"));
    let a = record("a");
    let p1 = s1.publish(&a).unwrap();
    assert!(matches!(s1.publish(&a), Err(Error::InvalidArgument { .. })));
    let p2 = s2.publish(&a).unwrap();
    let grants = s1.ops().grants + s2.ops().grants;
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        s1.ops().grants + s2.ops().grants,
        grants,
        "the two keepers put the record back over each other"
    );
    // The one that holds the key goes: the other puts the record back under its lease.
    drop(p2);
    assert!(until(TTL * 2, || s1.lookup(&a.name).unwrap() == Some(a.clone())));
    std::thread::sleep(TTL);
    assert_eq!(s1.lookup(&a.name).unwrap(), Some(a.clone()));
    drop(p1);
    // Refused no more once the first is revoked.
    let again = s1.publish(&a).unwrap();
    drop(again);
    etcdctl(&addr, &["del", "--prefix", &ns("twice")]);
}

/// A record deleted again and again is put back under the same lease each time: no lease is
/// granted (and left to expire) per put-back. (Put-backs in quick succession pause, doubling
/// to a third of the TTL: 1 s here.)
#[test]
fn put_backs_grant_no_lease() {
    let addr = etcd!();
    let s = store(&addr, "sameleases");
    let mut a = record("a");
    a.ttl = Duration::from_secs(3);
    let p = s.publish(&a).unwrap();
    let key = s.key_of(&a.name);
    let (lease, grants) = (p.lease_id(), s.ops().grants);
    for _ in 0..6 {
        let before = p.republished();
        if !etcdctl(&addr, &["del", &key]) {
            println!("(etcdctl not found: left out)");
            return;
        }
        assert!(until(TTL * 2, || p.republished() > before));
    }
    assert_eq!(s.ops().grants, grants);
    assert_eq!(p.lease_id(), lease);
    assert_eq!(s.lookup(&a.name).unwrap(), Some(a.clone()));
    drop(p);
}

/// Someone puts the publication's own bytes under its own lease, again and again (nothing
/// changes for any reader): the keep-alives keep their times, the lease never lapses, and no
/// watcher sees a leave.
#[test]
fn puts_that_change_nothing_do_not_delay_keep_alives() {
    let addr = etcd!();
    let s = store(&addr, "samebytes");
    let a = record("a");
    let p = s.publish(&a).unwrap();
    let key = s.key_of(&a.name);
    let bytes = a.to_bytes().unwrap();
    let mut w = s.watch().unwrap();
    assert_eq!(next(&mut w, TTL), Some(MemberEvent::Joined(a.clone())));
    let t0 = Instant::now();
    let mut left = 0;
    while t0.elapsed() < TTL * 4 {
        let lease = format!("--lease={:x}", p.lease_id());
        if !etcdctl_in(&addr, &["put", &lease, &key], &bytes) {
            println!("(etcdctl not found: left out)");
            return;
        }
        while let Some(ev) = next(&mut w, Duration::from_millis(300)) {
            left += matches!(ev, MemberEvent::Left { .. }) as usize;
        }
    }
    drop(p);
    etcdctl(&addr, &["del", "--prefix", &ns("samebytes")]);
    assert_eq!(left, 0, "a kept member was seen leaving");
}

/// A record of another node under no lease is no member's: it does not hold the name against
/// a publish (which overwrites it), nor against a publication putting its record back.
#[test]
fn a_record_under_no_lease_holds_no_name() {
    let addr = etcd!();
    let s = store(&addr, "ghostname");
    let ghost = record("a");
    let key = s.key_of(&ghost.name);
    if !etcdctl_in(&addr, &["put", &key], &ghost.to_bytes().unwrap()) {
        println!("(etcdctl not found: left out)");
        return;
    }
    let mine = record("a");
    let p = s.publish(&mine).unwrap();
    assert_eq!(s.lookup(&mine.name).unwrap(), Some(mine.clone()));
    // Put over it again, under no lease: the publication takes it back.
    assert!(etcdctl_in(
        &addr,
        &["put", &key],
        &ghost.to_bytes().unwrap()
    ));
    assert!(until(TTL * 2, || s.lookup(&mine.name).unwrap()
        == Some(mine.clone())));
    drop(p);
    etcdctl(&addr, &["del", "--prefix", &ns("ghostname")]);
}

/// Another node's record of a name, published through the same store handle (two engines of
/// one process sharing a store): `NameTaken`, as through any other handle.
#[test]
fn another_nodes_publish_through_one_store_is_name_taken() {
    let addr = etcd!();
    let s = store(&addr, "twonodes");
    let (a, b) = (record("x"), record("x"));
    let _p = s.publish(&a).unwrap();
    assert!(matches!(s.publish(&b), Err(Error::NameTaken { .. })));
    drop(_p);
    etcdctl(&addr, &["del", "--prefix", &ns("twonodes")]);
}

/// A value larger than the client decodes (5 MiB, on an etcd that takes requests that large)
/// put over a live publication's key: the keeper sees its record gone and puts it back; a
/// lookup meanwhile says the value is no record (not that the store failed).
#[test]
fn a_value_too_large_to_read_over_a_record_is_put_back() {
    let _addr = etcd!();
    let Some(e) = started_own_etcd_with(&["--max-request-bytes", "10485760"]) else {
        return;
    };
    let s = EtcdStore::connect(EtcdConfig::new([e.addr()]).namespace("/big/")).unwrap();
    let a = record("big");
    let p = s.publish(&a).unwrap();
    let key = s.key_of(&a.name);
    // etcdctl sends at most 2 MiB: through etcd's JSON gateway instead.
    let put = "import base64, json, sys, urllib.request as u\n\
               b = lambda x: base64.b64encode(x).decode()\n\
               d = json.dumps({'key': b(sys.argv[2].encode()), 'value': b(b'x' * (5 << 20))})\n\
               u.urlopen(u.Request('http://' + sys.argv[1] + '/v3/kv/put', d.encode()), timeout=20)";
    let sent = Command::new("python3")
        .args(["-c", put, &e.addr(), &key])
        .status()
        .is_ok_and(|s| s.success());
    if !sent {
        println!("(python3 not found, or etcd refused the value: left out)");
        return;
    }
    assert!(
        until(TTL * 3, || s.lookup(&a.name).ok() == Some(Some(a.clone()))),
        "the record was not put back over the large value"
    );
    assert!(p.republished() >= 1);
    drop(p);
}
